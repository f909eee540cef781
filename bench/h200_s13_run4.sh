#!/usr/bin/env bash
# Device run on one H200 (session 13, run 4; the session's last device minutes): the GPU
# checks run 3's timeout cut, on the committed tree: glm-tiny's whole-model greedy case from a
# bf16 checkpoint and with session 12's switches off (SNAPFN_GEMV_SPLIT, SNAPFN_CACHE_STORES:
# never run on a GPU before), and the autotuned-kernel list.
# Usage (device tool): bash bench/h200_s13_run4.sh
set -uo pipefail
. bench/device-env.sh
results_tarball s13run4
t0=$SECONDS
gpu_tests triton 250 tests/test_triton_kernels.py "glm-tiny-bf16ckpt or switchesoff or autotuned"
tests_summary
echo "[$((SECONDS - t0)) s] done"
