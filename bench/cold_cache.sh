#!/usr/bin/env bash
# Tier 0 with the page cache dropped, against the disk's floor, over one snapshot: the weights
# file read ahead from the restore's first line (SNAPFN_RESTORE_READ_AHEAD) off and on, then on
# with the KV pool and warmup overlapping the stream (SNAPFN_RESTORE_OVERLAP). Each
# `snapfn bench --modes restore_cold` drops the snapshot's pages and runs a fresh process.
# Then the GPU test of the restore path (tests/test_restore_overlap.py).
# Writes <date>-<machine>-cold-cache-<model>[-TAG]/.
#
# Usage: bash bench/cold_cache.sh [--model llama8b] [--rounds 1] [--tag TAG]
#   --model   a bench/device-env.sh model name or a directory; the device is cuda where
#             nvidia-smi sees a GPU, else cpu
#   --rounds  how many times the three variants run, in turns
set -uo pipefail
. bench/device-env.sh
name=llama8b tag= rounds=1
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
what=$name
[ -d "$name" ] && what=$(basename "$name")
results_dir "cold-cache-${what//[:\/]/-}$tag" bash "$0" "${argv[@]}"
device=cuda
[ "$(machine_tag)" = cpu ] && device=cpu
t0=$SECONDS
dir=$(model "$name") || exit 1
echo "[$((SECONDS - t0)) s] model ready"
bench=$work/cold-cache-bench
rm -rf "$bench"
bench_modes init 200 --model "$dir" --device "$device" --workdir "$bench" --modes cold_init \
  --decode-batches 1 --decode-tokens 8
echo "[$((SECONDS - t0)) s] cold init done"
for round in $(seq "$rounds"); do
  for variant in "0 0" "1 0" "1 1"; do
    read -r ahead overlap <<< "$variant"
    suffix=
    [ "$rounds" -gt 1 ] && suffix=-$round
    SNAPFN_RESTORE_READ_AHEAD=$ahead SNAPFN_RESTORE_OVERLAP=$overlap bench_modes \
      "read-ahead$ahead-overlap$overlap$suffix" 120 --model "$dir" --device "$device" \
      --workdir "$bench" --modes restore_cold --decode-batches 1 --decode-tokens 8
    echo "[$((SECONDS - t0)) s] read-ahead $ahead, overlap $overlap done"
  done
done
python3 bench/startup_summary.py "$res"/read-ahead*.json
gpu_tests restore_overlap 60 tests/test_restore_overlap.py ""
tests_summary
echo "[$((SECONDS - t0)) s] done"
