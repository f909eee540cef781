#!/usr/bin/env bash
# MTP speculative decoding on one GPU, in one run:
# - the GPU tests of its paths (tests/test_speculative.py: greedy equality eager and from the
#   verify and draft graphs) and of structured output's first request after a restore
#   (tests/test_gpu_structured.py; carry .servewhl for llguidance), beside the model's make;
# - on the GLM-5-shaped model (bench/device-env.sh's glm5, FP8, --layers deep, --experts
#   routed experts a MoE layer), `snapfn bench --modes mtp`: greedy decode with 0..3 drafts a
#   step and with drafts of known acceptance, each engine from its CUDA graphs
#   (handler/llm/bench/mtp.py);
# - with SNAPFN_SPECULATIVE_TOKENS=3, a cold init and a tier-0 restore of it, whose startup
#   manifests count the verify and draft graphs (stage capture_graphs) and the files compiled
#   (--no-restore: not; its snapshot takes as much disk as the model).
# Writes <date>-<machine>-mtp[-TAG]/.
#
# Usage: bash bench/mtp.sh [--layers 2] [--experts 256] [--graph-max-batch 4] [--no-tests]
#                          [--no-restore] [--tag TAG]
#   --graph-max-batch  SNAPFN_GRAPH_MAX_BATCH for the init and restore (their decode buckets)
set -uo pipefail
. bench/device-env.sh
tests=1 restore=1 tag= graph_max_batch=4
argv=("$@")
while [ $# -gt 0 ]; do
  case $1 in
    --no-tests) tests=; shift; continue ;;
    --no-restore) restore=; shift; continue ;;
    --layers) glm5_layers=$2 ;;
    --experts) glm5_experts=$2 ;;
    --graph-max-batch) graph_max_batch=$2 ;;
    --tag) tag=-$2 ;;
    *) echo "unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
  shift 2
done
results_dir "mtp$tag" bash "$0" "${argv[@]}"
t0=$SECONDS
if [ -n "$tests" ]; then
  gpu_tests speculative 300 tests/test_speculative.py "" &
  speculative=$!
  gpu_tests gpu_structured 200 tests/test_gpu_structured.py "" &
  structured=$!
fi
dir=$(model glm5) || exit 1
echo "[$((SECONDS - t0)) s] model ready: $dir"
if [ -n "$tests" ]; then
  wait "$speculative" "$structured"
  tests_summary
  echo "[$((SECONDS - t0)) s] tests done"
fi
bench=$work/mtp-bench
rm -rf "$bench"
export SNAPFN_GRAPH_MAX_BATCH=$graph_max_batch
bench_modes mtp 420 --model "$dir" --device cuda --workdir "$bench" --modes mtp --decode-tokens 64
echo "[$((SECONDS - t0)) s] mtp done"
rm -rf "$bench"
[ -n "$restore" ] || { echo "[$((SECONDS - t0)) s] done"; exit 0; }
SNAPFN_SPECULATIVE_TOKENS=3 bench_modes speculative 300 --model "$dir" --device cuda \
  --workdir "$bench" --modes cold_init,restore --decode-batches 1 --decode-tokens 16
python3 bench/startup_summary.py "$res"/speculative.json
echo "[$((SECONDS - t0)) s] done"
