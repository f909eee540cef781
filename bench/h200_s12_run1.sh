#!/usr/bin/env bash
# Device run on one H200 (session 12, run 1): the GLM-5-shaped model's steady decode with the
# bench's new method (2n tokens less n, over n steps; session 11 ran it on CPU only), at 64 and
# at 16 decode tokens, to test session 11's guess that the ~0.1 ms between the batch-1 figure
# and the graph replay is a generation's end steps; the float32 GEMV, the 5-config FP8 list and
# the two MoE GEMV configs (session 11, checked but never timed) are in; then the batch-1 profile.
# Usage (device tool; carry .whl, .ficache): bash bench/h200_s12_run1.sh
set -uo pipefail
. bench/device-env.sh
results_tarball s12run1
t0=$SECONDS
. bench/device-flashinfer.sh
make_glm5; echo "model rc $? [$((SECONDS - t0)) s]"
for tokens in 64 16; do
  SNAPFN_BACKEND=flashinfer timeout $((420 - SECONDS)) python3 -m snapfn.handler.cli bench \
    --model "$work/glm5" --device cuda --workdir "$work/steady-flashinfer" --modes steady \
    --decode-batches 1,8 --decode-tokens $tokens --prefill-tokens 2048 \
    --out "$res/h200-glm5-reduced-fp8-steady-s12run1-t$tokens.json" > "$res/steady-t$tokens.log" 2>&1
  grep -A4 "^mode" "$res/steady-t$tokens.log" || tail -5 "$res/steady-t$tokens.log"
  echo "[$((SECONDS - t0)) s] steady $tokens tokens done"
done
timeout $((585 - SECONDS)) python3 bench/probes/decode_profile.py "$work/glm5" --backend flashinfer --batch 1 --graphs --top 60 \
  > "$res/profile-glm-b1.json" 2> "$res/profile-glm-b1.err"
profile_summary profile-glm-b1 40
echo "[$((SECONDS - t0)) s] done"
