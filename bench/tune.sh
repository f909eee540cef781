#!/usr/bin/env bash
# The tuned kernel table for this GPU: `snapfn tune` (every autotuned Triton kernel's configs
# timed, SNAPFN_KERNEL_TUNING=init, an empty Triton cache) for each model, merged into one table,
# `<gpu>.json` in the results folder. Ship it as handler/llm/kernels/triton/tuned/<gpu>.json.
# Then the tuning GPU tests (tests/test_triton_kernels.py: tuned results cached and reused, the
# default times nothing). Writes <date>-<machine>-tune[-TAG]/.
#
# Usage: bash bench/tune.sh [--models embedded,llama8b,glm5] [--backend triton] [--tag TAG]
#   --models   bench/device-env.sh model names, tuned in turn (default embedded,llama8b,glm5)
#   --backend  SNAPFN_BACKEND for the inits (default triton: its kernels are a superset of the
#              Triton kernels the flashinfer backend runs)
set -uo pipefail
. bench/device-env.sh
models=embedded,llama8b,glm5 backend=triton tag=
argv=("$@")
while [ $# -gt 0 ]; do
  case $1 in
    --models) models=$2 ;;
    --backend) backend=$2 ;;
    --tag) tag=-$2 ;;
    *) echo "unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
  shift 2
done
results_dir "tune$tag" bash "$0" "${argv[@]}"
with_backend "$backend"
gpu=$(python3 -c "import re, torch; print(re.sub(r'[^a-z0-9]+', '-', torch.cuda.get_device_name().lower()).strip('-'))")
for name in ${models//,/ }; do
  dir=$(model "$name") || continue
  rm -rf "$work/tune-cache"
  start=$SECONDS
  timeout 400 python3 -m snapfn.handler.cli tune --model "$dir" --device cuda \
    --cache-dir "$work/tune-cache" --out "$res/$gpu.json" > "$res/tune-$name.log" 2>&1
  echo "tune $name: $((SECONDS - start)) s, exit $?"; tail -2 "$res/tune-$name.log"
  [ "$name" = embedded ] || rm -rf "$dir"  # 64 GB of disk: one model at a time
done
gpu_tests tuning 300 tests/test_triton_kernels.py "autotune or tuning or times_nothing"
tests_summary
