#!/usr/bin/env bash
# Device run on one H200 (session 9, run 1): where the batch-1 decode step's GEMV time can go.
# `bench/probes/gemv_probe.py`: the new fused Triton GEMV (`kernels/triton/gemv.py`; add +
# RMSNorm before, SwiGLU after) config by config against what the engine runs now (cuBLAS with
# the Triton norm and activation kernels), on the 8B llama's shapes. Then the GLM-5-shaped
# model's prefill profile with DeepGEMM off and on (`bench/probes/prefill_profile.py`, session
# 8's open question), and the Triton whole-model greedy cases session 8 ran out of time for.
# Usage (device tool; carry .whl, .ficache, .dgsrc): bash bench/h200_s9_run1.sh
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
(timeout 100 bash bench/deepgemm_build.sh > "$out/h200-s9run1-deepgemm-build.log" 2>&1; echo "build rc $?") &
timeout 300 python3 bench/probes/gemv_probe.py > "$out/h200-s9run1-gemv.jsonl" 2> "$out/h200-s9run1-gemv.err"
echo "probe rc $?"; tail -3 "$out/h200-s9run1-gemv.err"
python3 - "$out/h200-s9run1-gemv.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    best = min((v[0], k) for k, v in r["configs"].items() if isinstance(v, list))
    print(r["shape"], r["rows"], "unfused", r["unfused_us"], r["unfused_tbps"], "tuned", r["tuned_us"],
          r["tuned_tbps"], "x", r["speedup"], "err", r["tuned_err"], "best", best)
PY
wait
echo "[$((SECONDS - t0)) s] gemv done"
snapfn make-model --preset glm5-reduced --num-layers 2 --dtype fp8 --device cuda --out "$work/glm5" | tail -1
for dg in off on; do
  SNAPFN_DEEPGEMM=$dg timeout 90 python3 bench/probes/prefill_profile.py "$work/glm5" --tokens 2048 --top 30 \
    > "$out/h200-s9run1-prefill-profile-glm-dg-$dg.json" 2> "$out/h200-s9run1-prefill-profile-glm-dg-$dg.err"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: v for k, v in d.items() if k != 'top'}); [print(' ', t['us'], t['calls'], t['kernel'][:90]) for t in d['top'][:14]]" \
    "$out/h200-s9run1-prefill-profile-glm-dg-$dg.json" || tail -3 "$out/h200-s9run1-prefill-profile-glm-dg-$dg.err"
  echo "[$((SECONDS - t0)) s] prefill profile dg=$dg done"
done
if [ $SECONDS -lt 480 ]; then
  timeout $((570 - SECONDS)) python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_triton_kernels.py \
    -k "engine_greedy" > "$out/h200-gpu-tests-s9run1-greedy.log" 2>&1
  grep -E "^E  |^FAILED|^ERROR|passed|failed" "$out/h200-gpu-tests-s9run1-greedy.log" | tail -6
fi
echo "[$((SECONDS - t0)) s] done"
