#!/usr/bin/env bash
# Device run on one H200 (session 7, run 4): the routed-expert kernels on tensor cores with one
# scale per tile (run 3: the old kernels were 7 ms of the GLM-5-shaped model's 8 ms decode
# step). Their GPU checks and the whole-model greedy checks of the MoE models (triton, and
# flashinfer's glm-small); the GLM-5-shaped model (FP8, reduced) in the steady state on
# flashinfer and its decode step's kernels (prefill's subtracted); a cold init and a tier-0
# restore of it with the compile cache deleted in between (the restore must compile nothing:
# flashinfer's MLA, the Triton kernels); then DeepGEMM's segfault (run 3) with a traceback.
# Usage (device tool; carry .whl, .ficache, .dgsrc as for run 3): bash bench/h200_s7_run4.sh
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
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_triton_kernels.py \
  -k "moe or engine_greedy" > "$out/h200-gpu-tests-s7run4-triton.log" 2>&1
grep -E "^E  |^FAILED|^ERROR|passed|failed" "$out/h200-gpu-tests-s7run4-triton.log" | tail -10
timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_flashinfer.py \
  -k "engine_greedy-glm" > "$out/h200-gpu-tests-s7run4-flashinfer.log" 2>&1
grep -E "^E  |^FAILED|^ERROR|passed|failed" "$out/h200-gpu-tests-s7run4-flashinfer.log" | tail -6
echo "[$((SECONDS - t0)) s] tests done"
snapfn make-model --preset glm5-reduced --num-layers 2 --dtype fp8 --device cuda --out "$work/glm5" | tail -1
echo "[$((SECONDS - t0)) s] model made"
bench() { SNAPFN_BACKEND=flashinfer timeout "$1" python3 -m snapfn.handler.cli bench --model "$work/glm5" --device cuda "${@:2}"; }
bench 120 --workdir "$work/steady-flashinfer" --modes steady --decode-batches 1,8,32 --decode-tokens 16 \
  --prefill-tokens 1024 --out "$out/h200-glm5-reduced-fp8-steady-s7run4.json" 2>&1 | grep -A4 "^mode"
echo "[$((SECONDS - t0)) s] steady done"
SNAPFN_BACKEND=flashinfer timeout 90 python3 bench/probes/decode_profile.py "$work/glm5" --backend flashinfer \
  --batch 1 --graphs --steps 8 --top 30 > "$out/h200-s7run4-profile-glm-flashinfer-b1.json"
python3 - "$out/h200-s7run4-profile-glm-flashinfer-b1.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print({k: v for k, v in d.items() if k != "top"})
for r in d["top"][:12]:
    print(" ", r["us"], r["calls_per_step"], r["kernel"][:100])
PY
echo "[$((SECONDS - t0)) s] profile done"
bench 120 --workdir "$work/glm-bench" --modes cold_init --decode-batches 1 --decode-tokens 16 \
  --out "$out/h200-glm5-reduced-fp8-s7run4-init.json" 2>&1 | grep -A2 "^mode"
rm -rf "$work/glm-bench/cache"  # what the init compiled and tuned: gone, as on a new machine
bench 90 --workdir "$work/glm-bench" --modes restore --decode-batches 1 --decode-tokens 16 \
  --out "$out/h200-glm5-reduced-fp8-s7run4-restore.json" 2>&1 | grep -A2 "^mode"
python3 bench/startup_summary.py "$out"/h200-glm5-reduced-fp8-s7run4-*.json
echo "[$((SECONDS - t0)) s] init + restore done"
if [ -d .dgsrc ] && [ $SECONDS -lt 480 ]; then
  timeout 90 bash bench/deepgemm_build.sh > "$out/h200-s7run4-deepgemm-build.log" 2>&1; echo "build rc $?"
  timeout $((585 - SECONDS)) python3 -X faulthandler bench/probes/kernel_libs.py --only deep_gemm \
    --out "$out/h200-s7run4-deepgemm.json" > "$out/h200-s7run4-deepgemm.log" 2>&1
  echo "probe rc $?"; grep -v "^  File.*site-packages/torch" "$out/h200-s7run4-deepgemm.log" | tail -12
fi
echo "[$((SECONDS - t0)) s] done"
