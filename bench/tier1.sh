#!/usr/bin/env bash
# Tier-1 detail (process snapshots) on one GPU, the 8B llama by default: the cold init and a
# process snapshot (`init_process`); the bench's compile cache deleted, as on a new machine; then,
# through the chosen keeper, a tier-0 and a tier-1 restore side by side and more tier-1 restores
# of the same snapshot. Every restore is checked against the cold init's first token and logprob
# (its replay check) and must compile nothing. Prints each restore's stages (bench/tier1_summary.py)
# and what each stage compiled or restored (bench/startup_summary.py). Writes
# <date>-<machine>-tier1-<model>[-TAG]/: init.json, restore.json (tier 0 and tier 1),
# restore-N.json and restore-VAR-VALUE.json (the further tier-1 restores), the keeper's log.
#
# Usage: bash bench/tier1.sh [--model llama8b] [--backend auto|torch|triton|flashinfer]
#          [--keeper page-cache|copy|warm|none] [--restores 2] [--variant VAR=VALUE]...
#          [--env VAR=VALUE]... [--keep-cache] [--tests] [--tag TAG]
#   --keeper    page-cache: `snapfn keeper --hold page-cache` (the snapshot's page-cache pages
#               pinned in place; the default); copy: `snapfn pin` (the weights copied into pinned
#               CUDA host memory); warm: `snapfn keeper` holding no weights (a warm CUDA driver);
#               none: each restore starts its own driver and prefetch helper
#   --restores  tier-1 restores after the first (default 2)
#   --variant   one more tier-1 restore of the same snapshot with VAR=VALUE set (e.g.
#               SNAPFN_PROCESS_PREFETCH_THREADS=16); repeatable
#   --env       VAR=VALUE set for the whole run, init included (e.g. SNAPFN_PROCESS_MEMORY=image)
#   --keep-cache  keep the compile cache the init filled (default: deleted before the restores)
#   --tests     first, the tier-1 GPU tests (tests/test_process_gpu.py) into gpu-tests-tier1.log
# Carry .criu (a copy of /opt/snapfn-criu after infra/install-criu.sh), and .whl and .ficache for
# flashinfer.
set -uo pipefail
. bench/device-env.sh
name=llama8b backend=auto keeper=page-cache restores=2 keep_cache= tests= tag=
variants=()
argv=("$@")
while [ $# -gt 0 ]; do
  case $1 in
    --keep-cache) keep_cache=1; shift; continue ;;
    --tests) tests=1; shift; continue ;;
    --model) name=$2 ;;
    --backend) backend=$2 ;;
    --keeper) keeper=$2 ;;
    --restores) restores=$2 ;;
    --variant) variants+=("$2") ;;
    --env) export "${2?}" ;;
    --tag) tag=-$2 ;;
    *) echo "unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
  shift 2
done
results_dir "tier1-${name//[:\/]/-}$tag" bash "$0" "${argv[@]}"
t0=$SECONDS
with_backend "$backend"
if [ -n "$tests" ]; then
  gpu_tests tier1 240 tests/test_process_gpu.py ""
  tests_summary
fi
dir=$(model "$name") || exit 1
bench=$work/tier1-bench
rm -rf "$bench"
run() { bench_modes "$1" "$2" --model "$dir" --device cuda --workdir "$bench" --decode-batches 1 \
  --decode-tokens 16 "${@:3}"; }
run init 300 --modes cold_init,init_process
echo "[$((SECONDS - t0)) s] snapshots made"
[ -n "$keep_cache" ] || rm -rf "$bench/cache"  # what the init compiled or tuned: gone
pid=
case $keeper in
  page-cache) keeper_cmd=(keeper --hold page-cache --snapshot "$bench/snapshot_process") ;;
  copy) keeper_cmd=(pin --snapshot "$bench/snapshot_process") ;;
  warm) keeper_cmd=(keeper) ;;
  none) keeper_cmd=() ;;
  *) echo "unknown keeper $keeper" >&2; exit 2 ;;
esac
if [ ${#keeper_cmd[@]} -gt 0 ]; then
  # NOTE: python3 -m, not the `snapfn` shell function: `kill` must reach the keeper itself
  python3 -m snapfn.handler.cli "${keeper_cmd[@]}" 2> "$res/keeper.log" > /dev/null &
  pid=$!
  for _ in $(seq 300); do grep -q "serving on" "$res/keeper.log" && break; sleep 0.2; done
  tail -1 "$res/keeper.log"
fi
run restore 120 --modes restore,restore_process
for i in $(seq 2 $((restores + 1))); do run "restore-$i" 60 --modes restore_process; done
for v in "${variants[@]}"; do
  (export "$v"; run "restore-${v//=/-}" 60 --modes restore_process)
done
[ -n "$pid" ] && { kill "$pid"; wait "$pid"; }
echo "[$((SECONDS - t0)) s] restores done"
for f in "$res"/restore*.json; do python3 bench/tier1_summary.py "$f"; done
python3 bench/startup_summary.py "$res"/init.json "$res"/restore*.json
