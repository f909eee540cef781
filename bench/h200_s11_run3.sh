#!/usr/bin/env bash
# Device run on one H200 (session 11, run 3): the GLM-5-shaped model's cold init with this
# session's kernels (every kernel compiled and autotuned for its buckets and prefill sizes),
# then a tier-0 restore with the bench's compile cache deleted in between, which must compile
# nothing (the cache comes back from the snapshot); first, while the model is being made, the
# FP8 GEMV configs on its largest projections (bench/probes/gemv_probe.py; the model's making
# shares the GPU then, so those timings may be a little slow).
# All results go into one tarball ($OUT keeps few files).
# Usage (device tool; carry .whl, .ficache): bash bench/h200_s11_run3.sh
set -uo pipefail
. bench/device-env.sh
results_tarball s11run3
t0=$SECONDS
. bench/device-flashinfer.sh
(make_glm5; echo "[$((SECONDS - t0)) s] model rc $?") &
TRITON_CACHE_DIR=$work/tc-probe timeout 150 python3 bench/probes/gemv_probe.py \
  --only glm5.fp8.q_b,glm5.fp8.o,glm5.fp8.gate_up,glm5.fp8.down,glm5.fp8.shared_down \
  > "$res/gemv-probe-glm5-fp8.jsonl" 2> "$res/gemv-probe.err"
python3 bench/probes/gemv_probe.py --summarise "$res/gemv-probe-glm5-fp8.jsonl" || tail -3 "$res/gemv-probe.err"
wait
echo "[$((SECONDS - t0)) s] probe and model done"
bench() { SNAPFN_BACKEND=flashinfer timeout "$1" python3 -m snapfn.handler.cli bench --model "$work/glm5" --device cuda "${@:2}"; }
bench $((500 - SECONDS)) --workdir "$work/glm-bench" --modes cold_init --decode-batches 1 --decode-tokens 16 \
  --out "$res/h200-glm5-reduced-fp8-s11run3-init.json" > "$res/init.log" 2>&1
grep -A2 "^mode" "$res/init.log" || tail -4 "$res/init.log"
echo "[$((SECONDS - t0)) s] cold init done"
rm -rf "$work/glm-bench/cache"  # what the init compiled and tuned: gone, as on a new machine
bench $((590 - SECONDS)) --workdir "$work/glm-bench" --modes restore --decode-batches 1 --decode-tokens 16 \
  --out "$res/h200-glm5-reduced-fp8-s11run3-restore.json" > "$res/restore.log" 2>&1
grep -A2 "^mode" "$res/restore.log" || tail -4 "$res/restore.log"
python3 bench/startup_summary.py "$res"/h200-glm5-reduced-fp8-s11run3-{init,restore}.json
echo "[$((SECONDS - t0)) s] done"
