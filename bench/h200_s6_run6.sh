#!/usr/bin/env bash
# Device run on one H200 (session 6, run 6): the FP8 block-scaled GEMM kernel's GPU checks and
# whole-model greedy parity with decode graphs replayed (llama tiny, glm tiny bf16 and FP8); then
# the GLM-5-shaped model (FP8, reduced as in bench/h200_glm5.sh) in the steady state on the
# triton backend, with decode CUDA graphs (new for MoE models) and without them
# (SNAPFN_GRAPH_MAX_BATCH=0) side by side; run 5 measured it eager, before the FP8 kernel.
# Usage (device tool): bash bench/h200_s6_run6.sh
set -uo pipefail
. bench/device-env.sh
t0=$SECONDS
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_triton_kernels.py \
  -k "fp8_gemm or linear_fp8 or engine_greedy or moe or indexer or dequant" \
  > "$out/h200-gpu-tests-s6run6.log" 2>&1
grep -E "^E  |^FAILED|^ERROR|passed|failed" "$out/h200-gpu-tests-s6run6.log" | tail -20
echo "[$((SECONDS - t0)) s] tests done"
snapfn make-model --preset glm5-reduced --num-layers 2 --dtype fp8 --device cuda --out "$work/glm5" | tail -1
echo "[$((SECONDS - t0)) s] model made"
for graphs in 64 0; do
  SNAPFN_GRAPH_MAX_BATCH=$graphs timeout 200 python3 -m snapfn.handler.cli bench --model "$work/glm5" \
    --device cuda --workdir "$work/glm-steady-$graphs" --modes steady --decode-batches 1,8,32 \
    --decode-tokens 16 --prefill-tokens 1024 --out "$out/h200-glm5-reduced-fp8-steady-s6-graphs$graphs.json" \
    2>&1 | grep -A8 "^mode"
  echo "[$((SECONDS - t0)) s] glm steady (graph_max_batch $graphs) done"
done
python3 - "$out"/h200-glm5-reduced-fp8-steady-s6-graphs*.json <<'PY'
import json, sys
for path in sys.argv[1:]:
    m = json.load(open(path))["modes"]["steady"]
    stages = {s["name"]: s["figures"] for s in (m.get("startup") or {}).get("stages", [])}
    print(path.rsplit("/", 1)[-1], m.get("decode"), stages.get("capture_graphs"))
PY
