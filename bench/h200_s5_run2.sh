#!/usr/bin/env bash
# Device run on one H200 (session 5, run 2): the GPU tests of tier 1 (keeper prefetch from a
# page-cache hold), the Triton kernels compiled (never run on a GPU before) and the flashinfer
# backend; then the 8B llama (bf16): a tier-1 snapshot and restores through `snapfn keeper
# --hold page-cache` (the files' page-cache pages pinned in place) beside a warm keeper; then
# the steady state with the torch, triton and flashinfer backends side by side.
# Usage (device tool; carry .criu (cp -a /opt/snapfn-criu .criu) and .whl (bash bench/flashinfer_wheels.sh)):
#   bash bench/h200_s5_run2.sh
set -uo pipefail
. bench/device-env.sh
t0=$SECONDS
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
export FLASHINFER_DISABLE_VERSION_CHECK=1
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_process_gpu.py tests/test_checksum.py \
  tests/test_triton_kernels.py tests/test_flashinfer.py > "$out/h200-gpu-tests-s5run2.log" 2>&1
grep -E "^E  |^FAILED|^ERROR|passed|failed" "$out/h200-gpu-tests-s5run2.log" | tail -30
echo "[$((SECONDS - t0)) s] tests done"
snapfn make-model --preset 8b --dtype bf16 --device cuda --out "$work/llama8b" | tail -1
echo "[$((SECONDS - t0)) s] model made"
bench() { snapfn bench --model "$work/llama8b" --device cuda --workdir "$work/bench" "$@"; }
name=h200-llama8b-tier1-s5run2
bench --modes init_process,restore_process --decode-batches 1 --out "$out/$name-none.json" 2>&1 | grep -A3 "^mode"
echo "[$((SECONDS - t0)) s] snapshot made"
keeper() {
  python3 -m snapfn.handler.cli "$@" 2> "$out/$name-keeper-$2.log" > /dev/null &
  pid=$!
  for _ in $(seq 300); do grep -q "serving on" "$out/$name-keeper-$2.log" && break; sleep 0.2; done
  tail -1 "$out/$name-keeper-$2.log"
}
keeper keeper --hold page-cache --snapshot "$work/bench/snapshot_process"
for i in 1 2 3; do
  bench --modes restore_process --decode-batches 1 --out "$out/$name-pagecache-$i.json" 2>&1 | grep -A1 "^mode"
done
kill $pid; wait $pid
keeper keeper --hold copy
bench --modes restore_process --decode-batches 1 --out "$out/$name-warm.json" 2>&1 | grep -A1 "^mode"
kill $pid; wait $pid
echo "[$((SECONDS - t0)) s] keepers done"
for f in "$out/$name"-*.json; do python3 bench/tier1_summary.py "$f"; done
rm -rf "$work/bench"
for backend in torch triton flashinfer; do
  SNAPFN_BACKEND=$backend timeout 120 python3 -m snapfn.handler.cli bench --model "$work/llama8b" --device cuda \
    --modes steady --decode-batches 1,8,32,64 --decode-tokens 32 --workdir "$work/steady-$backend" \
    --out "$out/h200-llama8b-steady-$backend.json" 2>&1 | grep -A8 "^mode"
  echo "[$((SECONDS - t0)) s] $backend done"
done
