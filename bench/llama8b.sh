#!/usr/bin/env bash
# Cold start of an 8B-class llama (Llama-3-8B shapes, bf16, random weights, 16.2 GB) on one GPU,
# every tier side by side in one `snapfn bench` call, each mode in a fresh process: HF
# transformers, safetensors into the engine, snapfn's cold init, the tier-0 restore (page cache
# warm, from a zygote, page cache dropped), the tier-1 init and restore. Writes the bench's JSON,
# its output and the waterfall plot into <date>-<machine>-llama8b-tiers[-TAG]/.
#
# Usage: bash bench/llama8b.sh [--modes LIST] [--backend auto|torch|triton|flashinfer]
#          [--decode-batches 1,32] [--decode-tokens 32] [--model NAME|DIR] [--tag TAG]
#   --modes     a subset of hf,safetensors,cold_init,restore,restore_zygote,restore_cold,
#               init_process,restore_process (default: all eight; the last two need criu: carry
#               .criu, a copy of /opt/snapfn-criu after infra/install-criu.sh)
#   --backend   SNAPFN_BACKEND (default auto: flashinfer where .whl is carried, else triton)
#   --model     a bench/device-env.sh model name or a directory (default llama8b)
set -uo pipefail
. bench/device-env.sh
modes=hf,safetensors,cold_init,restore,restore_zygote,restore_cold,init_process,restore_process
backend=auto batches=1,32 tokens=32 name=llama8b tag=
argv=("$@")
while [ $# -gt 0 ]; do
  case $1 in
    --modes) modes=$2 ;;
    --backend) backend=$2 ;;
    --decode-batches) batches=$2 ;;
    --decode-tokens) tokens=$2 ;;
    --model) name=$2 ;;
    --tag) tag=-$2 ;;
    *) echo "unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
  shift 2
done
results_dir "llama8b-tiers$tag" bash "$0" "${argv[@]}"
with_backend "$backend"
dir=$(model "$name") || exit 1
rm -rf "$work/llama8b-bench"  # 64 GB of disk: one model and its two snapshots at a time
bench_modes bench 590 --model "$dir" --device cuda --workdir "$work/llama8b-bench" --modes "$modes" \
  --decode-batches "$batches" --decode-tokens "$tokens" --plot "$res/bench.png"
python3 bench/startup_summary.py "$res/bench.json"
