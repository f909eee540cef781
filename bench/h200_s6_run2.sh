#!/usr/bin/env bash
# Device run on one H200 (session 6, run 2), after the decode-step work (fused q|k|v and
# gate|up projections; the residual add inside the next norm, RoPE + both cache writes, and
# SwiGLU's activation each one Triton kernel; batches moved in two copies; one host copy per
# sampled step): the new kernels' GPU checks and whole-model greedy parity, then the 8B llama
# (bf16) decode step split as in run 1 (bench/h200_s6_run1.sh) and the steady state of the torch
# reference and the triton backend side by side.
# Usage (device tool): bash bench/h200_s6_run2.sh
set -uo pipefail
. bench/device-env.sh
t0=$SECONDS
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_triton_kernels.py \
  -k "rope_store or silu_mul or rms_norm or engine_greedy or backend_decode or linear_fp8" \
  > "$out/h200-gpu-tests-s6run2.log" 2>&1
grep -E "^E  |^FAILED|^ERROR|passed|failed" "$out/h200-gpu-tests-s6run2.log" | tail -20
echo "[$((SECONDS - t0)) s] tests done"
snapfn make-model --preset 8b --dtype bf16 --device cuda --out "$work/llama8b" | tail -1
echo "[$((SECONDS - t0)) s] model made"
for spec in "triton 1" "triton 8"; do
  set -- $spec
  python3 bench/probes/decode_profile.py "$work/llama8b" --backend "$1" --batch "$2" --graphs \
    --steps 16 --top 30 > "$out/h200-s6run2-profile-$1-b$2.json"
  python3 - "$out/h200-s6run2-profile-$1-b$2.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print({k: v for k, v in d.items() if k != "top"})
for r in d["top"][:14]:
    print(" ", r["us"], r["calls_per_step"], r["kernel"][:90])
PY
  echo "[$((SECONDS - t0)) s] $1 batch $2 done"
done
for backend in triton torch; do
  SNAPFN_BACKEND=$backend timeout 150 python3 -m snapfn.handler.cli bench --model "$work/llama8b" --device cuda \
    --modes steady --decode-batches 1,8,32,64 --decode-tokens 32 --workdir "$work/steady-$backend" \
    --out "$out/h200-llama8b-steady-s6-$backend.json" 2>&1 | grep -A8 "^mode"
  echo "[$((SECONDS - t0)) s] $backend done"
done
