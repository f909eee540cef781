#!/usr/bin/env bash
# Device run on two H200s, written in session 14 for whenever a two-GPU machine is lent: expert
# parallel at ep=2 over NCCL against ep=1 on one GPU, both exchanges (models/expert_exchange.py):
# "replicated" (all-reduce; passed in session 6 run 5) and "all_to_all" (data-parallel
# attention with dispatch/combine, written in session 14, never run on GPUs), plus whether the
# image's NCCL is new enough for upstream DeepEP V2 (>= 2.30.4) and which NVSHMEM it has (V1).
# Session 15 added: DeepEP V1 built here (bench/deepep_build.sh, intranode kernels, in the
# background while the NCCL tests run) and ep_dispatch="deepep" against "all_to_all" in bf16
# (test_deepep_on_two_gpus_generates_what_all_to_all_does), and the command line's path.
# Usage (device tool, kind nvidia-h200-x2; carry .deepepsrc): bash bench/h200x2_s15_ep.sh
set -uo pipefail
. bench/device-env.sh
results_tarball x2-s15ep
t0=$SECONDS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())"
python3 -m pip list 2>/dev/null | grep -i -E "nccl|nvshmem|deep" || true
(timeout 420 bash bench/deepep_build.sh /tmp/deepep > "$res/deepep-build.log" 2>&1; echo "deepep build rc $?") &
timeout 240 python3 -m pytest -v -m gpu -p no:cacheprovider -rs tests/test_expert_parallel.py \
  -k "not deepep" > "$res/gpu-tests-ep.log" 2>&1
wait
tail -3 "$res/deepep-build.log"
PYTHONPATH=$PYTHONPATH:/tmp/deepep timeout 120 python3 -m pytest -v -m gpu -p no:cacheprovider -rs \
  tests/test_expert_parallel.py -k deepep > "$res/gpu-tests-deepep.log" 2>&1
tests_summary
echo "[$((SECONDS - t0)) s] done"
# the command line's expert-parallel path (snapfn generate --ep-size 2, session 15) over NCCL,
# against one GPU holding every expert: the same tokens
snapfn make-model --preset glm-tiny --dtype bf16 --seed 11 --out "$work/glm-tiny" > /dev/null 2>&1
gen=(generate --model "$work/glm-tiny" --prompt-ids 5,17,3,9,12 --max-new-tokens 8 --ignore-eos --json --device cuda)
snapfn "${gen[@]}" 2> /dev/null | tail -1 > "$res/ep1.json"
for dispatch in replicated all_to_all; do
  timeout 120 python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m snapfn.handler.cli "${gen[@]}" --ep-size 2 \
    --ep-dispatch $dispatch 2> "$res/ep2-$dispatch.err" | grep '^{' > "$res/ep2-$dispatch.json"
  python3 -c "import json,sys; a,b=(json.load(open(f)) for f in sys.argv[1:]); print('$dispatch', 'same tokens' if a['token_ids']==b['token_ids'] else ('DIFFERENT', a['token_ids'], b['token_ids']))" \
    "$res/ep1.json" "$res/ep2-$dispatch.json" || tail -3 "$res/ep2-$dispatch.err"
done
echo "[$((SECONDS - t0)) s] cli done"
