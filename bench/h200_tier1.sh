#!/usr/bin/env bash
# Device run on one H200: tier-1 process snapshots. GPU tests, then the 8B llama (bf16) bench with
# modes cold_init, restore, restore_zygote, init_process, restore_process (lazy criu pages), then
# restore_process again with eager pages.
# Usage (device tool; criu carried as .criu: cp -a /opt/snapfn-criu .criu): bash bench/h200_tier1.sh
set -uo pipefail
eval "$(bash infra/dev-pythonpath.sh)"
export PYTHONUNBUFFERED=1 SNAPFN_CRIU_PREFIX=${SNAPFN_CRIU_PREFIX:-$PWD/.criu}
export SNAPFN_PROCESS_KEEP_RING=${SNAPFN_PROCESS_KEEP_RING:-0}
out=${OUT:-bench/results}
work=/tmp/snapfn-h200
mkdir -p "$work" "$out"
snapfn() { python3 -m snapfn.handler.cli "$@"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -m pytest -q -s -p no:cacheprovider tests/test_process_gpu.py 2>&1 | tail -8
snapfn make-model --preset 8b --dtype bf16 --device cuda --out "$work/llama8b" | tail -1
snapfn bench --model "$work/llama8b" --device cuda --workdir "$work/bench" \
  --modes cold_init,restore,restore_zygote,init_process,restore_process \
  --decode-batches 1,32 --decode-tokens 32 \
  --out "$out/h200-llama8b-tier1.json" --plot "$out/h200-llama8b-tier1.png"
SNAPFN_PROCESS_LAZY=off snapfn bench --model "$work/llama8b" --device cuda --workdir "$work/bench" \
  --modes restore_process --decode-batches 1 --out "$out/h200-llama8b-tier1-eager.json" 2>&1 | grep -A1 "^mode"
ls -l "$work/bench/snapshot_process/process" | sort -k5 -n | tail -3
