#!/usr/bin/env bash
# GPU functions: the GPU tests of the paths they use (the releasable pool, memory images, the
# examples from both tiers), then `snapfn bench --function` on each example: a cold start, a
# tier-0 and a tier-1 restore, each in a fresh process, to the first answer, beside the device
# memory the process image leaves out and its host-to-device floor. The CUDA-graph example holds
# 4.3 GB of weights by default here (--width 8192 --layers 32), the size of the tier-1 target;
# its tier 1 runs twice, with no keeper and with `snapfn keeper --hold page-cache` (on CUDA).
# `--examples cuda_graph-checkpoint` benches it reading its weights from a safetensors file
# (written once here, in the page cache), as a deployed function loads them.
# Writes <date>-<machine>-function[-TAG]/: gpu-tests-*.log, bench-<example>.{json,log}.
#
# Usage: bash bench/function.sh [--examples cuda_graph,cuda_graph-checkpoint,image_classifier,
#          text_embedding] [--width 8192] [--layers 32] [--device cuda] [--no-tests]
#          [--no-bench] [--only-tests test_function_gpu.py:image_classifier,...] [--tag TAG]
#   --only-tests  FILE:K pairs (tests/FILE, pytest -k K; K may be empty) instead of all four
#   --concurrency N,N  also restore each image N times at once (snapfn bench --concurrency); on
#                 CUDA with SNAPFN_PROCESS_PID_NAMESPACE=mount exported (a pid and mount namespace
#                 per worker, so that copies do not need the same pid)
set -uo pipefail
. bench/device-env.sh
[ -d .criu ] || [ ! -d /opt/snapfn-criu ] || export SNAPFN_CRIU_PREFIX=/opt/snapfn-criu
examples=cuda_graph,cuda_graph-checkpoint,image_classifier,text_embedding width=8192 layers=32
device=cuda tests=1 benches=1 only= concurrency= tag=
argv=("$@")
while [ $# -gt 0 ]; do
  case $1 in
    --no-tests) tests=; shift; continue ;;
    --no-bench) benches=; shift; continue ;;
    --examples) examples=$2 ;;
    --only-tests) only=$2 ;;
    --concurrency) concurrency=$2 ;;
    --width) width=$2 ;;
    --layers) layers=$2 ;;
    --device) device=$2 ;;
    --tag) tag=-$2 ;;
    *) echo "unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
  shift 2
done
results_dir "function$tag" bash "$0" "${argv[@]}"
if [ -n "$tests" ]; then  # one after another: they share the GPU and the worker's pid
  pairs=${only:-test_checksum.py:,test_span.py:,test_function_gpu.py:,test_function_gpu_e2e.py:}
  for pair in ${pairs//,/ }; do
    file=${pair%%:*} name=${file#test_} key=${pair#*:}
    name=${name%.py}${key:+-${key// /_}}  # a log per pair, when one file is asked for twice
    gpu_tests "$name" 420 "tests/$file" "$key"
  done
  tests_summary
fi
[ -n "$benches" ] || exit 0
export GRAPH_MLP_WIDTH=$width GRAPH_MLP_LAYERS=$layers
for example in ${examples//,/ }; do
  module=${example%-checkpoint}
  if [ "$example" != "$module" ]; then
    weights=$work/graph-weights.safetensors
    [ -f "$weights" ] || python3 -m "examples.$module" --write-checkpoint "$weights" > /dev/null
    export GRAPH_MLP_CHECKPOINT=$weights
  fi
  bench_modes "bench-$example" 900 \
    --function "examples.$module:handler" --device "$device" --workdir "$work/function-$example" \
    ${concurrency:+--concurrency "$concurrency"}
  unset GRAPH_MLP_CHECKPOINT
done
