#!/usr/bin/env bash
# Device run on one H200 (session 5, run 1), 8B llama bf16: the tier-1 GPU tests (a keeper's
# restore among them); cold init, tier 0 and tier 1 side by side, no keeper; then `snapfn keeper`
# (driver warm, no pinned copy: the weights still come from the page cache) and two tier-1
# restores through it; then `snapfn pin` (the same keeper holding the weights pinned) and three.
# Usage (device tool; criu carried as .criu: cp -a /opt/snapfn-criu .criu): bash bench/h200_tier1_keeper.sh
set -uo pipefail
. bench/device-env.sh
t0=$SECONDS
python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_process_gpu.py > "$out/h200-gpu-tests-keeper.log" 2>&1
grep -E "^E |passed|failed" "$out/h200-gpu-tests-keeper.log" | tail -8
echo "[$((SECONDS - t0)) s] tests done"
snapfn make-model --preset 8b --dtype bf16 --device cuda --out "$work/llama8b" | tail -1
echo "[$((SECONDS - t0)) s] model made"
bench() { snapfn bench --model "$work/llama8b" --device cuda --workdir "$work/bench" "$@"; }
name=h200-llama8b-tier1-keeper
bench --modes cold_init,restore,init_process,restore_process --decode-batches 1 \
  --out "$out/$name-none.json" 2>&1 | grep -A12 "^mode"
echo "[$((SECONDS - t0)) s] side by side done"
# NOTE: python3 -m, not the `snapfn` shell function: `kill` must reach the keeper itself
keeper() {
  python3 -m snapfn.handler.cli "$@" 2> "$out/$name-$1.log" > /dev/null &
  pid=$!
  for _ in $(seq 300); do grep -q "serving on" "$out/$name-$1.log" && break; sleep 0.2; done
  tail -1 "$out/$name-$1.log"
}
keeper keeper
for i in 1 2; do
  bench --modes restore_process --decode-batches 1 --out "$out/$name-warm-$i.json" 2>&1 | grep -A1 "^mode"
done
kill $pid; wait $pid
echo "[$((SECONDS - t0)) s] warm keeper done"
keeper pin --snapshot "$work/bench/snapshot_process"
for i in 1 2 3; do
  bench --modes restore_process --decode-batches 1 --out "$out/$name-pinned-$i.json" 2>&1 | grep -A1 "^mode"
done
kill $pid; wait $pid
echo "[$((SECONDS - t0)) s] pinned keeper done"
for f in "$out/$name"-*.json; do python3 bench/tier1_summary.py "$f"; done
