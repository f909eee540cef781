#!/usr/bin/env bash
# Device run on one H200 (session 10, run 2): the GLM-5-shaped model's batch-1 decode step,
# after run 1's profile (1.611 ms a replay: 451 us in 18 FP8 linears, 178 us in the routed
# experts, about 400 us in ~190 small torch kernels).
# - GPU checks: the fused GEMV with FP8 weights, one token's experts as GEMVs (`moe_gemv`),
#   the partial-RoPE kernel (`rope_part`), the indexer's scoring on tensor cores, the autotune
#   cache test, and the glm-small whole-model greedy cases (eager and graphs);
# - the GLM-5-shaped model (FP8, 2 layers): the decode profile at batch 1, the prefill profile
#   with the Triton prefill indexer off and on, and the steady bench with the GEMV on and off.
# All results go into one tarball ($OUT keeps few files).
# Usage (device tool; carry .whl, .ficache): bash bench/h200_s10_run2.sh
set -uo pipefail
. bench/device-env.sh
res=/tmp/s10run2; mkdir -p $res
t0=$SECONDS
. bench/device-flashinfer.sh
finish() { tar -czf "$out/h200-s10run2.tgz" -C $res . ; }
trap finish EXIT
(snapfn make-model --preset glm5-reduced --num-layers 2 --dtype fp8 --device cuda --out "$work/glm5" \
  > "$res/make-model.log" 2>&1; echo "model rc $?") &
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_triton_kernels.py \
  -k "gemv or rope_part or indexer or autotune or moe-fp8-bf16" > "$res/gpu-tests-triton.log" 2>&1
grep -E "^E  |^FAILED|^ERROR|passed|failed" "$res/gpu-tests-triton.log" | tail -12
echo "[$((SECONDS - t0)) s] triton tests done"
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_flashinfer.py \
  -k "engine_greedy-glm" > "$res/gpu-tests-flashinfer.log" 2>&1
grep -E "^E  |^FAILED|^ERROR|passed|failed" "$res/gpu-tests-flashinfer.log" | tail -6
wait
echo "[$((SECONDS - t0)) s] tests and model done"
timeout 100 python3 bench/probes/decode_profile.py "$work/glm5" --backend flashinfer --batch 1 --graphs --top 40 \
  > "$res/profile-glm-b1.json" 2> "$res/profile-glm-b1.err"
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: v for k, v in d.items() if k != 'top'}); [print(' ', t['us'], t['calls_per_step'], t['kernel'][:100]) for t in d['top'][:30]]" \
  "$res/profile-glm-b1.json" || tail -3 "$res/profile-glm-b1.err"
echo "[$((SECONDS - t0)) s] decode profile done"
for pi in off auto; do
  SNAPFN_PREFILL_INDEXER=$pi timeout 60 python3 bench/probes/prefill_profile.py "$work/glm5" --tokens 2048 --top 30 \
    > "$res/prefill-profile-glm-indexer-$pi.json" 2> "$res/prefill-profile-glm-indexer-$pi.err"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: v for k, v in d.items() if k != 'top'}); [print(' ', t['us'], t['calls'], t['kernel'][:90]) for t in d['top'][:6]]" \
    "$res/prefill-profile-glm-indexer-$pi.json" || tail -3 "$res/prefill-profile-glm-indexer-$pi.err"
  echo "[$((SECONDS - t0)) s] prefill profile indexer=$pi done"
done
for gemv in auto off; do
  [ $SECONDS -lt 470 ] || break
  SNAPFN_GEMV=$gemv SNAPFN_BACKEND=flashinfer timeout $((585 - SECONDS)) python3 -m snapfn.handler.cli bench \
    --model "$work/glm5" --device cuda --workdir "$work/steady-flashinfer" --modes steady \
    --decode-batches 1,8,32 --decode-tokens 16 --prefill-tokens 2048 \
    --out "$res/h200-glm5-reduced-fp8-steady-s10run2-gemv-$gemv.json" 2>&1 | grep -A3 "^mode"
  echo "[$((SECONDS - t0)) s] steady gemv=$gemv done"
done
