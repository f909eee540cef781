#!/usr/bin/env bash
# Device run on one H200 (session 4, run 4), 8B llama bf16: the tier-1 GPU tests; cold init,
# tier 0 and tier 1 side by side with the weights read from the page cache; then `snapfn pin`
# keeps the snapshot's weights in pinned host memory (CUDA host-NUMA VMM allocations, exported
# as fds) and three tier-1 restores copy them from there; the keeper stopped, one more restore
# from the page cache.
# Usage (device tool; criu carried as .criu: cp -a /opt/snapfn-criu .criu): bash bench/h200_tier1_pinned.sh
set -uo pipefail
. bench/device-env.sh
t0=$SECONDS
python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_process_gpu.py > "$out/h200-gpu-tests-pinned.log" 2>&1
grep -E "^E |passed|failed" "$out/h200-gpu-tests-pinned.log" | tail -8
snapfn make-model --preset 8b --dtype bf16 --device cuda --out "$work/llama8b" | tail -1
echo "[$((SECONDS - t0)) s] model made"
bench() { snapfn bench --model "$work/llama8b" --device cuda --workdir "$work/bench" "$@"; }
name=h200-llama8b-tier1-pinned
bench --modes cold_init,restore,init_process,restore_process --decode-batches 1,32 \
  --out "$out/$name-pagecache.json" 2>&1 | grep -A12 "^mode"
echo "[$((SECONDS - t0)) s] page cache done"
# NOTE: not the `snapfn` shell function: its background subshell would be what `kill` stops
# (run 4 left the keeper running that way, its last restore still pinned, and timed out)
python3 -m snapfn.handler.cli pin --snapshot "$work/bench/snapshot_process" 2> "$out/$name-keeper.log" > /dev/null &
keeper=$!
for _ in $(seq 300); do grep -q "serving on" "$out/$name-keeper.log" && break; sleep 0.2; done
tail -2 "$out/$name-keeper.log"
for i in 1 2 3; do
  bench --modes restore_process --decode-batches 1 --out "$out/$name-$i.json" 2>&1 | grep -A1 "^mode"
done
kill $keeper; wait $keeper
echo "[$((SECONDS - t0)) s] pinned done (keeper exit $?)"
bench --modes restore_process --decode-batches 1 --out "$out/$name-pagecache-2.json" 2>&1 | grep -A1 "^mode"
for f in "$out/$name"-*.json; do
  python3 - "$f" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))["modes"]["restore_process"]
helper = next((s["figures"].get("restorer", {}) for s in m["startup"]["stages"] if s["name"] == "worker.adopt"), {})
print(sys.argv[1].rsplit("/", 1)[-1], "ready", m.get("ready_s"), "first", m.get("first_token_s"),
      "started", m.get("restore_started_s"), {k: helper.get(k) for k in ("context_s", "made_s", "filled_s", "pinned_bytes", "pinned_miss", "gbps")})
PY
done
