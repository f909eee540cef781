#!/usr/bin/env bash
# Device run on one H200 (session 6, run 4): the restore paths after the decode-step work (fused
# projections renamed parameters; graphs now upload their inputs from a pinned host mirror). The
# tier-1 GPU tests; then the 8B llama (bf16, flashinfer, its JIT cache carried from run 3 in
# .ficache): cold init and a process snapshot, the bench's compile cache deleted, tier 0 and
# tier 1 (through `snapfn keeper --hold page-cache`) restored, each compared with the cold init.
# Usage (device tool; carry .criu, .whl and .ficache): bash bench/h200_s6_run4.sh
set -uo pipefail
. bench/device-env.sh
t0=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PYTHONPATH:/tmp/site
export FLASHINFER_DISABLE_VERSION_CHECK=1
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/test_process_gpu.py \
  > "$out/h200-gpu-tests-s6run4.log" 2>&1
grep -E "^E  |^FAILED|^ERROR|passed|failed" "$out/h200-gpu-tests-s6run4.log" | tail -20
echo "[$((SECONDS - t0)) s] tests done"
snapfn make-model --preset 8b --dtype bf16 --device cuda --out "$work/llama8b" | tail -1
echo "[$((SECONDS - t0)) s] model made"
mkdir -p "$work/bench/cache/compile/flashinfer"
tar -xzf .ficache/flashinfer-jit.tgz -C "$work/bench/cache/compile/flashinfer"
bench() { snapfn bench --model "$work/llama8b" --device cuda --workdir "$work/bench" --decode-batches 1 "$@"; }
name=h200-llama8b-s6run4
bench --modes cold_init,init_process --out "$out/$name-init.json" 2>&1 | grep -A3 "^mode"
echo "[$((SECONDS - t0)) s] snapshots made"
rm -rf "$work/bench/cache"  # what the inits compiled or found: gone, as on a new machine
python3 -m snapfn.handler.cli keeper --hold page-cache --snapshot "$work/bench/snapshot_process" \
  2> "$out/$name-keeper.log" > /dev/null &
pid=$!
for _ in $(seq 300); do grep -q "serving on" "$out/$name-keeper.log" && break; sleep 0.2; done
bench --modes restore,restore_process --out "$out/$name-restore.json" 2>&1 | grep -A6 "^mode"
bench --modes restore_process --out "$out/$name-restore2.json" 2>&1 | grep -A2 "^mode"
kill $pid; wait $pid
echo "[$((SECONDS - t0)) s] restores done"
python3 bench/tier1_summary.py "$out/$name-restore.json"
python3 bench/startup_summary.py "$out/$name-init.json" "$out/$name-restore.json" "$out/$name-restore2.json"
