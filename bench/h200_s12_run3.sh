#!/usr/bin/env bash
# Device run on one H200 (session 12, run 3). Since run 2: K splits only where column tiles
# leave SMs idle; GLM-5's q_a | kv_a | indexer wk as one FP8 GEMV (`fused_qkv_a_proj`, each part
# on its own scale blocks); the dense and MoE GEMVs may prefetch the next weight tile
# (`PREFETCH`, on trial: the FP8 GEMVs ran at 2.6-3.1 TB/s). Here:
# - GPU checks, in parallel with making the model: every GEMV case (prefetching ones new), the
#   MoE GEMV configs, the autotuned list, glm-tiny's and glm-small's whole-model greedy cases;
# - the GEMV probe on GLM-5's FP8 projections, each FP8 config with and without prefetch;
# - the GLM-5-shaped model's steady bench (batch 1, 8), then its batch-1 profile if time is left.
# Usage (device tool; carry .whl, .ficache): bash bench/h200_s12_run2.sh
set -uo pipefail
. bench/device-env.sh
results_tarball s12run3
t0=$SECONDS
. bench/device-flashinfer.sh
(make_glm5; echo "model rc $?") &
gpu_tests triton 260 tests/test_triton_kernels.py "gemv or moe_configs or autotuned or engine_greedy-glm" &
gpu_tests flashinfer 260 tests/test_flashinfer.py "engine_greedy-glm" &
wait
tests_summary
echo "[$((SECONDS - t0)) s] tests and model done"
(cd bench/probes && TRITON_CACHE_DIR=$work/tc3 timeout 120 python3 gemv_probe.py --splits auto --configs fp8 \
  --only glm5.fp8.qkv_a,glm5.fp8.q_b,glm5.fp8.o,glm5.fp8.gate_up,glm5.fp8.down,glm5.fp8.shared_gate_up,glm5.fp8.shared_down,glm5.fp8.indexer_wq_b \
  > "$res/gemv-probe-prefetch.jsonl" 2> "$res/gemv-probe-prefetch.err")
python3 -c "
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    best = sorted((v[0], k) for k, v in r['configs'].items() if isinstance(v, list))[:4]
    print(r['shape'], 'tuned', r['tuned_us'], r['tuned_tbps'], 'err', r['tuned_err'], best)
" "$res/gemv-probe-prefetch.jsonl" || tail -3 "$res/gemv-probe-prefetch.err"
echo "[$((SECONDS - t0)) s] probe done"
SNAPFN_BACKEND=flashinfer timeout $((500 - SECONDS)) python3 -m snapfn.handler.cli bench \
  --model "$work/glm5" --device cuda --workdir "$work/steady-flashinfer" --modes steady \
  --decode-batches 1,8 --decode-tokens 32 --prefill-tokens 2048 \
  --out "$res/h200-glm5-reduced-fp8-steady-s12run3.json" > "$res/steady.log" 2>&1
grep -A4 "^mode" "$res/steady.log" || tail -5 "$res/steady.log"
echo "[$((SECONDS - t0)) s] steady done"
if [ $SECONDS -lt 500 ]; then
  timeout $((590 - SECONDS)) python3 bench/probes/decode_profile.py "$work/glm5" --backend flashinfer --batch 1 --graphs --top 60 \
    > "$res/profile-glm-b1.json" 2> "$res/profile-glm-b1.err"
  profile_summary profile-glm-b1 25
fi
echo "[$((SECONDS - t0)) s] done"
