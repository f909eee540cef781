#!/usr/bin/env bash
# Device run on one H200 (session 11, run 5), on run 2-4's machine (its compile cache and the
# GLM-5-shaped model still there): that model's steady state at batch 1 and 8 with the defaults,
# then with the Triton router and indexer pick off (run 2's batch 8, 2.644 ms, was slower than
# session 10 run 3's 2.376 ms with both off).
# Usage (device tool; carry .whl, .ficache): [RUN=6] bash bench/h200_s11_run5.sh (RUN=6: run 6, a second sample)
set -uo pipefail
. bench/device-env.sh
results_tarball s11run${RUN:-5}
t0=$SECONDS
. bench/device-flashinfer.sh
[ -d "$work/glm5" ] || { echo "no model here: a fresh machine"; exit 1; }
for sw in auto off; do
  SNAPFN_MOE_ROUTER=$sw SNAPFN_INDEXER_SELECT=$sw SNAPFN_BACKEND=flashinfer timeout $((440 - SECONDS)) \
    python3 -m snapfn.handler.cli bench --model "$work/glm5" --device cuda --workdir "$work/steady-flashinfer" \
    --modes steady --decode-batches 1,8 --decode-tokens 16 --prefill-tokens 2048 \
    --out "$res/h200-glm5-reduced-fp8-steady-s11run${RUN:-5}-switches-$sw.json" > "$res/steady-$sw.log" 2>&1
  grep -A4 "^mode" "$res/steady-$sw.log" || tail -5 "$res/steady-$sw.log"
  echo "[$((SECONDS - t0)) s] switches $sw done"
done
