#!/usr/bin/env bash
# Build DeepGEMM's host extension (_C) on the GPU machine, against the torch installed there, and
# install it as the `deep_gemm` package.
#
# Why: the sgl-deep-gemm 0.2.5 wheel in .whl/ ships a prebuilt deep_gemm/_C.so that was built for a
# newer torch (>= 2.13). On the GPU machine's torch 2.11.0+cu130 it fails to load with
# "undefined symbol: _ZN3c104cuda19CUDAErrorLogCaptureC1Ev". Other symbols are missing too
# (torch_exception_get_what, Library::_def with torch::headeronly::Tag, ...). A symbol shim cannot
# fix it, because c10::TensorImpl's layout changed as well (pyobj_slot_ went from 16 to 8 bytes), so
# the wheel's inlined tensor accessors would read the wrong fields. The wheel's own C++ source
# (csrc/torch_library_api.cpp) is not published anywhere we can reach. So this builds upstream
# DeepGEMM instead: deepseek-ai/DeepGEMM 54e2261 (2026-06-23, Python API 2.6.1), carried in .dgsrc/
# (see .dgsrc/README.md). Its Python package, JIT kernel headers and CUTLASS 4.2.1 pin all come
# from that one commit.
#
# Usage, after `python3 -m pip install --target /tmp/site .whl/*.whl`:
#   bash bench/deepgemm_build.sh [PKG_DIR]
# PKG_DIR (default /tmp/site/deep_gemm) is replaced. It gets .dgsrc/deep_gemm (Python package and
# include/deep_gemm), include/{cute,cutlass} from the CUTLASS tarball, and
# csrc/python_api.cpp compiled to PKG_DIR/_C<EXT_SUFFIX>, so the prebuilt 0.2.5 _C.so is gone.
# Then the script imports deep_gemm once as a check. Set DG_BUILD_NO_IMPORT_CHECK=1 to skip that.
# Env: CUDA_HOME or CUDA_PATH (otherwise dirname(dirname(which nvcc)), otherwise /usr/local/cuda);
# CXX (default c++); PYTHON (default python3); DG_JIT_USE_RUNTIME_API=1 adds
# -DDG_JIT_USE_RUNTIME_API, as DeepGEMM's setup.py does.
# At run time the JIT compiles kernels with $CUDA_HOME/bin/nvcc, or with NVRTC if
# DG_JIT_USE_NVRTC=1. DG_JIT_NVCC_COMPILER overrides the nvcc path. Kernels are cached under
# $DG_JIT_CACHE_DIR (default ~/.deep_gemm).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
src="$root/.dgsrc"
pkg=${1:-/tmp/site/deep_gemm}
PY=${PYTHON:-python3}
CXX=${CXX:-c++}
log() { echo "[deepgemm_build] $*" >&2; }

[ -f "$src/csrc/python_api.cpp" ] || { log "missing $src/csrc/python_api.cpp (carry .dgsrc)"; exit 2; }
case "$(basename "$pkg")" in
  deep_gemm) ;;
  *) log "PKG_DIR must end in /deep_gemm (it is replaced): $pkg"; exit 2 ;;
esac

# CUDA_HOME the way deep_gemm's _find_cuda_home does it
cuda_home=${CUDA_HOME:-${CUDA_PATH:-}}
if [ -z "$cuda_home" ]; then
  if nvcc_path=$(command -v nvcc); then
    cuda_home=$(dirname "$(dirname "$nvcc_path")")
  elif [ -d /usr/local/cuda ]; then
    cuda_home=/usr/local/cuda
  else
    log "no CUDA_HOME, CUDA_PATH, nvcc on PATH or /usr/local/cuda"; exit 2
  fi
fi

# torch's dir and C++ ABI, plus Python's include dir and extension suffix
mapfile -t info < <("$PY" - <<'EOF'
import os, sysconfig, torch
print(os.path.dirname(torch.__file__))
print(int(torch.compiled_with_cxx11_abi()))
print(sysconfig.get_paths()["include"])
print(sysconfig.get_config_var("EXT_SUFFIX") or ".so")
print(torch.__version__)
EOF
)
[ "${#info[@]}" -ge 5 ] || { log "could not query torch with $PY"; exit 2; }
torch_dir=${info[0]} cxx11_abi=${info[1]} py_include=${info[2]} ext_suffix=${info[3]}
log "torch ${info[4]} at $torch_dir, CUDA_HOME=$cuda_home, Python include $py_include"
[ -f "$py_include/Python.h" ] || { log "Python.h not found in $py_include"; exit 2; }

