#!/usr/bin/env bash
# Device run on one H200 (session 16, run 4): the tier-1 GPU test that failed in run 2 (the
# embedded model's cold init on CUDA: a device-side assert from a memory-profile prompt past its
# RoPE table) and that run 3 gave too little time, after the fix: first on the torch backend
# (quick), then on the default one (flashinfer, whose Triton kernels tune for minutes first).
# Usage (device tool; carry .criu, .whl, .ficache): bash bench/h200_s16_run4.sh
set -uo pipefail
. bench/device-env.sh
results_tarball s16run4
t0=$SECONDS
. bench/device-flashinfer.sh
SNAPFN_BACKEND=torch gpu_tests tier1-torch 120 tests/test_process_gpu.py tier1
echo "[$((SECONDS - t0)) s] torch done"
gpu_tests tier1-default $((400 - SECONDS)) tests/test_process_gpu.py tier1
tests_summary
echo "[$((SECONDS - t0)) s] done"
