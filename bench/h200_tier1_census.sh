#!/usr/bin/env bash
# Device run on one H200: where a tier-1 image's bytes come from (8B llama bf16): torch's live
# CUDA blocks outside the regions (SNAPFN_PROCESS_DIAG=1), the worker's private memory before and
# after the CUDA checkpoint (smaps census), then a restore; and the Triton kernels' GPU tests.
# Usage (device tool; criu carried as .criu: cp -a /opt/snapfn-criu .criu): bash bench/h200_tier1_census.sh
set -uo pipefail
. bench/device-env.sh
python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_triton_kernels.py 2>&1 | tail -8
snapfn make-model --preset 8b --dtype bf16 --device cuda --out "$work/llama8b" | tail -1
SNAPFN_PROCESS_DIAG=1 snapfn init --tier process --model "$work/llama8b" --device cuda \
  --snapshot "$work/bench/snapshot_process" 2>&1 \
  | grep -E "at checkpoint|live block|modules from|private memory|released|process image|checkpoint  "
snapfn bench --model "$work/llama8b" --device cuda --workdir "$work/bench" --modes restore_process \
  --decode-batches 1 --out "$out/h200-llama8b-tier1-census.json" 2>&1 | grep -A1 "^mode"
