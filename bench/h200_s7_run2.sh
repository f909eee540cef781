#!/usr/bin/env bash
# Device run on one H200 (session 7, run 2): flashinfer's MLA for glm_moe_dsa — the backend's
# GPU checks (GLM-5-shaped sparse MLA decode, prefill, decode graph; whole-model greedy of
# glm-small, eager and with graphs; the llama cases again, with more time than run 1 gave),
# then the GLM-5-shaped model (FP8, reduced) in the steady state on the flashinfer backend,
# beside session 6's triton figures; then, where its sources are carried (.dgsrc), DeepGEMM's
# extension built against this torch and probed.
# Usage (device tool; carry .whl with flashinfer's three wheels and sgl_deep_gemm, .ficache and
# .dgsrc): bash bench/h200_s7_run2.sh
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
timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_flashinfer.py \
  > "$out/h200-gpu-tests-s7run2-flashinfer.log" 2>&1
grep -E "^E  |^FAILED|^ERROR|passed|failed" "$out/h200-gpu-tests-s7run2-flashinfer.log" | tail -12
echo "[$((SECONDS - t0)) s] flashinfer tests done"
snapfn make-model --preset glm5-reduced --num-layers 2 --dtype fp8 --device cuda --out "$work/glm5" | tail -1
echo "[$((SECONDS - t0)) s] model made"
SNAPFN_BACKEND=flashinfer timeout 200 python3 -m snapfn.handler.cli bench --model "$work/glm5" \
  --device cuda --workdir "$work/steady-flashinfer" --modes steady --decode-batches 1,8,32 \
  --decode-tokens 16 --prefill-tokens 1024 --out "$out/h200-glm5-reduced-fp8-steady-s7-flashinfer.json" \
  2>&1 | grep -A4 "^mode"
echo "[$((SECONDS - t0)) s] glm steady done"
tar -czf "$out/flashinfer-jit.tgz" -C "$cache" . && ls -la "$out/flashinfer-jit.tgz"
if [ -d .dgsrc ] && [ -f bench/deepgemm_build.sh ]; then
  timeout $((540 - SECONDS)) bash bench/deepgemm_build.sh > "$out/h200-s7run2-deepgemm-build.log" 2>&1
  echo "build rc $?"; tail -5 "$out/h200-s7run2-deepgemm-build.log"
  [ -f /tmp/site/deep_gemm/_C.so ] && cp /tmp/site/deep_gemm/_C.so "$out/deep_gemm_C.so"
  timeout $((590 - SECONDS)) python3 bench/probes/kernel_libs.py --only deep_gemm \
    --out "$out/h200-s7run2-deepgemm.json" 2>&1 | tail -3
fi
echo "[$((SECONDS - t0)) s] done"
