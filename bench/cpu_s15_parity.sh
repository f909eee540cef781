#!/usr/bin/env bash
# On CPU (session 15): how far bf16 rounding alone moves greedy tokens and logprobs, the torch
# reference in bf16 against itself in float32 (bench/probes/model_parity.py --ref-dtype float32),
# for a dense llama (`small`) and for GLM-5's routing at small widths (`glm-route`: 256 experts,
# top 8). The context for the GLM-5-shaped model's bf16 parity on the H200 (docs/benchmarks.md).
# Usage: bash bench/cpu_s15_parity.sh  (about a minute; writes bench/results/cpu-s15-parity-*.json)
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for preset in small glm-route; do
  dtype=$([ "$preset" = small ] && echo bf16 || echo fp8)
  snapfn make-model --preset $preset --dtype $dtype --seed 5 --out "$tmp/$preset" > /dev/null
  python3 bench/probes/model_parity.py "$tmp/$preset" --backend torch --graphs '' --device cpu \
    --dtype bfloat16 --ref-dtype float32 > "bench/results/cpu-s15-parity-$preset-bf16-vs-fp32.json" || true
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); d['failures']=len(d['failures']); print(d)" \
    "bench/results/cpu-s15-parity-$preset-bf16-vs-fp32.json"
done
