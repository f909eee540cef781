#!/usr/bin/env bash
# Device run on one H200 (session 11, run 1): the GLM-5-shaped model's decode step with the
# kernels session 10 wrote after its device time ran out, and the MLA key-slot fill in Triton.
# - GPU checks: the one-launch router (`route`), the indexer's one-launch top-k (`select`), the
#   MLA key-slot fill (`fill_kv`), the switches-off GLM greedy case, the autotune cache test;
#   flashinfer's MLA cases (which now fill their key slots in Triton) and the glm-small greedy
#   cases with SNAPFN_MOE_ROUTER=auto SNAPFN_INDEXER_SELECT=auto;
# - the GLM-5-shaped model (FP8, 2 layers): the steady bench with both switches on, the decode
#   profiles at batch 1 and 8 with them on, then the FP8 GEMV configs on its shapes.
# All results go into one tarball ($OUT keeps few files).
# Usage (device tool; carry .whl, .ficache): bash bench/h200_s11_run1.sh
set -uo pipefail
. bench/device-env.sh
results_tarball s11run1
t0=$SECONDS
. bench/device-flashinfer.sh
(make_glm5; echo "model rc $?") &
timeout 150 python3 -m pytest -v -m gpu -p no:cacheprovider tests/test_triton_kernels.py \
  -k "route or select or fill_kv or offkernels or autotune" > "$res/gpu-tests-triton.log" 2>&1
grep -cE "PASSED" "$res/gpu-tests-triton.log"; grep -E "^E  |FAILED|ERROR|passed|failed" "$res/gpu-tests-triton.log" | tail -8
echo "[$((SECONDS - t0)) s] triton tests done"
export SNAPFN_MOE_ROUTER=auto SNAPFN_INDEXER_SELECT=auto
timeout 120 python3 -m pytest -v -m gpu -p no:cacheprovider tests/test_flashinfer.py \
  -k "engine_greedy-glm or mla" > "$res/gpu-tests-flashinfer-switches-on.log" 2>&1
grep -cE "PASSED" "$res/gpu-tests-flashinfer-switches-on.log"
grep -E "^E  |FAILED|ERROR|passed|failed" "$res/gpu-tests-flashinfer-switches-on.log" | tail -6
wait
echo "[$((SECONDS - t0)) s] tests and model done"
SNAPFN_BACKEND=flashinfer timeout 130 python3 -m snapfn.handler.cli bench \
  --model "$work/glm5" --device cuda --workdir "$work/steady-flashinfer" --modes steady \
  --decode-batches 1,8,32 --decode-tokens 16 --prefill-tokens 2048 \
  --out "$res/h200-glm5-reduced-fp8-steady-s11run1-switches-on.json" 2>&1 | grep -A3 "^mode"
echo "[$((SECONDS - t0)) s] steady done"
for b in 1 8; do
  timeout 80 python3 bench/probes/decode_profile.py "$work/glm5" --backend flashinfer --batch $b --graphs --top 60 \
    > "$res/profile-glm-b$b.json" 2> "$res/profile-glm-b$b.err"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: v for k, v in d.items() if k != 'top'}); [print(' ', t['us'], t['calls_per_step'], t['kernel'][:90]) for t in d['top'][:25]]" \
    "$res/profile-glm-b$b.json" || tail -3 "$res/profile-glm-b$b.err"
  echo "[$((SECONDS - t0)) s] decode profile b$b done"
done
[ $SECONDS -lt 500 ] && timeout $((585 - SECONDS)) python3 bench/probes/gemv_probe.py \
  --only glm5.fp8.q_a,glm5.fp8.q_b,glm5.fp8.kv_a,glm5.fp8.o,glm5.fp8.indexer_wq_b,glm5.fp8.gate_up,glm5.fp8.down,glm5.fp8.shared_gate_up,glm5.fp8.shared_down \
  > "$res/gemv-probe-glm5-fp8.jsonl" 2> "$res/gemv-probe.err"
python3 bench/probes/gemv_probe.py --summarise "$res/gemv-probe-glm5-fp8.jsonl" || tail -3 "$res/gemv-probe.err"
echo "[$((SECONDS - t0)) s] done"
