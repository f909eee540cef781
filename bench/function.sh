#!/usr/bin/env bash
# GPU functions: the GPU tests of the paths they use (the releasable pool, memory images, the
# examples from both tiers), then `snapfn bench --function` on each example: a cold start, a
# tier-0 and a tier-1 restore, each in a fresh process, to the first answer, beside the device
# memory the process image leaves out and its host-to-device floor. The CUDA-graph example holds
# 4.3 GB of weights by default here (--width 8192 --layers 32), the size of the tier-1 target.
# Writes <date>-<machine>-function[-TAG]/: gpu-tests-*.log, bench-<example>.{json,log}.
#
# Usage: bash bench/function.sh [--examples cuda_graph,image_classifier,text_embedding]
#          [--width 8192] [--layers 32] [--device cuda] [--no-tests] [--tag TAG]
set -uo pipefail
. bench/device-env.sh
[ -d .criu ] || [ ! -d /opt/snapfn-criu ] || export SNAPFN_CRIU_PREFIX=/opt/snapfn-criu
examples=cuda_graph,image_classifier,text_embedding width=8192 layers=32 device=cuda tests=1 tag=
argv=("$@")
while [ $# -gt 0 ]; do
  case $1 in
    --no-tests) tests=; shift; continue ;;
    --examples) examples=$2 ;;
    --width) width=$2 ;;
    --layers) layers=$2 ;;
    --device) device=$2 ;;
    --tag) tag=-$2 ;;
    *) echo "unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
  shift 2
done
results_dir "function$tag" bash "$0" "${argv[@]}"
if [ -n "$tests" ]; then
  gpu_tests function 420 tests/test_function_gpu.py test &
  wait
  tests_summary
fi
for example in ${examples//,/ }; do
  GRAPH_MLP_WIDTH=$width GRAPH_MLP_LAYERS=$layers bench_modes "bench-$example" 900 \
    --function "examples.$example:handler" --device "$device" --workdir "$work/function-$example"
done