# Lay out the package: Python sources and DeepGEMM's JIT headers, then CUTLASS 4.2.1's headers
rm -rf "$pkg"
mkdir -p "$(dirname "$pkg")"
cp -r "$src/deep_gemm" "$pkg"
cutlass_tar=$(ls "$src"/third-party/cutlass/cutlass-*-include.tar.xz)
if command -v xz >/dev/null; then
  tar -xJf "$cutlass_tar" -C "$pkg/include"
else
  "$PY" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' "$cutlass_tar" "$pkg/include"
fi
out="$pkg/_C$ext_suffix"

cflags=(-std=c++17 -O3 -fPIC -shared -Wno-psabi -Wno-deprecated-declarations
        "-D_GLIBCXX_USE_CXX11_ABI=$cxx11_abi" -DTORCH_API_INCLUDE_EXTENSION_H -DTORCH_EXTENSION_NAME=_C)
if [ "${DG_JIT_USE_RUNTIME_API:-0}" != 0 ]; then cflags+=(-DDG_JIT_USE_RUNTIME_API); fi
incs=("-I$cuda_home/include")
if [ -d "$cuda_home/include/cccl" ]; then incs+=("-I$cuda_home/include/cccl"); fi
incs+=("-I$pkg/include" "-I$src/third-party/fmt/include"
       "-I$torch_dir/include" "-I$torch_dir/include/torch/csrc/api/include" "-I$py_include")
libs=("-L$cuda_home/lib64" "-L$torch_dir/lib" -lcudart -lnvrtc)
# cuBLASLt also resolves through libtorch_cuda; link it directly when the toolkit has it
if [ -e "$cuda_home/lib64/libcublasLt.so" ]; then libs+=(-lcublasLt -lcublas); fi
libs+=(-lc10 -ltorch -ltorch_cpu -ltorch_python -lc10_cuda -ltorch_cuda)
# NOTE: libstdc++ by its full path, so it links dynamically even where the compiler driver links it
# statically (the GPU machine's /opt/gcc/bin/g++ does: bench/probes/deepgemm_stages.py on the H200,
# 2026-11-30, results in commit 1fe1a4d). A second, static copy of
# libstdc++ inside _C.so shares no locale with the process's own, and DeepGEMM's first std::regex
# (its JIT's include parser) or `ostream << long` then segfaults.
libstdcxx=$("$CXX" -print-file-name=libstdc++.so)
if [ "$libstdcxx" = libstdc++.so ]; then libstdcxx=$("$CXX" -print-file-name=libstdc++.so.6); fi
if [ "$libstdcxx" != libstdc++.so.6 ]; then libs+=("-Wl,--no-as-needed" "$libstdcxx" "-Wl,--as-needed"); fi
cmd=("$CXX" "${cflags[@]}" "${incs[@]}" "$src/csrc/python_api.cpp" -o "$out" "${libs[@]}")

log "compiling: ${cmd[*]}"
t0=$(date +%s.%N)
rc=0
"${cmd[@]}" || rc=$?
secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
if [ "$rc" -ne 0 ]; then
  log "compile FAILED (exit $rc) after ${secs}s; the compiler's errors are above"
  exit "$rc"
fi
log "built $out in ${secs}s ($(du -h "$out" | cut -f1))"
if command -v readelf >/dev/null && ! readelf -d "$out" | grep -q 'NEEDED.*libstdc++'; then
  log "FAILED: $out links libstdc++ statically (no NEEDED libstdc++.so.6); it would segfault in"
  log "DeepGEMM's JIT. Point CXX at a compiler whose libstdc++.so is found by -print-file-name."
  exit 3
fi

if [ "${DG_BUILD_NO_IMPORT_CHECK:-0}" = 0 ]; then
  PYTHONPATH="$(dirname "$pkg")${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c \
    'import deep_gemm, sys; print(f"[deepgemm_build] import ok: deep_gemm {deep_gemm.__version__} from {deep_gemm.__file__}", file=sys.stderr)'
fi
