#!/usr/bin/env bash
# Device run on one H200: the tier-1 GPU tests, the 8B llama (bf16) steady state on the torch
# reference backend beside its rooflines (`snapfn bench --modes steady`), and one more tier-1
# init + restore of the 8B with the current code.
# Usage (device tool; criu carried as .criu: cp -a /opt/snapfn-criu .criu): bash bench/h200_steady.sh
set -uo pipefail
. bench/device-env.sh
python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_process_gpu.py > "$out/h200-gpu-tests-steady.log" 2>&1
grep -E "^E |passed|failed" "$out/h200-gpu-tests-steady.log" | tail -8
snapfn make-model --preset 8b --dtype bf16 --device cuda --out "$work/llama8b" | tail -1
snapfn bench --model "$work/llama8b" --device cuda --workdir "$work/bench" \
  --modes steady,init_process,restore_process --decode-batches 1,8,32,64 --decode-tokens 32 \
  --prefill-tokens 2048 --out "$out/h200-llama8b-steady.json" 2>&1 | grep -A6 "^mode"
