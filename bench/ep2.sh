#!/usr/bin/env bash
# Expert parallel across two GPUs of one host (models/expert_exchange.py), over NCCL, against one
# GPU holding every expert:
# - the GPU tests of tests/test_expert_parallel.py (two ranks generating what one rank does), for
#   the exchanges other than DeepEP, into gpu-tests-ep.log;
# - the command line's path, `snapfn generate --ep-size 2` under torchrun, for each --dispatch,
#   against `snapfn generate` on one GPU: the same greedy tokens (ep1.json, ep2-DISPATCH.json);
# - with --deepep: DeepEP V1 built here (bench/deepep_build.sh: intranode kernels, no NVSHMEM;
#   beside the tests) and ep_dispatch="deepep" tested against "all_to_all" in bf16.
# Also prints the NCCL and NVSHMEM the image has (DeepEP V2 needs NCCL >= 2.30.4). Writes
# <date>-<machine>-ep2[-TAG]/.
#
# Usage (a two-GPU machine: device kind nvidia-h200-x2): bash bench/ep2.sh
#          [--dispatch replicated,all_to_all] [--deepep] [--tag TAG]
#   --deepep   carry .deepepsrc (its layout: the header of bench/deepep_build.sh)
set -uo pipefail
. bench/device-env.sh
dispatches=replicated,all_to_all deepep= tag=
argv=("$@")
while [ $# -gt 0 ]; do
  case $1 in
    --deepep) deepep=1; shift; continue ;;
    --dispatch) dispatches=$2 ;;
    --tag) tag=-$2 ;;
    *) echo "unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
  shift 2
done
results_dir "ep2$tag" bash "$0" "${argv[@]}"
t0=$SECONDS
python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
python3 -m pip list 2> /dev/null | grep -i -E "nccl|nvshmem|deep" || true
if [ -n "$deepep" ]; then
  (timeout 420 bash bench/deepep_build.sh /tmp/deepep > "$res/deepep-build.log" 2>&1; echo "deepep build rc $?") &
fi
timeout 240 python3 -m pytest -v -m gpu -p no:cacheprovider -rs tests/test_expert_parallel.py \
  -k "not deepep" > "$res/gpu-tests-ep.log" 2>&1
wait
if [ -n "$deepep" ]; then
  tail -3 "$res/deepep-build.log"
  PYTHONPATH=$PYTHONPATH:/tmp/deepep timeout 120 python3 -m pytest -v -m gpu -p no:cacheprovider -rs \
    tests/test_expert_parallel.py -k deepep > "$res/gpu-tests-deepep.log" 2>&1
fi
tests_summary
echo "[$((SECONDS - t0)) s] tests done"
dir=$(model glm-tiny:bf16) || exit 1
gen=(generate --model "$dir" --prompt-ids 5,17,3,9,12 --max-new-tokens 8 --ignore-eos --json --device cuda)
snapfn "${gen[@]}" 2> "$res/ep1.err" | tail -1 > "$res/ep1.json"
for dispatch in ${dispatches//,/ }; do
  [ "$dispatch" = deepep ] && export PYTHONPATH=$PYTHONPATH:/tmp/deepep
  timeout 120 python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m snapfn.handler.cli \
    "${gen[@]}" --ep-size 2 --ep-dispatch "$dispatch" 2> "$res/ep2-$dispatch.err" | grep '^{' > "$res/ep2-$dispatch.json"
  python3 -c "import json,sys; a,b=(json.load(open(f)) for f in sys.argv[1:3]); print(sys.argv[3], 'same tokens' if a['token_ids']==b['token_ids'] else ('DIFFERENT', a['token_ids'], b['token_ids']))" \
    "$res/ep1.json" "$res/ep2-$dispatch.json" "$dispatch" || tail -3 "$res/ep2-$dispatch.err"
done
echo "[$((SECONDS - t0)) s] done"
