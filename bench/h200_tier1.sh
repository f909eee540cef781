#!/usr/bin/env bash
# Device run on one H200: tier-1 process snapshots (GPU tests, then the 8B llama bench with
# modes cold_init, restore, restore_zygote, init_process, restore_process).
# Usage (device tool, criu carried as .criu: cp -a /opt/snapfn-criu .criu): bash bench/h200_tier1.sh
set -uo pipefail
eval "$(bash infra/dev-pythonpath.sh)"
export PYTHONUNBUFFERED=1 SNAPFN_CRIU_PREFIX=${SNAPFN_CRIU_PREFIX:-$PWD/.criu}
out=${OUT:-bench/results}
work=/tmp/snapfn-h200
mkdir -p "$work" "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -m snapfn.handler.cli doctor
python3 -m pytest -q -s -p no:cacheprovider tests/test_process_gpu.py tests/test_process_llm.py 2>&1 | tail -25
python3 -m snapfn.handler.cli make-model --preset 8b --dtype bf16 --device cuda --out "$work/llama8b"
python3 -m snapfn.handler.cli bench --model "$work/llama8b" --device cuda --workdir "$work/bench" \
  --modes cold_init,restore,restore_zygote,init_process,restore_process \
  --decode-batches 1,32 --decode-tokens 32 \
  --out "$out/h200-llama8b-tier1.json" --plot "$out/h200-llama8b-tier1.png"
SNAPFN_PROCESS_FRESH_RING=1 python3 -m snapfn.handler.cli bench --model "$work/llama8b" \
  --device cuda --workdir "$work/bench" --modes restore_process --decode-batches 1 \
  --out "$out/h200-llama8b-tier1-freshring.json"
du -sh "$work/bench/snapshot_process/process"
