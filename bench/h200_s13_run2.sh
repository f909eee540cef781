#!/usr/bin/env bash
# Device run on one H200 (session 13, run 2). Run 1's tensor-core GEMV lost on every FP8 shape
# and is gone. New: the dense and MoE GEMVs sum each K step's products in 16-element runs
# (`lane_sums`), about halving their registers (offline sm_90 compiles), so more programs stay
# resident; wide FP8 tiles on trial in the tuners. Here:
# - GPU checks of the GEMV and MoE GEMV cases, in parallel with making the model;
# - the GEMV probe on GLM-5's FP8 projections, the engine's configs and the wide ones;
# - the steady bench at batch 1 with this tree, then with .baseline (an untracked copy of the
#   last commit's handler/, snapshot/ and infra/, made before the call) on the same machine.
# Usage (device tool; carry .whl, .ficache): bash bench/h200_s13_run2.sh
set -uo pipefail
. bench/device-env.sh
results_tarball s13run2
t0=$SECONDS
. bench/device-flashinfer.sh
(make_glm5; echo "model rc $?") &
gpu_tests triton 170 tests/test_triton_kernels.py "gemv-fp8 or moe_configs-gemv or moe-gemv" &
wait
tests_summary
echo "[$((SECONDS - t0)) s] tests and model done"
(cd bench/probes && TRITON_CACHE_DIR=$work/tc-probe timeout 150 python3 gemv_probe.py --splits auto --configs fp8-wide \
  --only glm5.fp8.o,glm5.fp8.gate_up,glm5.fp8.down,glm5.fp8.q_b,glm5.fp8.qkv_a,glm5.fp8.shared_gate_up \
  > "$res/gemv-probe-wide.jsonl" 2> "$res/gemv-probe-wide.err")
python3 -c "
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    best = sorted((v[0], k) for k, v in r['configs'].items() if isinstance(v, list))[:5]
    print(r['shape'], 'unfused', r['unfused_us'], 'tuned', r['tuned_us'], r['tuned_tbps'], 'err', r['tuned_err'], best)
" "$res/gemv-probe-wide.jsonl" || tail -5 "$res/gemv-probe-wide.err"
echo "[$((SECONDS - t0)) s] probe done"
steady() {  # steady NAME SECONDS: batch 1, into $res/steady-NAME.{json,log}
  SNAPFN_BACKEND=flashinfer timeout "$2" python3 -m snapfn.handler.cli bench \
    --model "$work/glm5" --device cuda --workdir "$work/steady-$1" --modes steady \
    --decode-batches 1 --decode-tokens 32 --prefill-tokens 2048 \
    --out "$res/steady-$1.json" > "$res/steady-$1.log" 2>&1
  echo "$1: $(grep -o 'decode ms/step.*' "$res/steady-$1.log" || tail -2 "$res/steady-$1.log")"
}
steady flashinfer $((440 - SECONDS))
echo "[$((SECONDS - t0)) s] steady (this tree) done"
ln -sfn "$PWD/handler/llm/embedded" .baseline/handler/llm/embedded
eval "$(SNAPFN_DEV_PATH=/tmp/snapfn-base bash .baseline/infra/dev-pythonpath.sh)"
python3 -c "import snapfn.handler, sys; print('baseline from', snapfn.handler.__path__)"
steady base $((570 - SECONDS))
echo "[$((SECONDS - t0)) s] done"
