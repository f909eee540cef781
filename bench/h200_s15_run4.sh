#!/usr/bin/env bash
# Device run on one H200 (session 15, run 4). Runs 1-3 timed the GLM-5-shaped step over 32
# decode tokens, and the figures scattered more than the switches moved them (Triton MLA alone
# 0.897 ms at batch 1 but 0.822 with the absorb kernels too, which the probe puts 1 us a layer
# slower). Here, over 128 tokens:
# - making the GLM-5-shaped model and the 8B llama (bf16) at once, then the 8B's whole-model
#   parity (bench/probes/model_parity.py) and its steady bench at batch 1, 8, 32, 64;
# - the GLM steady bench: the default, then SNAPFN_MLA_DECODE=triton (the absorb kernels lose
#   to the bmms by about 1 us a layer in run 3's probe, so they stay off);
# - the GLM's whole-model parity with the default switches (run 3's with both switches on
#   found 9 of 128 positions past the 0.05-nat tie and logprobs up to 0.52 nats apart, the
#   prefill's first token among them, which no switch touches).
# Usage (device tool; carry .whl, .ficache): bash bench/h200_s15_run4.sh
set -uo pipefail
. bench/device-env.sh
results_tarball s15run4
t0=$SECONDS
. bench/device-flashinfer.sh
parity() {  # parity NAME MODEL SECONDS [VAR=VALUE ...]
  local name=$1 model=$2 seconds=$3; shift 3
  env TRITON_CACHE_DIR=$work/steady-flashinfer/cache/compile/triton "$@" timeout "$seconds" \
    python3 bench/probes/model_parity.py "$model" > "$res/parity-$name.json" 2> "$res/parity-$name.err"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); d['failures']=len(d['failures']); print('$name', d)" \
    "$res/parity-$name.json" || tail -3 "$res/parity-$name.err"
}
(make_glm5; echo "glm5 rc $?") &
# the 8B's parity compiles flashinfer's llama kernels and tunes the Triton ones into the steady
# bench's caches while the GLM model is written
(snapfn make-model --preset 8b --dtype bf16 --device cuda --out "$work/llama8b" \
  > "$res/make-model-8b.log" 2>&1; echo "[$((SECONDS - t0)) s] 8b rc $?"; parity llama8b "$work/llama8b" 300) &
wait
echo "[$((SECONDS - t0)) s] models and 8b parity done"
SNAPFN_BACKEND=flashinfer timeout 150 python3 -m snapfn.handler.cli bench \
  --model "$work/llama8b" --device cuda --modes steady --decode-batches 1,8,32,64 --decode-tokens 128 \
  --prefill-tokens 2048 --workdir "$work/steady-flashinfer" \
  --out "$res/steady-llama8b.json" > "$res/steady-llama8b.log" 2>&1
grep -o 'decode ms/step.*' "$res/steady-llama8b.log" || tail -5 "$res/steady-llama8b.log"
echo "[$((SECONDS - t0)) s] 8b steady done"
steady_glm5 default 140
steady_glm5 mla $((520 - SECONDS)) SNAPFN_MLA_DECODE=triton
echo "[$((SECONDS - t0)) s] glm steady done"
parity glm5-default "$work/glm5" $((590 - SECONDS))
echo "[$((SECONDS - t0)) s] done"
