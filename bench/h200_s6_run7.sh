#!/usr/bin/env bash
# Device run on one H200 (session 6, run 7): the FP8 GEMM kernel autotuned (results cached in
# the Triton cache): its GPU checks; the GLM-5-shaped model (FP8, reduced) in the steady state on
# triton with decode graphs, beside the rooflines of the weights a step reads; then a cold init
# and a tier-0 restore of it with the bench's compile cache deleted in between: the restore must
# compile and tune nothing, and give the cold init's first token.
# Usage (device tool): bash bench/h200_s6_run7.sh
set -uo pipefail
. bench/device-env.sh
t0=$SECONDS
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_triton_kernels.py \
  -k "fp8_gemm or linear_fp8 or engine_greedy-glm" > "$out/h200-gpu-tests-s6run7.log" 2>&1
grep -E "^E  |^FAILED|^ERROR|passed|failed" "$out/h200-gpu-tests-s6run7.log" | tail -20
echo "[$((SECONDS - t0)) s] tests done"
snapfn make-model --preset glm5-reduced --num-layers 2 --dtype fp8 --device cuda --out "$work/glm5" | tail -1
echo "[$((SECONDS - t0)) s] model made"
bench() { timeout 150 python3 -m snapfn.handler.cli bench --model "$work/glm5" --device cuda "$@"; }
bench --workdir "$work/glm-steady" --modes steady --decode-batches 1,8,32 --decode-tokens 16 \
  --prefill-tokens 1024 --out "$out/h200-glm5-reduced-fp8-steady-s6run7.json" 2>&1 | grep -A3 "^mode"
echo "[$((SECONDS - t0)) s] steady done"
rm -rf "$work/glm-steady"
bench --workdir "$work/glm-bench" --modes cold_init --decode-batches 1 --decode-tokens 16 \
  --out "$out/h200-glm5-reduced-fp8-s6run7-init.json" 2>&1 | grep -A2 "^mode"
rm -rf "$work/glm-bench/cache"  # what the init compiled and tuned: gone, as on a new machine
bench --workdir "$work/glm-bench" --modes restore --decode-batches 1 --decode-tokens 16 \
  --out "$out/h200-glm5-reduced-fp8-s6run7-restore.json" 2>&1 | grep -A2 "^mode"
echo "[$((SECONDS - t0)) s] init + restore done"
python3 bench/startup_summary.py "$out"/h200-glm5-reduced-fp8-s6run7-*.json
