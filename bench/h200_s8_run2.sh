#!/usr/bin/env bash
# Device run on one H200 (session 8, run 2). DeepGEMM rebuilt with libstdc++ linked dynamically
# (run 1: the GPU machine's g++ links it statically into _C.so, and DeepGEMM's JIT then
# segfaults in its first std::regex); its stage probe; tests/test_deepgemm.py's GPU cases (the
# dense and grouped FP8 GEMMs against the torch reference at GLM-5's shapes); then the
# GLM-5-shaped model (FP8, reduced) in the steady state with DeepGEMM off and on, side by side
# (prefill is what changes: its FP8 linears and routed experts).
# Usage (device tool; carry .whl, .ficache, .dgsrc): bash bench/h200_s8_run2.sh
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
timeout 120 bash bench/deepgemm_build.sh > "$out/h200-s8run2-deepgemm-build.log" 2>&1; echo "build rc $?"
tail -3 "$out/h200-s8run2-deepgemm-build.log"
DG_JIT_DEBUG=0 timeout 150 python3 bench/probes/deepgemm_stages.py --timeout 60 \
  --stages sf_layout,fp8_m128,fp8_m1,grouped > "$out/h200-s8run2-deepgemm-stages.jsonl" 2>&1
python3 - "$out/h200-s8run2-deepgemm-stages.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    try:
        r = json.loads(line)
    except ValueError:
        print(line.rstrip()[:200]); continue
    print(r["stage"], r["rc"], r["s"], r["result"])
    if r["rc"] != 0:
        for t in r["tail"][-14:]:
            print("   ", t[:200])
PY
echo "[$((SECONDS - t0)) s] deepgemm probe done"
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_deepgemm.py \
  > "$out/h200-gpu-tests-s8run2-deepgemm.log" 2>&1
grep -E "^E  |^FAILED|^ERROR|passed|failed" "$out/h200-gpu-tests-s8run2-deepgemm.log" | tail -8
echo "[$((SECONDS - t0)) s] tests done"
snapfn make-model --preset glm5-reduced --num-layers 2 --dtype fp8 --device cuda --out "$work/glm5" | tail -1
echo "[$((SECONDS - t0)) s] model made"
for dg in off auto; do
  SNAPFN_DEEPGEMM=$dg SNAPFN_BACKEND=flashinfer timeout 150 python3 -m snapfn.handler.cli bench \
    --model "$work/glm5" --device cuda --workdir "$work/steady-flashinfer" --modes steady \
    --decode-batches 1 --decode-tokens 16 --prefill-tokens 2048 \
    --out "$out/h200-glm5-reduced-fp8-steady-s8run2-deepgemm-$dg.json" 2>&1 | grep -A3 "^mode"
  python3 -c "import json,sys; m=json.load(open(sys.argv[1]))['modes']['steady']; print('$dg', m.get('deepgemm'), m.get('prefill'), m.get('decode'))" \
    "$out/h200-glm5-reduced-fp8-steady-s8run2-deepgemm-$dg.json"
  echo "[$((SECONDS - t0)) s] steady deepgemm=$dg done"
done
