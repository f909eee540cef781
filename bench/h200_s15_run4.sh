#!/usr/bin/env bash
# Device run on one H200 (session 15, run 4). Runs 1-3 timed the GLM-5-shaped step over 32
# decode tokens, and the figures scattered more than the switches moved them (Triton MLA alone
# 0.897 ms at batch 1 but 0.822 with the absorb kernels too, which the probe puts 1 us a layer
# slower). Here, over 128 tokens:
# - making the GLM-5-shaped model and the 8B llama (bf16) at once;
# - the GLM steady bench: the default, SNAPFN_MLA_DECODE=triton, and both switches;
# - the GLM's whole-model parity with the default switches (run 3's with both switches on
#   found 9 of 128 positions past the 0.05-nat tie and logprobs up to 0.52 nats apart, the
#   prefill's first token among them, which no switch touches);
# - the 8B's steady bench (batch 1, 8, 32, 64; flashinfer compiles its llama kernels first)
#   and its whole-model parity.
# Usage (device tool; carry .whl, .ficache): bash bench/h200_s15_run4.sh
set -uo pipefail
. bench/device-env.sh
results_tarball s15run4
t0=$SECONDS
. bench/device-flashinfer.sh
(make_glm5; echo "glm5 rc $?") &
(snapfn make-model --preset 8b --dtype bf16 --device cuda --out "$work/llama8b" \
  > "$res/make-model-8b.log" 2>&1; echo "8b rc $?") &
wait
echo "[$((SECONDS - t0)) s] models done"
steady_glm5 default 60
steady_glm5 mla 60 SNAPFN_MLA_DECODE=triton
steady_glm5 both 60 SNAPFN_MLA_DECODE=triton SNAPFN_MLA_ABSORB=triton
echo "[$((SECONDS - t0)) s] glm steady done"
parity() {  # parity NAME MODEL SECONDS [VAR=VALUE ...]
  local name=$1 model=$2 seconds=$3; shift 3
  env TRITON_CACHE_DIR=$work/steady-flashinfer/cache/compile/triton "$@" timeout "$seconds" \
    python3 bench/probes/model_parity.py "$model" > "$res/parity-$name.json" 2> "$res/parity-$name.err"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); d['failures']=len(d['failures']); print('$name', d)" \
    "$res/parity-$name.json" || tail -3 "$res/parity-$name.err"
}
parity glm5-default "$work/glm5" 50
echo "[$((SECONDS - t0)) s] glm parity done"
SNAPFN_BACKEND=flashinfer timeout $((545 - SECONDS)) python3 -m snapfn.handler.cli bench \
  --model "$work/llama8b" --device cuda --modes steady --decode-batches 1,8,32,64 --decode-tokens 128 \
  --prefill-tokens 2048 --workdir "$work/steady-flashinfer" \
  --out "$res/steady-llama8b.json" > "$res/steady-llama8b.log" 2>&1
grep -o 'decode ms/step.*' "$res/steady-llama8b.log" || tail -5 "$res/steady-llama8b.log"
echo "[$((SECONDS - t0)) s] 8b steady done"
parity llama8b "$work/llama8b" $((590 - SECONDS))
echo "[$((SECONDS - t0)) s] done"
