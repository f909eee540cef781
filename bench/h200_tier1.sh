#!/usr/bin/env bash
# Device run on one H200: tier-1 process snapshots on the 8B llama (bf16): bench modes cold_init,
# restore, restore_zygote, init_process, restore_process (pinned ring dropped from the image),
# then the same process snapshot built with the ring kept in the image.
# Usage (device tool; criu carried as .criu: cp -a /opt/snapfn-criu .criu): bash bench/h200_tier1.sh
set -uo pipefail
. bench/device-env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
snapfn make-model --preset 8b --dtype bf16 --device cuda --out "$work/llama8b" | tail -1
SNAPFN_PROCESS_KEEP_RING=0 snapfn bench --model "$work/llama8b" --device cuda --workdir "$work/bench" \
  --modes cold_init,restore,restore_zygote,init_process,restore_process \
  --decode-batches 1,32 --decode-tokens 32 \
  --out "$out/h200-llama8b-tier1.json" --plot "$out/h200-llama8b-tier1.png"
rm -rf "$work/bench/snapshot"
SNAPFN_PROCESS_KEEP_RING=1 snapfn bench --model "$work/llama8b" --device cuda --workdir "$work/bench" \
  --modes init_process,restore_process --decode-batches 1 \
  --out "$out/h200-llama8b-tier1-keepring.json" 2>&1 | grep -A3 "^mode"
