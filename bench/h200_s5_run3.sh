#!/usr/bin/env bash
# Device run on one H200 (session 5, run 3): the flashinfer backend's GPU checks and the tier-1
# GPU tests with flashinfer installed; then the 8B llama (bf16) on the default backend ("auto":
# flashinfer here): cold init and a process snapshot, each compiling into the bench's cache;
# that cache deleted (a new machine); tier 0 and tier 1 (through `snapfn keeper --hold
# page-cache`) restored from the snapshots, which must compile nothing.
# Usage (device tool; carry .criu and .whl, see bench/h200_s5_run2.sh): bash bench/h200_s5_run3.sh
set -uo pipefail
. bench/device-env.sh
t0=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PYTHONPATH:/tmp/site
timeout 280 python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/test_flashinfer.py tests/test_process_gpu.py \
  > "$out/h200-gpu-tests-s5run3.log" 2>&1
grep -E "^E  |^FAILED|^ERROR|passed|failed" "$out/h200-gpu-tests-s5run3.log" | tail -30
echo "[$((SECONDS - t0)) s] tests done"
snapfn make-model --preset 8b --dtype bf16 --device cuda --out "$work/llama8b" | tail -1
echo "[$((SECONDS - t0)) s] model made"
bench() { snapfn bench --model "$work/llama8b" --device cuda --workdir "$work/bench" --decode-batches 1 "$@"; }
name=h200-llama8b-s5run3
bench --modes cold_init,init_process --out "$out/$name-init.json" 2>&1 | grep -A3 "^mode"
echo "[$((SECONDS - t0)) s] snapshots made"
rm -rf "$work/bench/cache"  # what the inits compiled: gone, as on a new machine
python3 -m snapfn.handler.cli keeper --hold page-cache --snapshot "$work/bench/snapshot_process" \
  2> "$out/$name-keeper.log" > /dev/null &
pid=$!
for _ in $(seq 300); do grep -q "serving on" "$out/$name-keeper.log" && break; sleep 0.2; done
bench --modes restore,restore_process --out "$out/$name-restore.json" 2>&1 | grep -A6 "^mode"
kill $pid; wait $pid
echo "[$((SECONDS - t0)) s] restores done"
python3 bench/startup_summary.py "$out/$name-init.json" "$out/$name-restore.json"
