#!/usr/bin/env bash
# Device run on one H200 (session 6, run 1): where a batch-1 decode step of the 8B llama (bf16)
# goes, before the fusion work: per-kernel device time (eager, torch.profiler) and, with the
# decode graph captured, the graph's replay alone against whole engine steps (the host's share).
# Usage (device tool): bash bench/h200_s6_run1.sh
set -uo pipefail
. bench/device-env.sh
t0=$SECONDS
snapfn make-model --preset 8b --dtype bf16 --device cuda --out "$work/llama8b" | tail -1
echo "[$((SECONDS - t0)) s] model made"
for spec in "torch 1" "triton 1" "triton 8"; do
  set -- $spec
  python3 bench/probes/decode_profile.py "$work/llama8b" --backend "$1" --batch "$2" --graphs \
    --steps 16 --top 30 | tee "$out/h200-s6run1-profile-$1-b$2.json"
  echo "[$((SECONDS - t0)) s] $1 batch $2 done"
done
