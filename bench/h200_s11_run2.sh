#!/usr/bin/env bash
# Device run on one H200 (session 11, run 2). Run 1 (h200_s11_run1.sh) checked the router, the
# indexer's pick and the MLA key-slot fill on the GPU, but its timeouts cut the whole-model
# cases, the steady bench and the batch-1 profile (first-use compiles and autotuning took longer
# than they allowed). Since then: the router and the pick are on by default, and the pick takes
# a request's keys in order, unsorted, when they all fit in `index_topk`; two wider FP8 GEMV
# configs. Here:
# - GPU checks, in parallel with making the model: the pick (both paths), the key-slot fill,
#   glm-tiny's whole-model greedy cases (defaults, and both switches off), flashinfer's MLA and
#   glm-small greedy cases (eager and graphs);
# - the GLM-5-shaped model's steady bench (batch 1, 8, 32; prefill 2048), then its batch-1
#   decode profile if time is left.
# All results go into one tarball ($OUT keeps few files).
# Usage (device tool; carry .whl, .ficache): bash bench/h200_s11_run2.sh
set -uo pipefail
. bench/device-env.sh
results_tarball s11run2
t0=$SECONDS
. bench/device-flashinfer.sh
(make_glm5; echo "model rc $?") &
gpu_tests triton 220 tests/test_triton_kernels.py "select or fill_kv or engine_greedy-glm-tiny-fp32 or switchesoff" &
gpu_tests flashinfer 220 tests/test_flashinfer.py "engine_greedy-glm or mla" &
wait
tests_summary
echo "[$((SECONDS - t0)) s] tests and model done"
SNAPFN_BACKEND=flashinfer timeout $((575 - SECONDS)) python3 -m snapfn.handler.cli bench \
  --model "$work/glm5" --device cuda --workdir "$work/steady-flashinfer" --modes steady \
  --decode-batches 1,8,32 --decode-tokens 16 --prefill-tokens 2048 \
  --out "$res/h200-glm5-reduced-fp8-steady-s11run2.json" > "$res/steady.log" 2>&1
grep -A4 "^mode" "$res/steady.log" || tail -5 "$res/steady.log"
echo "[$((SECONDS - t0)) s] steady done"
if [ $SECONDS -lt 480 ]; then
  timeout $((590 - SECONDS)) python3 bench/probes/decode_profile.py "$work/glm5" --backend flashinfer --batch 1 --graphs --top 60 \
    > "$res/profile-glm-b1.json" 2> "$res/profile-glm-b1.err"
  profile_summary profile-glm-b1
fi
echo "[$((SECONDS - t0)) s] done"
