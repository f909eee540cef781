#!/usr/bin/env bash
# Device run on one H200 (session 9, run 4): run 3's benches timed out (100 s was too short for
# a cold init that now also tunes the fused GEMV), and its GLM greedy cases were cut off. Here:
# the glm-small whole-model greedy case with graphs (while the 8B is made), then the 8B llama
# (bf16) in the steady state with every default (fused GEMV, Triton attention for one-request
# decode, Triton picks, overlap), then with the fused GEMV off at batch 1 and 8, side by side.
# Usage (device tool; carry .whl, .ficache): bash bench/h200_s9_run4.sh
set -uo pipefail
. bench/device-env.sh
t0=$SECONDS
. bench/device-flashinfer.sh
(snapfn make-model --preset 8b --dtype bf16 --device cuda --out "$work/llama8b" > "$out/h200-s9run4-make-model.log" 2>&1; echo "model rc $?") &
timeout 95 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_flashinfer.py \
  -k "engine_greedy-glm-graphs" > "$out/h200-gpu-tests-s9run4-flashinfer.log" 2>&1
grep -E "^E  |^FAILED|^ERROR|passed|failed" "$out/h200-gpu-tests-s9run4-flashinfer.log" | tail -6
wait
echo "[$((SECONDS - t0)) s] test and model done"
SNAPFN_BACKEND=flashinfer timeout 190 python3 -m snapfn.handler.cli bench \
  --model "$work/llama8b" --device cuda --modes steady --decode-batches 1,8,32,64 --decode-tokens 32 \
  --workdir "$work/steady-flashinfer" --out "$out/h200-llama8b-steady-s9run4.json" 2>&1 | grep -A3 "^mode"
echo "[$((SECONDS - t0)) s] llama8b defaults done"
SNAPFN_GEMV=off SNAPFN_BACKEND=flashinfer timeout $((385 - SECONDS)) python3 -m snapfn.handler.cli bench \
  --model "$work/llama8b" --device cuda --modes steady --decode-batches 1,8 --decode-tokens 32 \
  --workdir "$work/steady-flashinfer" --out "$out/h200-llama8b-steady-s9run4-gemv-off.json" 2>&1 | grep -A3 "^mode"
echo "[$((SECONDS - t0)) s] llama8b gemv off done"
