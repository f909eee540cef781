#!/usr/bin/env bash
# Device run on one H200 (session 10, run 3): run 2's GPU checks again, verbose (its 200 s cut
# them off, every check that ran having passed), with the whole-model GLM greedy cases under the
# Triton prefill indexer; the GLM-5-shaped model's steady state with distinct prompts per row
# (run 2's rows were one prompt, so its MoE rows all read the same 8 experts), GEMV on and
# off, the prefill indexer on; then its cold init and a restore, which must compile nothing.
# Usage (device tool; carry .whl, .ficache): bash bench/h200_s10_run3.sh
set -uo pipefail
. bench/device-env.sh
res=/tmp/s10run3; rm -rf $res; mkdir -p $res
t0=$SECONDS
. bench/device-flashinfer.sh
finish() { tar -czf "$out/h200-s10run3.tgz" -C $res . ; }
trap finish EXIT
[ -d "$work/glm5" ] || (snapfn make-model --preset glm5-reduced --num-layers 2 --dtype fp8 --device cuda \
  --out "$work/glm5" > "$res/make-model.log" 2>&1; echo "model rc $?") &
timeout 150 python3 -m pytest -v -m gpu -p no:cacheprovider tests/test_triton_kernels.py \
  -k "gemv or rope_part or indexer or autotune" > "$res/gpu-tests-triton.log" 2>&1
grep -cE "PASSED" "$res/gpu-tests-triton.log"; grep -E "FAILED|ERROR|passed|failed" "$res/gpu-tests-triton.log" | tail -8
echo "[$((SECONDS - t0)) s] triton tests done"
SNAPFN_PREFILL_INDEXER=auto timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_flashinfer.py \
  -k "engine_greedy-glm" > "$res/gpu-tests-flashinfer-indexer-auto.log" 2>&1
grep -E "^E  |^FAILED|^ERROR|passed|failed" "$res/gpu-tests-flashinfer-indexer-auto.log" | tail -6
wait
echo "[$((SECONDS - t0)) s] tests and model done"
steady() {  # $1: SNAPFN_GEMV, $2: decode batches, $3: timeout
  SNAPFN_PREFILL_INDEXER=auto SNAPFN_GEMV=$1 SNAPFN_BACKEND=flashinfer timeout $3 python3 -m snapfn.handler.cli bench \
    --model "$work/glm5" --device cuda --workdir "$work/steady-flashinfer" --modes steady \
    --decode-batches $2 --decode-tokens 16 --prefill-tokens 2048 \
    --out "$res/h200-glm5-reduced-fp8-steady-s10run3-gemv-$1.json" 2>&1 | grep -A3 "^mode"
  echo "[$((SECONDS - t0)) s] steady gemv=$1 done"
}
steady auto 1,8,32 110
export SNAPFN_PREFILL_INDEXER=auto SNAPFN_BACKEND=flashinfer
timeout 120 python3 -m snapfn.handler.cli bench --model "$work/glm5" --device cuda --workdir "$work/glm-bench" \
  --modes cold_init --decode-batches 1 --decode-tokens 16 \
  --out "$res/h200-glm5-reduced-fp8-s10run3-init.json" 2>&1 | grep -A2 "^mode"
rm -rf "$work/glm-bench/cache"  # what the init compiled and tuned: gone, as on a new machine
timeout 60 python3 -m snapfn.handler.cli bench --model "$work/glm5" --device cuda \
  --workdir "$work/glm-bench" --modes restore --decode-batches 1 --decode-tokens 16 \
  --out "$res/h200-glm5-reduced-fp8-s10run3-restore.json" 2>&1 | grep -A2 "^mode"
python3 bench/startup_summary.py "$res"/h200-glm5-reduced-fp8-s10run3-{init,restore}.json
echo "[$((SECONDS - t0)) s] init and restore done"
if [ $SECONDS -lt 480 ]; then steady off 1 $((590 - SECONDS)); fi
echo "[$((SECONDS - t0)) s] done"
