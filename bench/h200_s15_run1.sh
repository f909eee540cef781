#!/usr/bin/env bash
# Device run on one H200, written in session 14 (which had no device time left) for the next
# session's first call. Never run on a GPU yet: `triton_mla` (session 13; Triton sparse/dense
# MLA decode, no host plan, SNAPFN_MLA_DECODE=triton) and `triton_absorb` (session 14; MLA's
# absorbed products reading the FP8 kv_b as stored, SNAPFN_MLA_ABSORB=triton). Here:
# - GPU checks, in parallel with making the GLM-5-shaped model: both kernels against the
#   reference (mla_decode-*, absorb-*), the GEMV with a norm and no residual before an FP8
#   weight (gemv-fp8_norm: q_b | wq_b, session 14), the logits stored as float32 by the GEMV
#   (gemv-add_norm_float, session 14), whole-model greedy tokens with them on the
#   triton backend (glm-tiny-mlatriton) and inside flashinfer's decode graphs (-mlatriton,
#   -mlaabsorb; glm-small there also runs the stacked q_b | wq_b);
# - the steady bench at batch 1 and 8, one process each on this machine: the default
#   (flashinfer's MLA, host-planned, bmms over a bf16 kv_b), then SNAPFN_MLA_ABSORB=triton.
# Run 2 (h200_s15_run2.sh) times both switches together. A switch that passes and wins becomes
# the default (the Triton MLA drops flashinfer's per-step pinned copy, 13 us in session 13's
# profile, and the host planning; the absorb kernels halve the bmms' 59 MB of kv_b reads).
# Usage (device tool; carry .whl, .ficache): bash bench/h200_s15_run1.sh
set -uo pipefail
. bench/device-env.sh
results_tarball s15run1
t0=$SECONDS
. bench/device-flashinfer.sh
(make_glm5; echo "model rc $?") &
gpu_tests triton 260 tests/test_triton_kernels.py "mla_decode or mlatriton or absorb or fp8_norm or add_norm_float" &
gpu_tests flashinfer 260 tests/test_flashinfer.py "mlatriton or mlaabsorb" &
wait
tests_summary
echo "[$((SECONDS - t0)) s] tests and model done"
steady_glm5 default $((420 - SECONDS))
echo "[$((SECONDS - t0)) s] steady (default) done"
steady_glm5 absorb $((580 - SECONDS)) SNAPFN_MLA_ABSORB=triton
save_jit_cache
echo "[$((SECONDS - t0)) s] done"
