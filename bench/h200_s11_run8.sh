#!/usr/bin/env bash
# Device run on one H200 (session 11, run 8; the session's last device seconds): GPU checks of
# what came after run 7 — the fused GEMV with a float32 weight (the indexer's `weights_proj`
# and the MoE router, now through it at batch 1), the FP8 GEMV's new config list, every config
# of one token's MoE GEMVs (two added), and the autotuned-kernel list.
# Usage (device tool): bash bench/h200_s11_run8.sh
set -uo pipefail
. bench/device-env.sh
timeout 170 python3 -m pytest -v -m gpu -p no:cacheprovider tests/test_triton_kernels.py \
  -k "gemv-fp32w or gemv-fp8-bf16 or backend_gemv-bf16 or moe_configs-gemv_fp8 or autotuned" \
  > "$out/h200-gpu-tests-s11run8.log" 2>&1
grep -E "PASSED|FAILED|ERROR|^E  |passed|failed" "$out/h200-gpu-tests-s11run8.log" | tail -12
