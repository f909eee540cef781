#!/usr/bin/env bash
# Device run on one H200, written in session 14 (which had no device time left) for the next
# session's first call. Session 13 wrote `triton_mla.mla_decode` (Triton sparse/dense MLA
# decode, no host plan, behind SNAPFN_MLA_DECODE=triton) and never ran it on a GPU. Here:
# - GPU checks, in parallel with making the GLM-5-shaped model: the kernel against the
#   reference (mla_decode-*), whole-model greedy tokens with it on the triton backend
#   (glm-tiny-mlatriton) and inside flashinfer's decode graphs (engine_greedy-glm-graphs-mlatriton);
# - the steady bench at batch 1 and 8 with the default (flashinfer's MLA, planned on the host)
#   and then with SNAPFN_MLA_DECODE=triton, on the same machine, one process each.
# If the Triton kernel passes and wins, make it the default (it drops flashinfer's per-step
# pinned copy, 13 µs in session 13's profile, and the host planning).
# Usage (device tool; carry .whl, .ficache): bash bench/h200_s15_run1.sh
set -uo pipefail
. bench/device-env.sh
results_tarball s15run1
t0=$SECONDS
. bench/device-flashinfer.sh
(make_glm5; echo "model rc $?") &
gpu_tests triton 280 tests/test_triton_kernels.py "mla_decode or mlatriton" &
gpu_tests flashinfer 280 tests/test_flashinfer.py "mlatriton" &
wait
tests_summary
echo "[$((SECONDS - t0)) s] tests and model done"
steady() {  # steady NAME SECONDS [ENV=VALUE]: batch 1 and 8, into $res/steady-NAME.{json,log}
  env SNAPFN_BACKEND=flashinfer ${3:-} timeout "$2" python3 -m snapfn.handler.cli bench \
    --model "$work/glm5" --device cuda --workdir "$work/steady-$1" --modes steady \
    --decode-batches 1,8 --decode-tokens 32 --prefill-tokens 2048 \
    --out "$res/steady-$1.json" > "$res/steady-$1.log" 2>&1
  echo "$1: $(grep -o 'decode ms/step.*' "$res/steady-$1.log" || tail -2 "$res/steady-$1.log")"
}
steady default $((440 - SECONDS))
echo "[$((SECONDS - t0)) s] steady (default MLA) done"
steady mlatriton $((580 - SECONDS)) SNAPFN_MLA_DECODE=triton
echo "[$((SECONDS - t0)) s] done"
