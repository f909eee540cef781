#!/usr/bin/env bash
# Whole-model parity of the fast path against the torch reference (bench/probes/model_parity.py:
# greedy tokens for 4 random prompts through the fast backend with decode graphs, scored against
# the reference's teacher-forced logits; a token within 0.05 nats of the reference's argmax counts
# as a near-tie). Two measurements:
# - plain: fast and reference in the model's own dtype, into parity-fast.json (exits 1 past a
#   tie or a logprob off by more than 0.1);
# - --envelope: both paths in the model's 16-bit dtype scored against the reference in float32,
#   the fast path (parity-fast-vs-fp32.json) and the reference's own (parity-torch-vs-fp32.json),
#   and bench/probes/parity_envelope.py's verdict (envelope.json): the fast path passes when it
#   strays from float32 no further than 1.25 times the reference's own 16-bit path does. On CPU
#   (--device cpu, which needs --envelope) there is no fast path: the reference's own run alone,
#   in bf16.
# Writes <date>-<machine>-parity-<model>[-TAG]/.
#
# Usage: bash bench/parity.sh MODEL [--envelope] [--device cuda|cpu] [--tag TAG] [-- ARGS...]
#   MODEL   llama8b, glm5 or another bench/device-env.sh model name (e.g. small:bf16,
#           glm-route:fp8), or a directory
#   ARGS    passed to model_parity.py, e.g. -- --dtype float32 --tie 0.001 --logprob-atol 0.001
# Carry .whl and .ficache for flashinfer (the fast backend).
set -uo pipefail
. bench/device-env.sh
name=${1:?usage: bash bench/parity.sh MODEL [options], see its header}
shift
envelope= device=cuda tag=
argv=("$name" "$@")
while [ $# -gt 0 ]; do
  case $1 in
    --envelope) envelope=1; shift; continue ;;
    --device) device=$2 ;;
    --tag) tag=-$2 ;;
    --) shift; break ;;
    *) echo "unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
  shift 2
done
[ "$device" = cpu ] && [ -z "$envelope" ] && { echo "--device cpu needs --envelope" >&2; exit 2; }
results_dir "parity-${name//[:\/]/-}${envelope:+-envelope}$tag" bash "$0" "${argv[@]}"
t0=$SECONDS
[ "$device" = cpu ] || with_backend flashinfer
dir=$(model "$name") || exit 1
echo "[$((SECONDS - t0)) s] model ready"
reference=(--backend torch --graphs '' --device "$device")
if [ -z "$envelope" ]; then
  parity fast 590 "$dir" --device "$device" "$@"
elif [ "$device" = cpu ]; then
  parity torch-vs-fp32 590 "$dir" "${reference[@]}" --dtype bfloat16 --ref-dtype float32 "$@"
else
  parity fast-vs-fp32 300 "$dir" --device "$device" --ref-dtype float32 "$@"
  parity torch-vs-fp32 280 "$dir" "${reference[@]}" --ref-dtype float32 "$@"
  envelope fast-vs-fp32 torch-vs-fp32
fi
echo "[$((SECONDS - t0)) s] done"
