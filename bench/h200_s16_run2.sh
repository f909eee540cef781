#!/usr/bin/env bash
# Device run on one H200 (session 16, run 2): the 8B llama's restore paths with the kernels of
# sessions 7-15 (the Triton GEMVs and their autotuning, last restored in session 6). Cold init
# and a process snapshot; the bench's compile cache deleted, as on a new machine; tier 0 and
# tier 1 (through `snapfn keeper --hold page-cache`) restored twice, each checked against the
# cold init's first token and logprob, and each must compile nothing. The tier-1 GPU tests
# (run 2 ran them last: the embedded model's cold init on CUDA failed, a device-side assert from
# its memory profile's 2048-token prompt past its 256 RoPE positions). Run 3 (RUN=3) runs the
# same after that fix and the smaller digest buffers (validate had grown 0.23 -> 0.73 s).
# Usage (device tool; carry .criu, .whl, .ficache): [RUN=3] bash bench/h200_s16_run2.sh
set -uo pipefail
. bench/device-env.sh
run=s16run${RUN:-2}
results_tarball $run
t0=$SECONDS
. bench/device-flashinfer.sh
if [ "$run" != s16run2 ]; then
  gpu_tests process 120 tests/test_process_gpu.py ""
  tests_summary
fi
snapfn make-model --preset 8b --dtype bf16 --device cuda --out "$work/llama8b" > "$res/make-model.log" 2>&1
echo "[$((SECONDS - t0)) s] model rc $?"
bench() {
  SNAPFN_BACKEND=flashinfer timeout "$1" python3 -m snapfn.handler.cli bench --model "$work/llama8b" \
    --device cuda --workdir "$work/bench" --decode-batches 1 --decode-tokens 16 "${@:2}"
}
name=h200-llama8b-$run
bench 300 --modes cold_init,init_process --out "$res/$name-init.json" > "$res/init.log" 2>&1
grep -A3 "^mode" "$res/init.log" || tail -4 "$res/init.log"
echo "[$((SECONDS - t0)) s] snapshots made"
rm -rf "$work/bench/cache"  # what the inits compiled or tuned: gone, as on a new machine
python3 -m snapfn.handler.cli keeper --hold page-cache --snapshot "$work/bench/snapshot_process" \
  2> "$res/keeper.log" > /dev/null &
pid=$!
for _ in $(seq 300); do grep -q "serving on" "$res/keeper.log" && break; sleep 0.2; done
bench 120 --modes restore,restore_process --out "$res/$name-restore.json" > "$res/restore.log" 2>&1
grep -A6 "^mode" "$res/restore.log" || tail -4 "$res/restore.log"
bench 60 --modes restore_process --out "$res/$name-restore2.json" > "$res/restore2.log" 2>&1
grep -A2 "^mode" "$res/restore2.log" || tail -4 "$res/restore2.log"
kill $pid; wait $pid
echo "[$((SECONDS - t0)) s] restores done"
python3 bench/tier1_summary.py "$res/$name-restore.json"
python3 bench/startup_summary.py "$res/$name-init.json" "$res/$name-restore.json" "$res/$name-restore2.json"
if [ "$run" = s16run2 ]; then
  gpu_tests process $((560 - SECONDS)) tests/test_process_gpu.py ""
  tests_summary
fi
echo "[$((SECONDS - t0)) s] done"
