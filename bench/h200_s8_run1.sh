#!/usr/bin/env bash
# Device run on one H200 (session 8, run 1). First, where DeepGEMM's first FP8 GEMM segfaults
# (session 7, run 4): DeepGEMM built from .dgsrc, then bench/probes/deepgemm_stages.py, each
# stage in its own process with DG_JIT_DEBUG=1 and a native backtrace on a crash; the built
# _C.so comes back for addr2line. Then the GPU checks of the commits made after session 7's
# last device run: ForwardPlan (78195c0), CopyFence (ce948eb), the MLA's per-plan page table
# (607b963) through flashinfer's graph and greedy cases, and the shared dot_acc (e9cd74a)
# through the Triton FP8 GEMM, expert and greedy cases.
# Usage (device tool; carry .whl, .ficache, .dgsrc): bash bench/h200_s8_run1.sh
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
cc -shared -fPIC -O1 -o /tmp/segv.so bench/probes/segv_backtrace.c && export SEGV_SO=/tmp/segv.so
timeout 90 bash bench/deepgemm_build.sh > "$out/h200-s8run1-deepgemm-build.log" 2>&1; echo "build rc $?"
cp /tmp/site/deep_gemm/_C*.so "$out/" 2>/dev/null
timeout 240 python3 bench/probes/deepgemm_stages.py --timeout 60 > "$out/h200-s8run1-deepgemm-stages.jsonl" 2>&1
python3 - "$out/h200-s8run1-deepgemm-stages.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    try:
        r = json.loads(line)
    except ValueError:
        print(line.rstrip()[:200]); continue
    print(r["stage"], r["rc"], r["s"], r["result"])
    if r["rc"] != 0:
        for t in r["tail"][-25:]:
            print("   ", t[:220])
PY
echo "[$((SECONDS - t0)) s] deepgemm done"
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_flashinfer.py \
  -k "decode_graph or engine_greedy-graphs or engine_greedy-glm-graphs" > "$out/h200-gpu-tests-s8run1-flashinfer.log" 2>&1
grep -E "^E  |^FAILED|^ERROR|passed|failed" "$out/h200-gpu-tests-s8run1-flashinfer.log" | tail -8
echo "[$((SECONDS - t0)) s] flashinfer done"
timeout $((590 - SECONDS)) python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_triton_kernels.py \
  -k "fp8_gemm or moe or engine_greedy" > "$out/h200-gpu-tests-s8run1-triton.log" 2>&1
grep -E "^E  |^FAILED|^ERROR|passed|failed" "$out/h200-gpu-tests-s8run1-triton.log" | tail -8
echo "[$((SECONDS - t0)) s] done"
