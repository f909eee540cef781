#!/usr/bin/env bash
# Device run on one H200 (session 15, run 5; the machine run 4 left warm, its GLM-5-shaped
# model still there): the GLM's whole-model parity in float32, default switches, with a tie of
# 0.001 nats and logprobs within 0.001. Run 4's in bf16 had 8 of 128 positions past the
# 0.05-nat tie; this says whether the fast path's logic matches the reference's when rounding
# is taken out. (Sent inline as one command; this file is that command.)
# Usage (device tool; carry .whl, .ficache): bash bench/h200_s15_run5.sh
. bench/device-env.sh
. bench/device-flashinfer.sh
t0=$SECONDS
[ -f $work/glm5/config.json ] || { res=$OUT; make_glm5; echo "made model $((SECONDS - t0)) s"; }
TRITON_CACHE_DIR=$work/steady-flashinfer/cache/compile/triton timeout $((200 - SECONDS + t0)) \
  python3 bench/probes/model_parity.py $work/glm5 --dtype float32 --tie 0.001 --logprob-atol 0.001 \
  > $OUT/h200-s15run5-parity-glm5-fp32.json 2> $OUT/parity.err
echo rc $?
head -c 3000 $OUT/h200-s15run5-parity-glm5-fp32.json; tail -5 $OUT/parity.err
echo "[$((SECONDS - t0)) s]"
