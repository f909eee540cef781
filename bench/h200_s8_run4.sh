#!/usr/bin/env bash
# Device run on one H200 (session 8, run 4), the session's last device time (about 5 minutes):
# the overlapped decode loop through flashinfer's MLA (glm-small's greedy tokens with graphs,
# which run 3's timeout cut off), then the Triton autotune change: the cache test (every
# autotuned kernel timed once into an empty TRITON_CACHE_DIR, then nothing re-timed from it),
# the MoE configs one by one and the 64-row prefill tile against the reference, and the
# whole-model greedy cases if time is left.
# Usage (device tool; carry .whl, .ficache): bash bench/h200_s8_run4.sh
set -uo pipefail
. bench/device-env.sh
t0=$SECONDS
. bench/device-flashinfer.sh
timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_flashinfer.py \
  -k "engine_greedy-glm-graphs" > "$out/h200-gpu-tests-s8run4-flashinfer.log" 2>&1
grep -E "^E  |^FAILED|^ERROR|passed|failed" "$out/h200-gpu-tests-s8run4-flashinfer.log" | tail -6
echo "[$((SECONDS - t0)) s] flashinfer done"
timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_triton_kernels.py \
  -k "autotune or moe_configs or fp8_prefill" > "$out/h200-gpu-tests-s8run4-autotune.log" 2>&1
grep -E "^E  |^FAILED|^ERROR|passed|failed" "$out/h200-gpu-tests-s8run4-autotune.log" | tail -12
echo "[$((SECONDS - t0)) s] autotune done"
if [ $SECONDS -lt 250 ]; then
  timeout $((300 - SECONDS)) python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_triton_kernels.py \
    -k "engine_greedy" > "$out/h200-gpu-tests-s8run4-greedy.log" 2>&1
  grep -E "^E  |^FAILED|^ERROR|passed|failed" "$out/h200-gpu-tests-s8run4-greedy.log" | tail -6
fi
echo "[$((SECONDS - t0)) s] done"
