#!/usr/bin/env bash
# Build DeepEP V1 (deepseek-ai/DeepEP 29d31c0, "Nvshmem 3 5 runtime fixes": the last commit
# before V2 moved to NCCL's device API, which needs NCCL >= 2.30.4) on the GPU machine, against
# the torch installed there, with its intranode (NVLink) normal-mode kernels only: the ones
# `DeepEPExchange` (handler/llm/models/expert_exchange.py, ep_dispatch="deepep") calls. NVSHMEM
# (internode and low-latency kernels) is left out even where nvidia-nvshmem is installed.
#
# Sources: .deepepsrc/ (git-ignored, 1.9 MB), laid out from a clone or the fetch tool's mirror:
#   mkdir -p .deepepsrc && git -C DEEPEP_CLONE archive 29d31c0 | tar -x -C .deepepsrc
# Usage (on the GPU machine; carry .deepepsrc): bash bench/deepep_build.sh [TARGET_DIR]
# Installs deep_ep/ and deep_ep_cpp*.so into TARGET_DIR (default /tmp/site) and imports it once.
# The build takes several minutes (one SM90 target); MAX_JOBS sets its parallelism.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
src="$root/.deepepsrc"
target=${1:-/tmp/site}
PY=${PYTHON:-python3}
log() { echo "[deepep_build] $*" >&2; }
[ -f "$src/setup.py" ] && [ -f "$src/csrc/kernels/intranode.cu" ] \
  || { log "missing $src/setup.py or csrc/kernels/intranode.cu (carry .deepepsrc)"; exit 2; }
build=$(mktemp -d)
cp -r "$src/." "$build/"
cd "$build"
# NOTE: libstdc++ linked dynamically, by its full path: where the compiler driver links it
# statically (the GPU machine's g++ did for DeepGEMM, 2026-11-30), a second copy inside the
# extension shares nothing with the process's own (deepgemm_build.sh)
libstdcxx=$(${CXX:-c++} -print-file-name=libstdc++.so)
export LDFLAGS="${LDFLAGS:-} -Wl,--no-as-needed $libstdcxx -Wl,--as-needed"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}
# setup.py enables NVSHMEM when `nvidia.nvshmem` is importable; hide it so that only the
# intranode sources are built (its own "NVSHMEM_DIR unset and no module" path)
"$PY" - <<'PYEOF'
import importlib.util, runpy, sys
real = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name.startswith("nvidia.nvshmem") else real(name, *a)
sys.argv = ["setup.py", "build_ext", "--inplace"]
runpy.run_path("setup.py", run_name="__main__")
PYEOF
so=$(ls deep_ep_cpp*.so)
if command -v readelf >/dev/null && ! readelf -d "$so" | grep -q 'NEEDED.*libstdc++'; then
  log "FAILED: $so links libstdc++ statically"; exit 1
fi
mkdir -p "$target"
rm -rf "$target/deep_ep" "$target"/deep_ep_cpp*.so
cp -r deep_ep "$so" "$target/"
cd "$target" && "$PY" -c "import deep_ep, torch; print('deep_ep', deep_ep.__file__, 'topk_idx_t', deep_ep.topk_idx_t)"
log "installed into $target"
