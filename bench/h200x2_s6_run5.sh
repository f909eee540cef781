#!/usr/bin/env bash
# Device run on two H200s (session 6, run 5): expert parallel at ep=2 over NCCL (DeepEP is not
# installed there, so this is the fallback path) against ep=1 on one GPU; then the GLM-5-shaped
# model (glm_moe_dsa, FP8, reduced to 1 dense + 1 MoE layer + MTP as in bench/h200_glm5.sh) in
# the steady state on the default backend (triton here: flashinfer is not carried), eager decode
# (decode graphs are llama-only).
# Usage (device tool, kind nvidia-h200-x2): bash bench/h200x2_s6_run5.sh
set -uo pipefail
. bench/device-env.sh
t0=$SECONDS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/test_expert_parallel.py \
  > "$out/h200x2-gpu-tests-s6run5.log" 2>&1
grep -E "^E  |^FAILED|^ERROR|passed|failed|SKIPPED" "$out/h200x2-gpu-tests-s6run5.log" | tail -20
echo "[$((SECONDS - t0)) s] tests done"
snapfn make-model --preset glm5-reduced --num-layers 2 --dtype fp8 --device cuda --out "$work/glm5" | tail -1
echo "[$((SECONDS - t0)) s] model made"
timeout 280 python3 -m snapfn.handler.cli bench --model "$work/glm5" --device cuda --workdir "$work/glm-steady" \
  --modes steady --decode-batches 1,8,32 --decode-tokens 16 --prefill-tokens 1024 \
  --out "$out/h200-glm5-reduced-fp8-steady-s6.json" 2>&1 | grep -A8 "^mode"
echo "[$((SECONDS - t0)) s] glm steady done"
