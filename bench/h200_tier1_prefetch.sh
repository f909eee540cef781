#!/usr/bin/env bash
# Device run on one H200: tier-1 restore with the restorer making and filling the worker's
# regions beside criu (snapshot/keeper/region_prefetch.py), against tier 0 and cold init in the same
# run (8B llama bf16), then the same process snapshot restored with the prefetch off; before
# that, the GPU tests of tier 1 and a probe of what a CUDA context holds on the device.
# Usage (device tool; criu carried as .criu: cp -a /opt/snapfn-criu .criu): bash bench/h200_tier1_prefetch.sh
set -uo pipefail
. bench/device-env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 bench/probes/context_memory.py
python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_process_gpu.py tests/test_checksum.py 2>&1 | tail -8
snapfn make-model --preset 8b --dtype bf16 --device cuda --out "$work/llama8b" | tail -1
snapfn bench --model "$work/llama8b" --device cuda --workdir "$work/bench" \
  --modes cold_init,restore,init_process,restore_process --decode-batches 1 \
  --out "$out/h200-llama8b-tier1-prefetch.json" 2>&1 | grep -E "^mode|^restore|^cold|^init|private memory|process image"
SNAPFN_PROCESS_PREFETCH=off snapfn bench --model "$work/llama8b" --device cuda --workdir "$work/bench" \
  --modes restore_process --decode-batches 1 \
  --out "$out/h200-llama8b-tier1-noprefetch.json" 2>&1 | grep -A1 "^mode"
