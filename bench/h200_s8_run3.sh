#!/usr/bin/env bash
# Device run on one H200 (session 8, run 3): the overlapped decode loop (87b56ae). Its GPU
# checks (the whole-model greedy cases that capture graphs, where it is on), then the 8B llama
# (bf16) in the steady state with it off and on, side by side; then the GLM-5-shaped model
# (FP8, reduced) with it on (and DeepGEMM on, for prefill).
# Usage (device tool; carry .whl, .ficache, .dgsrc, .s8base): bash bench/h200_s8_run3.sh
# .s8base holds the committed copies of files being edited in the working tree at the time,
# copied over first so that this run is of the commit.
set -uo pipefail
if [ -d .s8base ]; then cp -r .s8base/. .; fi
. bench/device-env.sh
t0=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PYTHONPATH:/tmp/site
export FLASHINFER_DISABLE_VERSION_CHECK=1
cache="$work/steady-flashinfer/cache/compile/flashinfer"
mkdir -p "$cache" "$work/dg"
if [ -f .ficache/flashinfer-jit.tgz ]; then tar -xzf .ficache/flashinfer-jit.tgz -C "$cache"; fi
export FLASHINFER_WORKSPACE_BASE="$cache" DG_JIT_CACHE_DIR="$work/dg"
(timeout 100 bash bench/deepgemm_build.sh > "$out/h200-s8run3-deepgemm-build.log" 2>&1; echo "build rc $?") &
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_flashinfer.py \
  -k "engine_greedy-graphs or engine_greedy-glm-graphs" > "$out/h200-gpu-tests-s8run3-flashinfer.log" 2>&1
grep -E "^E  |^FAILED|^ERROR|passed|failed" "$out/h200-gpu-tests-s8run3-flashinfer.log" | tail -8
wait
echo "[$((SECONDS - t0)) s] tests done"
snapfn make-model --preset 8b --dtype bf16 --device cuda --out "$work/llama8b" | tail -1
echo "[$((SECONDS - t0)) s] model made"
for ov in off on; do
  SNAPFN_OVERLAP_DECODE=$ov SNAPFN_BACKEND=flashinfer timeout 150 python3 -m snapfn.handler.cli bench \
    --model "$work/llama8b" --device cuda --modes steady --decode-batches 1,8,32,64 --decode-tokens 32 \
    --workdir "$work/steady-flashinfer" --out "$out/h200-llama8b-steady-s8run3-overlap-$ov.json" 2>&1 \
    | grep -A3 "^mode"
  echo "[$((SECONDS - t0)) s] llama8b overlap=$ov done"
done
rm -rf "$work/llama8b"
if [ $SECONDS -lt 440 ]; then
  snapfn make-model --preset glm5-reduced --num-layers 2 --dtype fp8 --device cuda --out "$work/glm5" | tail -1
  SNAPFN_BACKEND=flashinfer timeout $((590 - SECONDS)) python3 -m snapfn.handler.cli bench \
    --model "$work/glm5" --device cuda --workdir "$work/steady-flashinfer" --modes steady \
    --decode-batches 1,8,32 --decode-tokens 16 --prefill-tokens 2048 \
    --out "$out/h200-glm5-reduced-fp8-steady-s8run3.json" 2>&1 | grep -A3 "^mode"
fi
echo "[$((SECONDS - t0)) s] done"
