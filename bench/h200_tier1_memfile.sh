#!/usr/bin/env bash
# Device run on one H200 (session 4, run 1): the tier-1 GPU tests, then the 8B llama (bf16)
# bench with cold init, tier 0 and tier 1 side by side, tier 1 with the worker's large anonymous
# memory (heap, driver's copy of the GPU state) moved from criu's page image to memory.bin
# (SNAPFN_PROCESS_MEMORY=file, the default), two more tier-1 restores; then, each on a fresh
# process snapshot: every page left in criu's image (SNAPFN_PROCESS_MEMORY=image), and the
# worker in its own pid + mount namespace (SNAPFN_PROCESS_PID_NAMESPACE=mount).
# Usage (device tool; criu carried as .criu: cp -a /opt/snapfn-criu .criu): bash bench/h200_tier1_memfile.sh
set -uo pipefail
. bench/device-env.sh
t0=$SECONDS
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_process_gpu.py tests/test_checksum.py \
  tests/test_triton_kernels.py > "$out/h200-gpu-tests.log" 2>&1
grep -E "^E |passed|failed" "$out/h200-gpu-tests.log" | tail -25
echo "[$((SECONDS - t0)) s] tests done"
snapfn make-model --preset 8b --dtype bf16 --device cuda --out "$work/llama8b" | tail -1
echo "[$((SECONDS - t0)) s] model made"
bench() { snapfn bench --model "$work/llama8b" --device cuda "$@"; }
manifest() {
  python3 - "$1/snapshot_process/manifest.json" <<'PY'
import json, sys
meta = json.load(open(sys.argv[1])).get("process") or {}
print("image_bytes", meta.get("image_bytes"), "memory", meta.get("memory"), "seconds", meta.get("seconds"))
PY
}
bench --workdir "$work/bench" --modes cold_init,restore,init_process,restore_process \
  --decode-batches 1,32 --out "$out/h200-llama8b-tier1-memfile.json" \
  --plot "$out/h200-llama8b-tier1-memfile.png" 2>&1 | grep -A12 "^mode"
manifest "$work/bench"
for i in 2 3; do
  bench --workdir "$work/bench" --modes restore_process --decode-batches 1 \
    --out "$out/h200-llama8b-tier1-memfile-$i.json" 2>&1 | grep -A1 "^mode"
done
echo "[$((SECONDS - t0)) s] memory=file done"
for exp in SNAPFN_PROCESS_MEMORY=image SNAPFN_PROCESS_PID_NAMESPACE=mount; do
  rm -rf "$work/bench-exp"
  ( export "$exp"; bench --workdir "$work/bench-exp" --modes init_process,restore_process \
    --decode-batches 1 --out "$out/h200-llama8b-tier1-memfile-${exp#SNAPFN_PROCESS_}.json" 2>&1 \
    | grep -E -A2 "^mode|rror" | head -20 )
  manifest "$work/bench-exp"
  echo "[$((SECONDS - t0)) s] $exp done"
done
