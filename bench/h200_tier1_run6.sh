#!/usr/bin/env bash
# Device run on one H200 (8B llama bf16): two experiments on the tier-1 image, each on a fresh
# process snapshot, restore timed by the bench: the CUDA stack limit lowered to 256 B for the
# checkpoint and set back first thing after the restore (SNAPFN_PROCESS_STACK_BYTES=256); the
# worker's anonymous memory, the driver's copy of the GPU state included, advised for huge pages
# between the CUDA checkpoint and the dump (SNAPFN_PROCESS_THP=1).
# Usage (device tool; criu carried as .criu: cp -a /opt/snapfn-criu .criu): bash bench/h200_tier1_run6.sh
set -uo pipefail
. bench/device-env.sh
snapfn make-model --preset 8b --dtype bf16 --device cuda --out "$work/llama8b" | tail -1
for exp in SNAPFN_PROCESS_STACK_BYTES=256 SNAPFN_PROCESS_THP=1; do
  rm -rf "$work/bench"
  ( export "$exp"; snapfn bench --model "$work/llama8b" --device cuda --workdir "$work/bench" \
    --modes init_process,restore_process --decode-batches 1 \
    --out "$out/h200-llama8b-tier1-run6-${exp%%=*}.json" 2>&1 | grep -A2 "^mode" )
  python3 - "$work/bench/snapshot_process/manifest.json" <<'PY'
import json, sys
meta = json.load(open(sys.argv[1])).get("process") or {}
print("image_bytes", meta.get("image_bytes"), "worker", meta.get("worker"), "thp", meta.get("private_memory", {}).get("huge_page_advice"))
PY
done
