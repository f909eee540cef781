#!/usr/bin/env bash
# Device run on one H200 (session 9, run 3): the fused GEMV, the Triton decode attention and the
# Triton greedy picks wired into the engine (36c083b).
# - their GPU checks: the kernels against the reference, the autotune cache test, and the
#   whole-model greedy cases through flashinfer (llama and glm-small, eager and with graphs),
#   where one-request decode batches now run the Triton attention;
# - bench/probes/decode_step_probe.py at batch 1-8: the attention kernel with empty blocks
#   skipped (run 2 measured it before), against flashinfer's graph-mode decode, for the rule of
#   which batches the Triton kernel takes (`TRITON_DECODE_MAX_ROWS`);
# - the 8B llama (bf16) in the steady state with the fused GEMV on and off, side by side.
# Usage (device tool; carry .whl, .ficache): bash bench/h200_s9_run3.sh
set -uo pipefail
. bench/device-env.sh
t0=$SECONDS
. bench/device-flashinfer.sh
(snapfn make-model --preset 8b --dtype bf16 --device cuda --out "$work/llama8b" > "$out/h200-s9run3-make-model.log" 2>&1; echo "model rc $?") &
timeout 60 python3 bench/probes/decode_step_probe.py --batches 1,2,4,8 \
  > "$out/h200-s9run3-decode-step.jsonl" 2> "$out/h200-s9run3-decode-step.err"
echo "decode-step probe rc $?"; tail -2 "$out/h200-s9run3-decode-step.err"
grep attention "$out/h200-s9run3-decode-step.jsonl"
echo "[$((SECONDS - t0)) s] probe done"
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_triton_kernels.py \
  -k "decode or picks or gemv or autotune" > "$out/h200-gpu-tests-s9run3-triton.log" 2>&1
grep -E "^E  |^FAILED|^ERROR|passed|failed" "$out/h200-gpu-tests-s9run3-triton.log" | tail -8
echo "[$((SECONDS - t0)) s] triton tests done"
timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_flashinfer.py \
  -k "engine_greedy or decode" > "$out/h200-gpu-tests-s9run3-flashinfer.log" 2>&1
grep -E "^E  |^FAILED|^ERROR|passed|failed" "$out/h200-gpu-tests-s9run3-flashinfer.log" | tail -8
wait
echo "[$((SECONDS - t0)) s] flashinfer tests done"
for gemv in auto off; do
  SNAPFN_GEMV=$gemv SNAPFN_BACKEND=flashinfer timeout 100 python3 -m snapfn.handler.cli bench \
    --model "$work/llama8b" --device cuda --modes steady --decode-batches 1,8,32,64 --decode-tokens 32 \
    --workdir "$work/steady-flashinfer" --out "$out/h200-llama8b-steady-s9run3-gemv-$gemv.json" 2>&1 \
    | grep -A3 "^mode"
  echo "[$((SECONDS - t0)) s] llama8b gemv=$gemv done"
done
