#!/usr/bin/env bash
# Tier 0 with the KV pool and warmup overlapping the weights' stream (SNAPFN_RESTORE_OVERLAP=1)
# against the restore in turn, over one snapshot: a cold init, then `snapfn bench --modes
# restore,restore_zygote` with the overlap off and on, in turns, ROUNDS times (each mode a
# fresh process; the page cache warm for all of them after the first). Then the GPU tests of
# the path (tests/test_restore_overlap.py). Prints each run's first token and stage seconds.
# Writes <date>-<machine>-restore-overlap-<model>[-TAG]/.
#
# Usage: bash bench/restore_overlap.sh [--model llama8b] [--rounds 2] [--tag TAG]
set -uo pipefail
. bench/device-env.sh
name=llama8b rounds=2 tag=
argv=("$@")
while [ $# -gt 0 ]; do
  case $1 in
    --model) name=$2 ;;
    --rounds) rounds=$2 ;;
    --tag) tag=-$2 ;;
    *) echo "unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
  shift 2
done
results_dir "restore-overlap-${name//[:\/]/-}$tag" bash "$0" "${argv[@]}"
t0=$SECONDS
dir=$(model "$name") || exit 1
echo "[$((SECONDS - t0)) s] model ready"
bench=$work/overlap-bench
rm -rf "$bench"
bench_modes init 300 --model "$dir" --device cuda --workdir "$bench" --modes cold_init \
  --decode-batches 1 --decode-tokens 16
echo "[$((SECONDS - t0)) s] cold init done"
for round in $(seq "$rounds"); do
  for overlap in 0 1; do
    SNAPFN_RESTORE_OVERLAP=$overlap bench_modes "restore-overlap$overlap-$round" 200 \
      --model "$dir" --device cuda --workdir "$bench" --modes restore,restore_zygote \
      --decode-batches 1 --decode-tokens 16
  done
done
echo "[$((SECONDS - t0)) s] restores done"
gpu_tests restore_overlap 120 tests/test_restore_overlap.py ""
tests_summary
python3 bench/startup_summary.py "$res"/*.json
echo "[$((SECONDS - t0)) s] done"
