#!/usr/bin/env bash
# Device run on one H200 (session 10, run 4): the autotune cache test that run 3's 150 s cut
# off (a fresh process tunes and caches every autotuned kernel, a second one tunes nothing).
# Usage (device tool): bash bench/h200_s10_run4.sh
set -uo pipefail
. bench/device-env.sh
timeout 150 python3 -m pytest -v -m gpu -p no:cacheprovider tests/test_triton_kernels.py -k "autotune_results" \
  > "$out/h200-gpu-tests-s10run4-autotune.log" 2>&1
echo rc $?
grep -E "PASSED|FAILED|ERROR|passed|failed|^E " "$out/h200-gpu-tests-s10run4-autotune.log" | tail -8
