#!/usr/bin/env bash
# Device run on one H200 (session 12, run 2): K splits in the fused GEMV (`triton_gemv`,
# `split_count`). Run 1's batch-1 profile left ~280 us in the 19 GEMVs other than lm_head, which
# move ~590 MB (~2.1 TB/s); the probe suggests the few-column, long-K products (q_a, kv_a, the
# indexer's wk, the float32 router and weights_proj) leave SMs idle. Here:
# - GPU checks, in parallel with making the model: every GEMV case (the split ones new), the
#   autotuned list, glm-small's whole-model greedy cases (eager, graphs);
# - the GEMV probe on GLM-5's projections, split (auto) against unsplit, the engine's FP8 configs;
# - the GLM-5-shaped model's steady bench (batch 1, 8), then its batch-1 profile if time is left.
# Usage (device tool; carry .whl, .ficache): bash bench/h200_s12_run2.sh
set -uo pipefail
. bench/device-env.sh
results_tarball s12run2
t0=$SECONDS
. bench/device-flashinfer.sh
(make_glm5; echo "model rc $?") &
gpu_tests triton 230 tests/test_triton_kernels.py "gemv or autotuned" &
gpu_tests flashinfer 230 tests/test_flashinfer.py "engine_greedy-glm" &
wait
tests_summary
echo "[$((SECONDS - t0)) s] tests and model done"
(cd bench/probes && TRITON_CACHE_DIR=$work/tc3 timeout 120 python3 gemv_probe.py --splits auto,1 --configs fp8 \
  --only glm5.fp8.q_a,glm5.fp8.kv_a,glm5.fp8.indexer_wk,glm5.fp32.weights_proj,glm5.fp32.router,glm5.fp8.o,glm5.fp8.down,glm5.fp8.shared_gate_up,glm5.fp8.shared_down,glm5.fp8.indexer_wq_b \
  > "$res/gemv-probe-splits.jsonl" 2> "$res/gemv-probe-splits.err")
python3 -c "
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(r['shape'], 'auto', r['auto_splits'], r['tuned_by_splits'], 'err', r['tuned_err'])
" "$res/gemv-probe-splits.jsonl" || tail -3 "$res/gemv-probe-splits.err"
echo "[$((SECONDS - t0)) s] probe done"
SNAPFN_BACKEND=flashinfer timeout $((500 - SECONDS)) python3 -m snapfn.handler.cli bench \
  --model "$work/glm5" --device cuda --workdir "$work/steady-flashinfer" --modes steady \
  --decode-batches 1,8 --decode-tokens 32 --prefill-tokens 2048 \
  --out "$res/h200-glm5-reduced-fp8-steady-s12run2.json" > "$res/steady.log" 2>&1
grep -A4 "^mode" "$res/steady.log" || tail -5 "$res/steady.log"
echo "[$((SECONDS - t0)) s] steady done"
if [ $SECONDS -lt 500 ]; then
  timeout $((590 - SECONDS)) python3 bench/probes/decode_profile.py "$work/glm5" --backend flashinfer --batch 1 --graphs --top 60 \
    > "$res/profile-glm-b1.json" 2> "$res/profile-glm-b1.err"
  profile_summary profile-glm-b1 25
fi
echo "[$((SECONDS - t0)) s] done"
