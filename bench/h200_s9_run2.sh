#!/usr/bin/env bash
# Device run on one H200 (session 9, run 2): the decode step's work between its GEMVs, and the
# fused GEMV reworked for one row (2-D tiles; run 1's 3-D tiles lost to cuBLAS).
# - bench/probes/gemv_probe.py: the fused GEMV, one row, config by config, against cuBLAS with
#   the Triton norm and activation kernels;
# - bench/probes/decode_step_probe.py: greedy picks (torch vs the new Triton kernel) and decode
#   attention (flashinfer's graph-mode decode vs the reworked Triton split-KV kernel with its
#   Triton combine) at batch 1-64 and contexts 40-4096;
# - the GPU checks of the reworked attention kernel and the picks;
# - the 8B llama (bf16) in the steady state with decode attention by flashinfer, then by Triton.
# Usage (device tool; carry .whl, .ficache): bash bench/h200_s9_run2.sh
set -uo pipefail
. bench/device-env.sh
t0=$SECONDS
. bench/device-flashinfer.sh
(snapfn make-model --preset 8b --dtype bf16 --device cuda --out "$work/llama8b" > "$out/h200-s9run2-make-model.log" 2>&1; echo "model rc $?") &
timeout 150 python3 bench/probes/gemv_probe.py > "$out/h200-s9run2-gemv.jsonl" 2> "$out/h200-s9run2-gemv.err"
echo "gemv probe rc $?"; tail -2 "$out/h200-s9run2-gemv.err"
python3 - "$out/h200-s9run2-gemv.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    best = sorted((v[0], k) for k, v in r["configs"].items() if isinstance(v, list))[:3]
    print(r["shape"], "unfused", r["unfused_us"], "tuned", r["tuned_us"], r["tuned_tbps"], "x", r["speedup"], "err", r["tuned_err"], best)
PY
echo "[$((SECONDS - t0)) s] gemv done"
timeout 150 python3 bench/probes/decode_step_probe.py > "$out/h200-s9run2-decode-step.jsonl" 2> "$out/h200-s9run2-decode-step.err"
echo "decode-step probe rc $?"; tail -2 "$out/h200-s9run2-decode-step.err"; cat "$out/h200-s9run2-decode-step.jsonl"
echo "[$((SECONDS - t0)) s] decode-step done"
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_triton_kernels.py -k "decode or picks" \
  > "$out/h200-gpu-tests-s9run2-triton.log" 2>&1
grep -E "^E  |^FAILED|^ERROR|passed|failed" "$out/h200-gpu-tests-s9run2-triton.log" | tail -6
wait
echo "[$((SECONDS - t0)) s] tests done"
for attn in flashinfer triton; do
  SNAPFN_DECODE_ATTENTION=$attn SNAPFN_BACKEND=flashinfer timeout 130 python3 -m snapfn.handler.cli bench \
    --model "$work/llama8b" --device cuda --modes steady --decode-batches 1,8,32,64 --decode-tokens 32 \
    --workdir "$work/steady-flashinfer" --out "$out/h200-llama8b-steady-s9run2-attn-$attn.json" 2>&1 \
    | grep -A3 "^mode"
  echo "[$((SECONDS - t0)) s] llama8b attention=$attn done"
done
