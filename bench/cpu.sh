#!/usr/bin/env bash
# The cold-start bench on CPU (the CI machine kind: no GPU), on the package's embedded model by
# default (5.5M parameters, 0.12 GB in float32): every tier side by side in one `snapfn bench
# --device cpu` call, each mode in a fresh process, and with --load-http the HTTP load run
# (bench/load_http.py: one `snapfn serve` on loopback, 200 concurrent streaming completions).
# The tier-1 modes need criu (.criu, or /opt/snapfn-criu where infra/install-criu.sh put it).
# Writes <date>-cpu-embedded[-TAG]/: bench.json, bench.log, bench.png, load-http.json.
#
# Usage: bash bench/cpu.sh [--modes LIST] [--model NAME|DIR] [--decode-batches 1,8]
#          [--load-http] [--tag TAG]
#   --modes   a subset of hf,safetensors,cold_init,restore,restore_zygote,restore_cold,
#             init_process,restore_process (default: all eight)
#   --model   a bench/device-env.sh model name or a directory (default: embedded)
set -uo pipefail
. bench/device-env.sh
[ -d .criu ] || [ ! -d /opt/snapfn-criu ] || export SNAPFN_CRIU_PREFIX=/opt/snapfn-criu
modes=hf,safetensors,cold_init,restore,restore_zygote,restore_cold,init_process,restore_process
name=embedded batches=1,8 load= tag=
argv=("$@")
while [ $# -gt 0 ]; do
  case $1 in
    --load-http) load=1; shift; continue ;;
    --modes) modes=$2 ;;
    --model) name=$2 ;;
    --decode-batches) batches=$2 ;;
    --tag) tag=-$2 ;;
    *) echo "unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
  shift 2
done
what=${name//[:\/]/-}
[ "${name#*/}" = "$name" ] || what=model
results_dir "$what$tag" bash "$0" "${argv[@]}"
dir=$(model "$name") || exit 1
rm -rf "$work/cpu-bench"
bench_modes bench 900 --model "$dir" --device cpu --workdir "$work/cpu-bench" --modes "$modes" \
  --decode-batches "$batches" --plot "$res/bench.png"
if [ -n "$load" ]; then
  timeout 300 python3 bench/load_http.py --model "$dir" > "$res/load-http.json" 2> "$res/load-http.err"
  cat "$res/load-http.json" || tail -3 "$res/load-http.err"
fi
