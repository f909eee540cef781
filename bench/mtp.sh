#!/usr/bin/env bash
# MTP speculative decoding on one GPU, in one run:
# - the GPU tests of its paths (tests/test_speculative.py: greedy equality eager and from the
#   verify and draft graphs), of the kernels a verify step runs (tests/test_triton_kernels.py's
#   MoE and GEMV cases) and, with the restore, of structured output's first
#   request after one (tests/test_gpu_structured.py; carry .servewhl for llguidance);
# - with --probe-rows, beside the tests, the verify's routed experts at 1 and those token
#   counts: `moe_gemv` against `fused_moe`, GLM-5's FP8 experts, top 8 of 32 and of 256
#   (bench/probes/gemv_probe.py --moe); and its FP8 projections in the tile kernel at each K
#   split (--fp8-splits 1,auto,2,4,8);
# - on the GLM-5-shaped model (bench/device-env.sh's glm5, FP8, --layers deep, --experts
#   routed experts a MoE layer), `snapfn bench --modes mtp`: greedy decode with 0..3 drafts a
#   step and with drafts of known acceptance, each engine from its CUDA graphs
#   (handler/llm/bench/mtp.py); once per --variant (VAR=VALUE[,VAR=VALUE...]: its settings,
#   into mtp-<variant>.json), else once (mtp.json);
# - with SNAPFN_SPECULATIVE_TOKENS=3, a cold init and a tier-0 restore of it, whose startup
#   manifests count the verify and draft graphs (stage capture_graphs) and the files compiled
#   (--no-restore: not; its snapshot takes as much disk as the model).
# Writes <date>-<machine>-mtp[-TAG]/.
#
# Usage: bash bench/mtp.sh [--layers 2] [--experts 256] [--graph-max-batch 4] [--no-tests]
#                          [--probe-rows 2,4] [--no-bench] [--variant VAR=VALUE]...
#                          [--no-restore] [--tag TAG]
#   --graph-max-batch  SNAPFN_GRAPH_MAX_BATCH for the init and restore (their decode buckets)
#   --no-bench         the tests and probes only (no model, no bench, no restore)
# $mtp_timeout: seconds each bench may take (420)
# The verify's experts as GEMVs against the sorted-pairs kernels, and its FP8 projections' K
#   splits: --layers 16 --experts 32 --no-restore --probe-rows 2,4
#   --variant SNAPFN_MOE_GEMV_ROWS=off --variant SNAPFN_MOE_GEMV_ROWS=auto
#   --variant SNAPFN_FP8_LINEAR_SPLIT=auto
set -uo pipefail
. bench/device-env.sh
tests=1 restore=1 run_bench=1 tag= graph_max_batch=4 probe_rows=
variants=()
argv=("$@")
while [ $# -gt 0 ]; do
  case $1 in
    --no-tests) tests=; shift; continue ;;
    --no-restore) restore=; shift; continue ;;
    --no-bench) run_bench= restore=; shift; continue ;;
    --layers) glm5_layers=$2 ;;
    --experts) glm5_experts=$2 ;;
    --graph-max-batch) graph_max_batch=$2 ;;
    --probe-rows) probe_rows=$2 ;;
    --variant) variants+=("$2") ;;
    --tag) tag=-$2 ;;
    *) echo "unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
  shift 2
done
results_dir "mtp$tag" bash "$0" "${argv[@]}"
t0=$SECONDS
if [ -n "$tests" ]; then
  gpu_tests speculative 200 tests/test_speculative.py "" &
  pids=($!)
  gpu_tests triton 200 tests/test_triton_kernels.py \
    "moe-gemv or backend_gemv or fp8_gemm or linear_fp8 or autotune" &
  pids+=($!)
  if [ -n "$restore" ]; then
    gpu_tests gpu_structured 200 tests/test_gpu_structured.py "" &
    pids+=($!)
  fi
fi
if [ -n "$probe_rows" ]; then  # beside the tests: each figure the best of 5 graph replays
  (cd bench/probes && TRITON_CACHE_DIR=$work/tc-probe timeout 90 python3 gemv_probe.py \
    --rows "1,$probe_rows" --moe 32,256) > "$res/moe-probe-rows.jsonl" 2> "$res/moe-probe-rows.err"
  cat "$res/moe-probe-rows.jsonl" || tail -5 "$res/moe-probe-rows.err"
  (cd bench/probes && TRITON_CACHE_DIR=$work/tc-probe timeout 120 python3 gemv_probe.py \
    --rows "1,$probe_rows" --fp8-splits 1,auto,2,4,8 \
    --only glm5.fp8.qkv_a,glm5.fp8.q_b_wq_b,glm5.fp8.o,glm5.fp8.down,glm5.fp8.shared_gate_up,glm5.fp8.shared_down) \
    > "$res/fp8-splits-probe.jsonl" 2> "$res/fp8-splits-probe.err"
  python3 -c "import json,sys; [print(r['shape'], r['rows'], r['fp8_auto_splits'], r['unfused_by_fp8_splits']) for r in map(json.loads, open(sys.argv[1]))]" \
    "$res/fp8-splits-probe.jsonl" || tail -5 "$res/fp8-splits-probe.err"
  echo "[$((SECONDS - t0)) s] probes done"
fi
if [ -n "$run_bench" ]; then
  dir=$(model glm5) || exit 1
  echo "[$((SECONDS - t0)) s] model ready: $dir"
fi
if [ -n "$tests" ]; then
  wait "${pids[@]}"
  tests_summary
  echo "[$((SECONDS - t0)) s] tests done"
fi
[ -n "$run_bench" ] || { echo "[$((SECONDS - t0)) s] done"; exit 0; }
work_bench=$work/mtp-bench
export SNAPFN_GRAPH_MAX_BATCH=$graph_max_batch
[ ${#variants[@]} -gt 0 ] || variants=("")
for variant in "${variants[@]}"; do
  # the run's name: each setting's name after SNAPFN_, lower case, and its value
  run=mtp${variant:+-$(echo "$variant" | sed 's/SNAPFN_//g; s/=//g; s/,/-/g' | tr '[:upper:]_' '[:lower:]-')}
  rm -rf "$work_bench"
  (IFS=,; for setting in $variant; do export "${setting?}"; done
   bench_modes "$run" "${mtp_timeout:-420}" --model "$dir" --device cuda --workdir "$work_bench" --modes mtp \
     --decode-tokens 64)
  echo "[$((SECONDS - t0)) s] $run done"
done
rm -rf "$work_bench"
[ -n "$restore" ] || { echo "[$((SECONDS - t0)) s] done"; exit 0; }
SNAPFN_SPECULATIVE_TOKENS=3 bench_modes speculative 300 --model "$dir" --device cuda \
  --workdir "$work_bench" --modes cold_init,restore --decode-batches 1 --decode-tokens 16
python3 bench/startup_summary.py "$res"/speculative.json
echo "[$((SECONDS - t0)) s] done"
