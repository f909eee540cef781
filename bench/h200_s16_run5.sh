#!/usr/bin/env bash
# Device run on one H200 (session 16, run 5): run 1's GLM-5-shaped cold init and tier-0 restore
# (the bench's compile cache deleted in between) again, after the digest fix: run 1's restore
# took 12.2 s where session 11's took 6.99, with every stage about twice as long (validate 1.85
# s). Was that the machine? Fits the session's last minutes of device time.
# Usage (device tool; carry .whl, .ficache): bash bench/h200_s16_run5.sh
set -uo pipefail
. bench/device-env.sh
results_tarball s16run5
t0=$SECONDS
. bench/device-flashinfer.sh
make_glm5; echo "[$((SECONDS - t0)) s] model rc $?"
bench() { SNAPFN_BACKEND=flashinfer timeout "$1" python3 -m snapfn.handler.cli bench --model "$work/glm5" --device cuda "${@:2}"; }
bench 190 --workdir "$work/glm-bench" --modes cold_init --decode-batches 1 --decode-tokens 16 \
  --out "$res/h200-glm5-reduced-fp8-s16run5-init.json" > "$res/init.log" 2>&1
echo "[$((SECONDS - t0)) s] cold init done"
rm -rf "$work/glm-bench/cache"
bench 40 --workdir "$work/glm-bench" --modes restore --decode-batches 1 --decode-tokens 16 \
  --out "$res/h200-glm5-reduced-fp8-s16run5-restore.json" > "$res/restore.log" 2>&1
python3 bench/startup_summary.py "$res"/h200-glm5-reduced-fp8-s16run5-{init,restore}.json
echo "[$((SECONDS - t0)) s] done"
