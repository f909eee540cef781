#!/usr/bin/env bash
# Device run on one H200: tier-1 GPU tests (full output), then the 8B llama bench with cold
# init, tier 0 and tier 1 side by side (region prefetch, validation beside criu, stack limit
# lowered before the checkpoint), the process image's private-memory census, a second tier-1
# restore of the same snapshot.
# Usage (device tool; criu carried as .criu: cp -a /opt/snapfn-criu .criu): bash bench/h200_tier1_run3.sh
set -uo pipefail
. bench/device-env.sh
python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_process_gpu.py > "$out/gpu-tests.log" 2>&1
grep -E "Error|assert|passed|failed" "$out/gpu-tests.log" | tail -25
snapfn make-model --preset 8b --dtype bf16 --device cuda --out "$work/llama8b" | tail -1
snapfn bench --model "$work/llama8b" --device cuda --workdir "$work/bench" \
  --modes cold_init,restore,init_process,restore_process --decode-batches 1,32 \
  --out "$out/h200-llama8b-tier1-run3.json" --plot "$out/h200-llama8b-tier1-run3.png" 2>&1 | grep -A12 "^mode"
python3 - "$work/bench/snapshot_process/manifest.json" <<'PY'
import json, sys
meta = json.load(open(sys.argv[1]))["process"]
print("image_bytes", meta["image_bytes"], "worker", meta["worker"])
for stage, found in meta["private_memory"].items():
    print(stage, found.get("private_bytes"), [(n.rsplit("/", 1)[-1], b) for n, b in found.get("top", [])[:6]])
PY
snapfn bench --model "$work/llama8b" --device cuda --workdir "$work/bench" --modes restore_process \
  --decode-batches 1 --out "$out/h200-llama8b-tier1-run3b.json" 2>&1 | grep -A1 "^mode"
