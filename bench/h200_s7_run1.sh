#!/usr/bin/env bash
# Device run on one H200 (session 7, run 1): do DeepGEMM (sgl-deep-gemm), DeepEP (sgl-deep-ep)
# and flashinfer's MLA wrapper run here (bench/probes/kernel_libs.py), then the GPU checks of
# the flashinfer and triton backends left unrun by session 6's last commits.
# Usage (device tool; carry .whl with flashinfer's three wheels, sgl_deep_gemm and sgl_deep_ep,
# and .ficache): bash bench/h200_s7_run1.sh
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
timeout 330 python3 bench/probes/kernel_libs.py --out "$out/h200-s7run1-kernel-libs.json" 2>&1 | tail -8
echo "[$((SECONDS - t0)) s] probe done"
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_flashinfer.py \
  > "$out/h200-gpu-tests-s7run1-flashinfer.log" 2>&1
grep -E "^E  |^FAILED|^ERROR|passed|failed" "$out/h200-gpu-tests-s7run1-flashinfer.log" | tail -8
echo "[$((SECONDS - t0)) s] flashinfer tests done"
tar -czf "$out/flashinfer-jit.tgz" -C "$cache" . && ls -la "$out/flashinfer-jit.tgz"
timeout $((575 - SECONDS)) python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_triton_kernels.py \
  > "$out/h200-gpu-tests-s7run1-triton.log" 2>&1
grep -E "^E  |^FAILED|^ERROR|passed|failed" "$out/h200-gpu-tests-s7run1-triton.log" | tail -12
echo "[$((SECONDS - t0)) s] triton tests done"
