#!/usr/bin/env bash
# Device run on one H200: what stays on the GPU at a tier-1 checkpoint (8B llama), then one restore.
set -uo pipefail
. bench/device-env.sh
snapfn make-model --preset 8b --dtype bf16 --device cuda --out "$work/llama8b" | tail -1
snapfn init --tier process --model "$work/llama8b" --device cuda --snapshot "$work/bench/snapshot_process" 2>&1 \
  | grep -E "at checkpoint|allocator|released|checkpoint  "
snapfn bench --model "$work/llama8b" --device cuda --workdir "$work/bench" --modes restore_process \
  --decode-batches 1 --out "$out/h200-llama8b-tier1-segments.json" 2>&1 | grep -A1 "^mode"
