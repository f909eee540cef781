#!/usr/bin/env bash
# Cold start of the GLM-5-shaped model (`glm_moe_dsa`: GLM-5's per-layer shapes, FP8 128x128
# blocks, at reduced depth so that checkpoint and snapshot fit a 64 GB disk; 2 layers: 24.1 GB)
# on one GPU. Two measurements:
# - the tiers side by side in one `snapfn bench` call (safetensors, cold init, the tier-0
#   restores), into <date>-<machine>-glm5-fp8-tiers[-TAG]/; transformers has no FP8 path for
#   this model here (it needs the `kernels` package), so mode hf is left out;
# - with --fresh-cache: the cold init, then the bench's compile cache deleted, as on a new
#   machine, then a tier-0 restore, which must compile nothing (every stage's compiled_files 0)
#   and give the cold init's first token and logprob, into <date>-<machine>-glm5-fp8-restore/.
#
# Usage: bash bench/glm5.sh [--fresh-cache] [--modes LIST] [--layers 2]
#          [--backend auto|torch|triton|flashinfer] [--tag TAG]
#   --backend   SNAPFN_BACKEND (default auto; --fresh-cache runs flashinfer: carry .whl, .ficache)
set -uo pipefail
. bench/device-env.sh
modes=safetensors,cold_init,restore,restore_zygote,restore_cold
fresh= backend= tag=
argv=("$@")
while [ $# -gt 0 ]; do
  case $1 in
    --fresh-cache) fresh=1; shift; continue ;;
    --modes) modes=$2 ;;
    --layers) glm5_layers=$2 ;;
    --backend) backend=$2 ;;
    --tag) tag=-$2 ;;
    *) echo "unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
  shift 2
done
what=glm5-fp8-tiers
[ -n "$fresh" ] && what=glm5-fp8-restore
results_dir "$what$tag" bash "$0" "${argv[@]}"
backend=${backend:-$([ -n "$fresh" ] && echo flashinfer || echo auto)}
with_backend "$backend"
dir=$(model glm5) || exit 1
bench=$work/glm5-bench
rm -rf "$bench"
if [ -z "$fresh" ]; then
  bench_modes bench 590 --model "$dir" --device cuda --workdir "$bench" --modes "$modes" \
    --decode-batches 1,32 --decode-tokens 16 --plot "$res/bench.png"
  python3 bench/startup_summary.py "$res/bench.json"
  exit
fi
bench_modes init 300 --model "$dir" --device cuda --workdir "$bench" --modes cold_init \
  --decode-batches 1 --decode-tokens 16
rm -rf "$bench/cache"  # what the init compiled and tuned: gone, as on a new machine
bench_modes restore 120 --model "$dir" --device cuda --workdir "$bench" --modes restore \
  --decode-batches 1 --decode-tokens 16
python3 bench/startup_summary.py "$res/init.json" "$res/restore.json"
