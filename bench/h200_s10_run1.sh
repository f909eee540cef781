#!/usr/bin/env bash
# Device run on one H200 (session 10, run 1): what session 9 left unverified, and where the
# GLM-5-shaped model's batch-1 decode step goes now.
# - the decode attention's review version (split counts as kernel arguments): its GPU checks and
#   bench/probes/decode_step_probe.py at batch 1 and 2 (run 3 measured the constexpr version);
# - the autotune cache test with session 9's kernels, the prefill indexer's GPU checks, the
#   glm-small whole-model greedy case, eager;
# - the GLM-5-shaped model (FP8, 2 layers): its prefill profile with the Triton prefill indexer
#   off and on (SNAPFN_PREFILL_INDEXER), its batch-1 decode profile with graphs, and the steady
#   bench at batch 1 / 8 / 32 with this session's defaults.
# Usage (device tool; carry .whl, .ficache): bash bench/h200_s10_run1.sh
set -uo pipefail
. bench/device-env.sh
t0=$SECONDS
. bench/device-flashinfer.sh
(snapfn make-model --preset glm5-reduced --num-layers 2 --dtype fp8 --device cuda --out "$work/glm5" \
  > "$out/h200-s10run1-make-model.log" 2>&1; echo "model rc $?") &
timeout 60 python3 bench/probes/decode_step_probe.py --batches 1,2 \
  > "$out/h200-s10run1-decode-step.jsonl" 2> "$out/h200-s10run1-decode-step.err"
echo "decode-step probe rc $?"; tail -2 "$out/h200-s10run1-decode-step.err"
grep attention "$out/h200-s10run1-decode-step.jsonl"
echo "[$((SECONDS - t0)) s] probe done"
timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_triton_kernels.py \
  -k "decode_attention or backend_decode or indexer_prefill or autotune" \
  > "$out/h200-gpu-tests-s10run1-triton.log" 2>&1
grep -E "^E  |^FAILED|^ERROR|passed|failed" "$out/h200-gpu-tests-s10run1-triton.log" | tail -10
echo "[$((SECONDS - t0)) s] triton tests done"
timeout 80 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_flashinfer.py \
  -k "engine_greedy-glm-eager" > "$out/h200-gpu-tests-s10run1-flashinfer.log" 2>&1
grep -E "^E  |^FAILED|^ERROR|passed|failed" "$out/h200-gpu-tests-s10run1-flashinfer.log" | tail -6
wait
echo "[$((SECONDS - t0)) s] tests and model done"
for pi in off auto; do
  SNAPFN_PREFILL_INDEXER=$pi timeout 80 python3 bench/probes/prefill_profile.py "$work/glm5" --tokens 2048 --top 30 \
    > "$out/h200-s10run1-prefill-profile-glm-indexer-$pi.json" 2> "$out/h200-s10run1-prefill-profile-glm-indexer-$pi.err"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: v for k, v in d.items() if k != 'top'}); [print(' ', t['us'], t['calls'], t['kernel'][:90]) for t in d['top'][:8]]" \
    "$out/h200-s10run1-prefill-profile-glm-indexer-$pi.json" || tail -3 "$out/h200-s10run1-prefill-profile-glm-indexer-$pi.err"
  echo "[$((SECONDS - t0)) s] prefill profile indexer=$pi done"
done
timeout 110 python3 bench/probes/decode_profile.py "$work/glm5" --backend flashinfer --batch 1 --graphs --top 40 \
  > "$out/h200-s10run1-profile-glm-b1.json" 2> "$out/h200-s10run1-profile-glm-b1.err"
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: v for k, v in d.items() if k != 'top'}); [print(' ', t['us'], t['calls_per_step'], t['kernel'][:100]) for t in d['top'][:40]]" \
  "$out/h200-s10run1-profile-glm-b1.json" || tail -3 "$out/h200-s10run1-profile-glm-b1.err"
echo "[$((SECONDS - t0)) s] decode profile done"
if [ $SECONDS -lt 440 ]; then
  SNAPFN_BACKEND=flashinfer timeout $((585 - SECONDS)) python3 -m snapfn.handler.cli bench \
    --model "$work/glm5" --device cuda --workdir "$work/steady-flashinfer" --modes steady \
    --decode-batches 1,8,32 --decode-tokens 16 --prefill-tokens 2048 \
    --out "$out/h200-glm5-reduced-fp8-steady-s10run1.json" 2>&1 | grep -A3 "^mode"
fi
echo "[$((SECONDS - t0)) s] done"
