#!/usr/bin/env bash
# Device run on one H200, written in session 14 for the next session's second call, on the
# machine run 1 left warm (its GLM-5-shaped model is reused where it is still there): the
# absorb kernels alone against the bmms (bench/probes/absorb_probe.py, 1-16 tokens), the
# steady bench at batch 1 and 8 with SNAPFN_MLA_DECODE=triton and SNAPFN_MLA_ABSORB=triton
# together, then the batch-1 profile with both on (where the remaining microseconds go).
# Usage (device tool; carry .whl, .ficache): bash bench/h200_s15_run2.sh
set -uo pipefail
. bench/device-env.sh
results_tarball s15run2
t0=$SECONDS
. bench/device-flashinfer.sh
(cd bench/probes && TRITON_CACHE_DIR=$work/tc-absorb timeout 120 python3 absorb_probe.py \
  > "$res/absorb-probe.jsonl" 2> "$res/absorb-probe.err")
python3 -c "
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line); print({k: v for k, v in r.items() if k != 'configs'})
" "$res/absorb-probe.jsonl" || tail -5 "$res/absorb-probe.err"
echo "[$((SECONDS - t0)) s] probe done"
[ -f "$work/glm5/config.json" ] || { make_glm5; echo "model rc $?"; }
echo "[$((SECONDS - t0)) s] model ready"
steady_glm5 both $((420 - SECONDS)) SNAPFN_MLA_DECODE=triton SNAPFN_MLA_ABSORB=triton
echo "[$((SECONDS - t0)) s] steady done"
SNAPFN_MLA_DECODE=triton SNAPFN_MLA_ABSORB=triton timeout $((570 - SECONDS)) \
  python3 bench/probes/decode_profile.py "$work/glm5" --backend flashinfer --batch 1 --graphs \
  --top 40 > "$res/profile-glm-b1.json" 2> "$res/profile-glm-b1.err"
profile_summary profile-glm-b1 25
save_jit_cache
echo "[$((SECONDS - t0)) s] done"
