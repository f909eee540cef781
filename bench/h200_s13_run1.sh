#!/usr/bin/env bash
# Device run on one H200 (session 13, run 1). New: the fused GEMV's tensor-core path (DOT
# configs: the weight tiles streamed through shared memory by triton's pipeliner, FP8 weights
# multiplied as float16 against the row scaled by a power of two each K step). Here:
# - GPU checks of every GEMV case (the DOT ones new), in parallel with making the model;
# - the GEMV probe on GLM-5's FP8 projections: the engine's FMA configs and every DOT config;
# - the GLM-5-shaped model's steady bench at batch 1 (the tuner now tries four DOT configs).
# NOTE: the tensor-core path lost on every shape (1.07-2.6x slower) and was reverted before any
# commit: this script no longer runs as it did (`--configs dot` is gone); its outputs are
# bench/results/*s13run1*, and docs/kernels.md says what the path was.
# Usage (device tool; carry .whl, .ficache): bash bench/h200_s13_run1.sh
set -uo pipefail
. bench/device-env.sh
results_tarball s13run1
t0=$SECONDS
. bench/device-flashinfer.sh
(make_glm5; echo "model rc $?") &
gpu_tests triton 200 tests/test_triton_kernels.py "gemv" &
wait
tests_summary
echo "[$((SECONDS - t0)) s] tests and model done"
(cd bench/probes && TRITON_CACHE_DIR=$work/tc-probe timeout 270 python3 gemv_probe.py --splits auto --configs dot \
  --only glm5.fp8.o,glm5.fp8.gate_up,glm5.fp8.down,glm5.fp8.q_b,glm5.fp8.qkv_a,glm5.fp8.shared_gate_up,glm5.fp8.shared_down,glm5.fp8.indexer_wq_b \
  > "$res/gemv-probe-dot.jsonl" 2> "$res/gemv-probe-dot.err")
python3 -c "
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    best = sorted((v[0], k) for k, v in r['configs'].items() if isinstance(v, list))[:5]
    fma = min((v[0], k) for k, v in r['configs'].items() if isinstance(v, list) and 'd' not in k)
    bad = {k: v for k, v in r['configs'].items() if not isinstance(v, list)}
    print(r['shape'], 'unfused', r['unfused_us'], 'tuned', r['tuned_us'], r['tuned_tbps'], 'err', r['tuned_err'], 'best FMA', fma, best, bad or '')
" "$res/gemv-probe-dot.jsonl" || tail -5 "$res/gemv-probe-dot.err"
echo "[$((SECONDS - t0)) s] probe done"
SNAPFN_BACKEND=flashinfer timeout $((560 - SECONDS)) python3 -m snapfn.handler.cli bench \
  --model "$work/glm5" --device cuda --workdir "$work/steady-flashinfer" --modes steady \
  --decode-batches 1 --decode-tokens 32 --prefill-tokens 2048 \
  --out "$res/h200-glm5-reduced-fp8-steady-s13run1.json" > "$res/steady.log" 2>&1
grep -A4 "^mode" "$res/steady.log" || tail -5 "$res/steady.log"
echo "[$((SECONDS - t0)) s] done"
