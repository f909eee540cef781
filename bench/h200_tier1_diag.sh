#!/usr/bin/env bash
# Device run on one H200: where the tier-1 restore time goes on an 8B llama (bf16). Builds the
# process snapshot twice (pinned ring kept in the image / dropped) and restores each with lazy and
# with eager criu pages, in fresh processes (snapfn bench --modes restore_process).
set -uo pipefail
. bench/device-env.sh
snapfn make-model --preset 8b --dtype bf16 --device cuda --out "$work/llama8b" | tail -1
for ring in 1 0; do
  rm -rf "$work/bench"
  SNAPFN_PROCESS_KEEP_RING=$ring snapfn init --tier process --model "$work/llama8b" --device cuda \
    --snapshot "$work/bench/snapshot_process" 2>&1 | grep -E "at checkpoint|released|process image|checkpoint  |init \(" 
  ls -l "$work/bench/snapshot_process/process" | sort -k5 -n | tail -4
  for lazy in on off; do
    SNAPFN_PROCESS_LAZY=$lazy snapfn bench --model "$work/llama8b" --device cuda --workdir "$work/bench" \
      --modes restore_process --decode-batches 1 --out "$out/h200-tier1-ring$ring-lazy$lazy.json" 2>&1 | grep -A1 "^mode"
  done
done
unshare --pid --fork --mount-proc python3 -c "import torch; torch.zeros(1, device='cuda'); print('cuda in pid+mount ns: ok')" 2>&1 | tail -1
