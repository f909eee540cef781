#!/usr/bin/env bash
# Device run on one H200 (session 7, run 3): the whole-model greedy checks of glm-small through
# flashinfer's MLA (eager and with decode graphs; run 2 ran out of time before them), then where
# the GLM-5-shaped model's decode step goes (bench/probes/decode_profile.py, batch 1, graphs:
# run 2 measured it at 12x its roofline whichever attention runs); then, where its sources are
# carried (.dgsrc), DeepGEMM's extension built against this torch and probed.
# Usage (device tool; carry .whl with flashinfer's three wheels, .ficache, and .dgsrc made as
# bench/deepgemm_build.sh says): bash bench/h200_s7_run3.sh
set -uo pipefail
. bench/device-env.sh
t0=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PYTHONPATH:/tmp/site
export FLASHINFER_DISABLE_VERSION_CHECK=1
cache="$work/steady-flashinfer/cache/compile/flashinfer"
mkdir -p "$cache" "$work/dg"
if [ -f .ficache/flashinfer-jit.tgz ]; then tar -xzf .ficache/flashinfer-jit.tgz -C "$cache"; fi
export FLASHINFER_WORKSPACE_BASE="$cache" DG_JIT_CACHE_DIR="$work/dg"
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_flashinfer.py -k "glm" \
  --durations=0 > "$out/h200-gpu-tests-s7run3-flashinfer.log" 2>&1
grep -E "^E  |^FAILED|^ERROR|passed|failed|s call" "$out/h200-gpu-tests-s7run3-flashinfer.log" | tail -12
echo "[$((SECONDS - t0)) s] glm greedy tests done"
snapfn make-model --preset glm5-reduced --num-layers 2 --dtype fp8 --device cuda --out "$work/glm5" | tail -1
echo "[$((SECONDS - t0)) s] model made"
timeout 200 python3 bench/probes/decode_profile.py "$work/glm5" --backend flashinfer --batch 1 --graphs \
  --steps 8 --top 30 > "$out/h200-s7run3-profile-glm-flashinfer-b1.json"
python3 - "$out/h200-s7run3-profile-glm-flashinfer-b1.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print({k: v for k, v in d.items() if k != "top"})
for r in d["top"][:22]:
    print(" ", r["us"], r["calls_per_step"], r["kernel"][:100])
PY
echo "[$((SECONDS - t0)) s] profile done"
if [ -d .dgsrc ] && [ -f bench/deepgemm_build.sh ]; then
  timeout $((520 - SECONDS)) bash bench/deepgemm_build.sh > "$out/h200-s7run3-deepgemm-build.log" 2>&1
  echo "build rc $?"; tail -5 "$out/h200-s7run3-deepgemm-build.log"
  [ -f /tmp/site/deep_gemm/_C.so ] && cp /tmp/site/deep_gemm/_C.so "$out/deep_gemm_C.so"
  timeout $((590 - SECONDS)) python3 bench/probes/kernel_libs.py --only deep_gemm \
    --out "$out/h200-s7run3-deepgemm.json" 2>&1 | tail -3
fi
echo "[$((SECONDS - t0)) s] done"
