#!/usr/bin/env bash
# Device run on one H200 (session 12, run 4; the session's last device minutes). Since run 3:
# the rope cos | sin table; MLA's latent store (norm + RoPE + cache write) and the indexer
# key's (LayerNorm + RoPE + cache write) each one Triton launch; SwiGLU after a norm-fused GEMV
# as its own silu_mul launch (GEMV_FUSED_SWIGLU=False); one token's absorbed MLA products as
# per-head GEMVs (gemv x_every) instead of cuBLAS bmms. Here, within ~450 s:
# - GPU checks, in parallel with making the model: the new kernels, the GEMV SwiGLU forms,
#   glm-tiny's greedy case, flashinfer's MLA graph case and glm-small's greedy case with graphs;
# - the GLM-5-shaped model's steady bench (batch 1, 8);
# - the GEMV probe on the dense FP8 gate | up (SwiGLU after it, against in it);
# - the batch-1 profile if time is left.
# Usage (device tool; carry .whl, .ficache): bash bench/h200_s12_run4.sh
set -uo pipefail
. bench/device-env.sh
results_tarball s12run4
t0=$SECONDS
. bench/device-flashinfer.sh
(make_glm5; echo "model rc $?") &
gpu_tests triton 170 tests/test_triton_kernels.py "gemv_heads or norm_rope or swiglu or engine_greedy-glm-tiny-fp32" &
gpu_tests flashinfer 170 tests/test_flashinfer.py "mla_decode_graph or engine_greedy-glm-graphs" &
wait
tests_summary
echo "[$((SECONDS - t0)) s] tests and model done"
SNAPFN_BACKEND=flashinfer timeout $((330 - SECONDS)) python3 -m snapfn.handler.cli bench \
  --model "$work/glm5" --device cuda --workdir "$work/steady-flashinfer" --modes steady \
  --decode-batches 1,8 --decode-tokens 32 --prefill-tokens 2048 \
  --out "$res/h200-glm5-reduced-fp8-steady-s12run4.json" > "$res/steady.log" 2>&1
grep -A4 "^mode" "$res/steady.log" || tail -5 "$res/steady.log"
echo "[$((SECONDS - t0)) s] steady done"
(cd bench/probes && TRITON_CACHE_DIR=$work/tc3 timeout 40 python3 gemv_probe.py --configs fp8 --only glm5.fp8.gate_up \
  > "$res/gemv-probe-swiglu.jsonl" 2> "$res/gemv-probe-swiglu.err")
python3 -c "
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(r['shape'], 'unfused', r['unfused_us'], 'tuned (silu_mul after)', r['tuned_us'], 'in kernel', r.get('tuned_fused_swiglu_us'), 'err', r['tuned_err'])
" "$res/gemv-probe-swiglu.jsonl" || tail -3 "$res/gemv-probe-swiglu.err"
echo "[$((SECONDS - t0)) s] probe done"
if [ $SECONDS -lt 360 ]; then
  timeout $((445 - SECONDS)) python3 bench/probes/decode_profile.py "$work/glm5" --backend flashinfer --batch 1 --graphs --top 60 \
    > "$res/profile-glm-b1.json" 2> "$res/profile-glm-b1.err"
  profile_summary profile-glm-b1
fi
echo "[$((SECONDS - t0)) s] done"
