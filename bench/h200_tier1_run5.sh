#!/usr/bin/env bash
# Device run on one H200: tier-1 GPU tests, the 8B llama bench (cold init, tier 0, tier 1 side by
# side), the same process snapshot restored with lazy pages, then two experiments, each on a
# fresh process snapshot: the CUDA stack limit lowered to 256 B for the checkpoint and set back
# first thing after the restore (SNAPFN_PROCESS_STACK_BYTES=256), and the worker's anonymous
# memory advised for huge pages before the dump (SNAPFN_PROCESS_THP=1).
# Usage (device tool; criu carried as .criu: cp -a /opt/snapfn-criu .criu): bash bench/h200_tier1_run5.sh
set -uo pipefail
. bench/device-env.sh
python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_process_gpu.py tests/test_checksum.py > "$out/gpu-tests.log" 2>&1
grep -E "^E |passed|failed" "$out/gpu-tests.log" | tail -25
snapfn make-model --preset 8b --dtype bf16 --device cuda --out "$work/llama8b" | tail -1
census() {
python3 - "$1/manifest.json" <<'PY'
import json, sys
meta = json.load(open(sys.argv[1])).get("process") or {}
print("image_bytes", meta.get("image_bytes"), "worker", meta.get("worker"))
for stage, found in meta.get("private_memory", {}).items():
    print(stage, found.get("private_bytes"), [(n.rsplit("/", 1)[-1], b) for n, b in found.get("top", [])[:4]])
PY
}
bench() { snapfn bench --model "$work/llama8b" --device cuda --workdir "$work/bench" "$@"; }
bench --modes cold_init,restore,init_process,restore_process --decode-batches 1,32 \
  --out "$out/h200-llama8b-tier1-run5.json" --plot "$out/h200-llama8b-tier1-run5.png" 2>&1 | grep -A12 "^mode"
census "$work/bench/snapshot_process"
SNAPFN_PROCESS_LAZY=on bench --modes restore_process --decode-batches 1 \
  --out "$out/h200-llama8b-tier1-run5-lazy.json" 2>&1 | grep -A1 "^mode"
for exp in SNAPFN_PROCESS_STACK_BYTES=256 SNAPFN_PROCESS_THP=1; do
  rm -rf "$work/bench/snapshot_process" "$work/bench/snapshot"
  env "$exp" snapfn bench --model "$work/llama8b" --device cuda --workdir "$work/bench" \
    --modes init_process,restore_process --decode-batches 1 \
    --out "$out/h200-llama8b-tier1-run5-${exp%%=*}.json" 2>&1 | grep -A2 "^mode"
  census "$work/bench/snapshot_process"
done
