#!/usr/bin/env bash
# Device run on one H200 (prepared in session 4, NOT YET RUN): the GPU tests first (tier 1 and
# the VMM helpers merged in f1fdc2f; the Triton checks compiled, with the paged decode attention
# and the whole-model greedy parity cases), then the 8B llama (bf16) steady state with the
# torch reference and the triton backend side by side, and a decode profile of each.
# Usage (device tool; criu carried as .criu: cp -a /opt/snapfn-criu .criu): bash bench/h200_kernels.sh
set -uo pipefail
. bench/device-env.sh
t0=$SECONDS
python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_process_gpu.py tests/test_checksum.py \
  tests/test_triton_kernels.py > "$out/h200-gpu-tests-kernels.log" 2>&1
grep -E "^E |passed|failed" "$out/h200-gpu-tests-kernels.log" | tail -25
snapfn make-model --preset 8b --dtype bf16 --device cuda --out "$work/llama8b" | tail -1
echo "[$((SECONDS - t0)) s] model made"
for backend in torch triton; do
  SNAPFN_BACKEND=$backend snapfn bench --model "$work/llama8b" --device cuda --modes steady \
    --decode-batches 1,8,32,64 --workdir "$work/steady-$backend" \
    --out "$out/h200-llama8b-steady-$backend.json" 2>&1 | grep -A6 "^mode"
  python3 bench/probes/decode_profile.py "$work/llama8b" --backend "$backend" \
    > "$out/h200-llama8b-decode-profile-$backend.json" 2>/dev/null
  head -c 600 "$out/h200-llama8b-decode-profile-$backend.json"; echo
  echo "[$((SECONDS - t0)) s] $backend done"
done
