#!/usr/bin/env bash
# Device run on one H200: the tier-1 GPU tests, then the 8B llama (bf16) bench with cold init,
# tier 0 and tier 1 side by side (region prefetch beside criu, validation beside criu, stack
# limit lowered for the checkpoint), and two more tier-1 restores of the same snapshot.
# Usage (device tool; criu carried as .criu: cp -a /opt/snapfn-criu .criu): bash bench/h200_tier1_final.sh
set -uo pipefail
. bench/device-env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_process_gpu.py tests/test_checksum.py \
  tests/test_triton_kernels.py > "$out/h200-gpu-tests.log" 2>&1
grep -E "^E |passed|failed" "$out/h200-gpu-tests.log" | tail -25
snapfn make-model --preset 8b --dtype bf16 --device cuda --out "$work/llama8b" | tail -1
bench() { snapfn bench --model "$work/llama8b" --device cuda --workdir "$work/bench" "$@"; }
bench --modes cold_init,restore,init_process,restore_process --decode-batches 1,32 \
  --out "$out/h200-llama8b-tier1-final.json" --plot "$out/h200-llama8b-tier1-final.png" 2>&1 | grep -A12 "^mode"
for i in 2 3; do
  bench --modes restore_process --decode-batches 1 --out "$out/h200-llama8b-tier1-final-$i.json" 2>&1 | grep -A1 "^mode"
done
