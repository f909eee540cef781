#!/usr/bin/env bash
# Steady state on one GPU beside the rooflines measured in the same process (`snapfn bench
# --modes steady`): decode ms per step at each batch (a 2n-token generation less an n-token one,
# over n steps, each row its own prompt) against the bytes a step reads over the measured HBM
# rate, and the prefill rate of one prompt against the matmul rate. One bench process per
# variant, one after the other on this machine, all in one workdir (one compile cache, one
# flashinfer JIT cache). Writes <date>-<machine>-steady-<model>[-TAG]/: steady-VARIANT.{json,log}
# and, with --profile, profile-b<BATCH>.json (bench/probes/decode_profile.py: the step's kernels).
#
# Usage: bash bench/steady.sh MODEL [--backend flashinfer] [--batches LIST] [--tokens 128]
#          [--prefill 2048] [--variant NAME[:VAR=VALUE,...]]... [--profile BATCH] [--tag TAG]
#   MODEL       llama8b, glm5 or another bench/device-env.sh model name, or a directory
#   --batches   decode batches (default 1,8,32,64 for llama8b, else 1,8)
#   --tokens    n, decode steps timed (default 128: over 32 the same code's batch-1 figure moved
#               +-5% from one process to the next, 2026-12-01-h200-glm5-steady-absorb-v2)
#   --variant   a bench run under NAME with the switches VAR=VALUE set, e.g.
#               --variant default --variant mla-off:SNAPFN_MLA_DECODE=off (default: one run,
#               "default"); the switches are listed in docs/kernels.md
#   --profile   the batch-BATCH step profiled with decode graphs, under the first variant's
#               switches
# Carry .whl and .ficache for flashinfer.
set -uo pipefail
. bench/device-env.sh
name=${1:?usage: bash bench/steady.sh MODEL [options], see its header}
shift
backend=flashinfer batches= tokens=128 prefill=2048 profile= tag=
variants=()
argv=("$name" "$@")
while [ $# -gt 0 ]; do
  case $1 in
    --backend) backend=$2 ;;
    --batches) batches=$2 ;;
    --tokens) tokens=$2 ;;
    --prefill) prefill=$2 ;;
    --variant) variants+=("$2") ;;
    --profile) profile=$2 ;;
    --tag) tag=-$2 ;;
    *) echo "unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
  shift 2
done
[ ${#variants[@]} -gt 0 ] || variants=(default)
[ -n "$batches" ] || batches=$([ "$name" = llama8b ] && echo 1,8,32,64 || echo 1,8)
results_dir "steady-${name//[:\/]/-}$tag" bash "$0" "${argv[@]}"
t0=$SECONDS
with_backend "$backend"
dir=$(model "$name") || exit 1
echo "[$((SECONDS - t0)) s] model ready"
switches() { local spec=$1; [ "$spec" = "${spec#*:}" ] && return; tr ',' ' ' <<< "${spec#*:}"; }
for spec in "${variants[@]}"; do
  v=${spec%%:*}
  # shellcheck disable=SC2046  # each switch one word
  env $(switches "$spec") timeout 590 python3 -m snapfn.handler.cli bench --model "$dir" \
    --device cuda --workdir "$work/steady-$backend" --modes steady --decode-batches "$batches" \
    --decode-tokens "$tokens" --prefill-tokens "$prefill" \
    --out "$res/steady-$v.json" > "$res/steady-$v.log" 2>&1
  echo "$v: $(grep -o 'decode ms/step.*' "$res/steady-$v.log" || tail -2 "$res/steady-$v.log")"
  echo "[$((SECONDS - t0)) s] $v done"
done
if [ -n "$profile" ]; then
  # shellcheck disable=SC2046
  env $(switches "${variants[0]}") timeout 590 python3 bench/probes/decode_profile.py "$dir" \
    --backend "$backend" --batch "$profile" --graphs --top 40 \
    > "$res/profile-b$profile.json" 2> "$res/profile-b$profile.err"
  profile_summary "profile-b$profile" 25
fi
[ "$backend" = flashinfer ] && save_jit_cache
echo "[$((SECONDS - t0)) s] done"
