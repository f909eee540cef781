#!/usr/bin/env bash
# Device run on one H200 (session 15, run 3), after runs 1-2 found the Triton MLA decode a win
# at batch 1 (0.872 -> 0.813 ms with both switches) and the first triton_absorb a loss past one
# token (a program per token: 42 us against the bmms' 12.6 at eight tokens). Here, with
# triton_absorb rewritten as one tensor-core tile for all of a batch's tokens:
# - GPU checks of it (absorb-*), whole-model greedy with both switches on the triton backend
#   (glm-tiny-mlatriton) and in flashinfer's decode graphs (-mlaabsorb), in parallel with
#   making the GLM-5-shaped model;
# - the probe against the bmms at 1-16 tokens;
# - the steady bench with SNAPFN_MLA_DECODE=triton alone, then with both switches;
# - the benchmark model's whole-model parity against the torch reference, both switches on
#   (bench/probes/model_parity.py: teacher-forced, near-ties counted);
# - if time is left, the steady bench with SNAPFN_MLA_ABSORB=triton alone (run 1: 1.031 ms at
#   batch 1 with the old kernel, unexplained).
# Usage (device tool; carry .whl, .ficache): bash bench/h200_s15_run3.sh
set -uo pipefail
. bench/device-env.sh
results_tarball s15run3
t0=$SECONDS
. bench/device-flashinfer.sh
(make_glm5; echo "model rc $?") &
gpu_tests triton 220 tests/test_triton_kernels.py "absorb or mlatriton" &
gpu_tests flashinfer 220 tests/test_flashinfer.py "mlaabsorb" &
wait
tests_summary
echo "[$((SECONDS - t0)) s] tests and model done"
(cd bench/probes && TRITON_CACHE_DIR=$work/tc-absorb timeout 60 python3 absorb_probe.py \
  > "$res/absorb-probe.jsonl" 2> "$res/absorb-probe.err")
python3 -c "
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line); print({k: v for k, v in r.items() if k != 'configs'}, sorted(r['configs'].items(), key=lambda kv: kv[1])[:3])
" "$res/absorb-probe.jsonl" || tail -5 "$res/absorb-probe.err"
echo "[$((SECONDS - t0)) s] probe done"
steady_glm5 mla $((400 - SECONDS)) SNAPFN_MLA_DECODE=triton
steady_glm5 both $((460 - SECONDS)) SNAPFN_MLA_DECODE=triton SNAPFN_MLA_ABSORB=triton
echo "[$((SECONDS - t0)) s] steady done"
SNAPFN_MLA_DECODE=triton SNAPFN_MLA_ABSORB=triton TRITON_CACHE_DIR=$work/steady-flashinfer/cache/compile/triton \
  timeout $((545 - SECONDS)) python3 bench/probes/model_parity.py "$work/glm5" \
  > "$res/parity-glm5-both.json" 2> "$res/parity-glm5-both.err"
cat "$res/parity-glm5-both.json" || tail -3 "$res/parity-glm5-both.err"
echo "[$((SECONDS - t0)) s] parity done"
[ $SECONDS -lt 500 ] && steady_glm5 absorb $((585 - SECONDS)) SNAPFN_MLA_ABSORB=triton
echo "[$((SECONDS - t0)) s] done"
