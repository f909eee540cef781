#!/usr/bin/env bash
# Device run on one H200 (session 13, run 3). Since run 2: the FP8 GEMV tuner's configs are
# run 2's probe winners (wide tiles: 8x1024, 8x2048, 16x2048 ...). Here:
# - GPU checks, in parallel with making the model: whole-model greedy tokens against the
#   reference (tiny llama, glm-tiny, glm-small eager and with graphs), the autotuned list and
#   the GEMV cases, with long timeouts (glm-tiny's case was cut at 170-260 s before);
# - the GLM-5-shaped model's steady bench at batch 1 and 8;
# - its batch-1 profile if time is left.
# Usage (device tool; carry .whl, .ficache): bash bench/h200_s13_run3.sh
set -uo pipefail
. bench/device-env.sh
results_tarball s13run3
t0=$SECONDS
. bench/device-flashinfer.sh
(make_glm5; echo "model rc $?") &
gpu_tests triton 290 tests/test_triton_kernels.py "engine_greedy or autotuned or gemv-fp8" &
gpu_tests flashinfer 290 tests/test_flashinfer.py "engine_greedy-glm" &
wait
tests_summary
echo "[$((SECONDS - t0)) s] tests and model done"
SNAPFN_BACKEND=flashinfer timeout $((470 - SECONDS)) python3 -m snapfn.handler.cli bench \
  --model "$work/glm5" --device cuda --workdir "$work/steady-flashinfer" --modes steady \
  --decode-batches 1,8 --decode-tokens 32 --prefill-tokens 2048 \
  --out "$res/h200-glm5-reduced-fp8-steady-s13run3.json" > "$res/steady.log" 2>&1
grep -o 'decode ms/step.*' "$res/steady.log" || tail -5 "$res/steady.log"
echo "[$((SECONDS - t0)) s] steady done"
if [ $SECONDS -lt 480 ]; then
  timeout $((545 - SECONDS)) python3 bench/probes/decode_profile.py "$work/glm5" --backend flashinfer --batch 1 --graphs --top 40 \
    > "$res/profile-glm-b1.json" 2> "$res/profile-glm-b1.err"
  profile_summary profile-glm-b1 25
fi
echo "[$((SECONDS - t0)) s] done"
