#!/usr/bin/env bash
# Every tier of one model beside its floor, from empty caches, in one run: a one-shot
# `snapfn generate` with nothing cached (its first token and decode ms/step: what compiles on
# the way), then one `snapfn bench` over the cold init, tier 0 (fresh process, zygote, page
# cache dropped) and tier 1 without a keeper (fresh process, zygote's child; each mode a fresh
# process; the bench's compile cache starts empty), then tier 1 through `snapfn keeper --hold
# page-cache`. The bench prints
# each restore's first token over its floor (`*_vs_h2d_floor`, `*_vs_disk_floor`).
# Writes <date>-<machine>-tiers-<model>[-TAG]/.
#
# Usage: bash bench/tiers.sh [--model llama8b] [--backend auto] [--modes LIST] [--keeper on|off]
#          [--tag TAG]
#   --modes   the bench's modes (default cold_init,restore,restore_zygote,restore_cold,
#             init_process,restore_process,restore_process_zygote; the tier-1 ones need .criu
#             carried; none: the one-shot generate only)
#   --keeper  on (default): tier 1 again with the keeper holding the snapshot's pages
set -uo pipefail
. bench/device-env.sh
name=llama8b backend=auto keeper=on tag=
modes=cold_init,restore,restore_zygote,restore_cold,init_process,restore_process
modes=$modes,restore_process_zygote
argv=("$@")
while [ $# -gt 0 ]; do
  case $1 in
    --model) name=$2 ;;
    --backend) backend=$2 ;;
    --modes) modes=$2 ;;
    --keeper) keeper=$2 ;;
    --tag) tag=-$2 ;;
    *) echo "unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
  shift 2
done
results_dir "tiers-${name//[:\/]/-}$tag" bash "$0" "${argv[@]}"
t0=$SECONDS
with_backend "$backend"
dir=$(model "$name") || exit 1
echo "[$((SECONDS - t0)) s] model ready"
rm -rf "$work/generate-cache"
TRITON_CACHE_DIR=$work/generate-cache/triton timeout 120 python3 -m snapfn.handler.cli generate \
  --model "$dir" --device cuda --max-new-tokens 64 > "$res/generate.log" 2>&1
grep -E "first token|decode|load" "$res/generate.log" | head -5
echo "[$((SECONDS - t0)) s] one-shot generate done"
bench=$work/tiers-bench
rm -rf "$bench"
[ "$modes" = none ] && exit 0
bench_modes bench 400 --model "$dir" --device cuda --workdir "$bench" --modes "$modes" \
  --decode-batches 1 --decode-tokens 16
echo "[$((SECONDS - t0)) s] bench done"
if [ "$keeper" = on ] && [ -d "$bench/snapshot_process" ]; then
  # NOTE: python3 -m, not the `snapfn` shell function: `kill` must reach the keeper itself
  python3 -m snapfn.handler.cli keeper --hold page-cache --snapshot "$bench/snapshot_process" \
    2> "$res/keeper.log" > /dev/null &
  pid=$!
  for _ in $(seq 300); do grep -q "serving on" "$res/keeper.log" && break; sleep 0.2; done
  grep -E "process image|serving on" "$res/keeper.log"
  bench_modes keeper 90 --model "$dir" --device cuda --workdir "$bench" \
    --modes restore_process,restore_process_zygote \
    --decode-batches 1 --decode-tokens 16
  kill "$pid"; wait "$pid"
fi
python3 -c "import json,sys; [print(f, json.load(open(f))['ratios']) for f in sys.argv[1:]]" "$res"/*.json
python3 bench/startup_summary.py "$res"/bench.json $(ls "$res"/keeper.json 2>/dev/null)
echo "[$((SECONDS - t0)) s] done"
