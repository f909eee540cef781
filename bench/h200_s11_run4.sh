#!/usr/bin/env bash
# Device run on one H200 (session 11, run 4): the 8B llama (bf16) steady state with this
# session's code (its last figures are session 9 run 4's; nothing this session changed is on its
# path but the shared seam), batch 1, 8, 32, 64 and prefill 2048, beside the rooflines.
# Usage (device tool; carry .whl, .ficache): bash bench/h200_s11_run4.sh
set -uo pipefail
. bench/device-env.sh
results_tarball s11run4
t0=$SECONDS
. bench/device-flashinfer.sh
snapfn make-model --preset 8b --dtype bf16 --device cuda --out "$work/llama8b" > "$res/make-model.log" 2>&1
echo "[$((SECONDS - t0)) s] model rc $?"
SNAPFN_BACKEND=flashinfer timeout $((560 - SECONDS)) python3 -m snapfn.handler.cli bench \
  --model "$work/llama8b" --device cuda --modes steady --decode-batches 1,8,32,64 --decode-tokens 32 \
  --prefill-tokens 2048 --workdir "$work/steady-flashinfer" \
  --out "$res/h200-llama8b-steady-s11run4.json" > "$res/steady.log" 2>&1
grep -A4 "^mode" "$res/steady.log" || tail -5 "$res/steady.log"
echo "[$((SECONDS - t0)) s] done"
