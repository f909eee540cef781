#!/usr/bin/env bash
# Device run on one H200 (session 6, run 3): the flashinfer backend (the CUDA default) after the
# decode-step work: its GPU checks, the 8B llama (bf16) decode step split (as run 2 for triton)
# and its steady state. The tests, the probe and the bench share one flashinfer JIT cache (the
# bench's), which is brought back packed when it is small enough to carry.
# Usage (device tool; carry .whl, see bench/h200_s5_run2.sh): bash bench/h200_s6_run3.sh
set -uo pipefail
. bench/device-env.sh
t0=$SECONDS
. bench/device-flashinfer.sh
timeout 280 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_flashinfer.py \
  > "$out/h200-gpu-tests-s6run3.log" 2>&1
grep -E "^E  |^FAILED|^ERROR|passed|failed" "$out/h200-gpu-tests-s6run3.log" | tail -20
echo "[$((SECONDS - t0)) s] tests done"
snapfn make-model --preset 8b --dtype bf16 --device cuda --out "$work/llama8b" | tail -1
echo "[$((SECONDS - t0)) s] model made"
python3 bench/probes/decode_profile.py "$work/llama8b" --backend flashinfer --batch 1 --graphs \
  --steps 16 --top 30 > "$out/h200-s6run3-profile-flashinfer-b1.json"
python3 - "$out/h200-s6run3-profile-flashinfer-b1.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print({k: v for k, v in d.items() if k != "top"})
for r in d["top"][:16]:
    print(" ", r["us"], r["calls_per_step"], r["kernel"][:90])
PY
echo "[$((SECONDS - t0)) s] profile done"
SNAPFN_BACKEND=flashinfer timeout 200 python3 -m snapfn.handler.cli bench --model "$work/llama8b" --device cuda \
  --modes steady --decode-batches 1,8,32,64 --decode-tokens 32 --workdir "$work/steady-flashinfer" \
  --out "$out/h200-llama8b-steady-s6-flashinfer.json" 2>&1 | grep -A8 "^mode"
echo "[$((SECONDS - t0)) s] steady done"
du -sh "$cache"
tar -czf "$out/flashinfer-jit.tgz" -C "$cache" . && ls -la "$out/flashinfer-jit.tgz"
