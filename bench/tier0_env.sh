#!/usr/bin/env bash
# Tier 0 over one snapshot with SNAPFN_* settings in turns: a cold init, then ROUNDS times each
# variant's `snapfn bench --modes MODES` (each mode a fresh process; restore_cold drops the page
# cache first), then the GPU tests of the restore path (tests/test_restore_overlap.py,
# tests/test_compiler_warm.py, tests/test_early_context.py, tests/test_streamer.py). The
# device is cuda where nvidia-smi sees a GPU, else cpu. Writes
# <date>-<machine>-tier0-env-<model>[-TAG]/, a JSON per run named by its variant and round.
#
# Usage: bash bench/tier0_env.sh [--model llama8b] [--modes restore,restore_zygote]
#          [--rounds 1] [--variant VAR=VALUE[,VAR=VALUE...]]... [--profile-warmup] [--base DIR]
#          [--tag TAG]
#   --model    a bench/device-env.sh model name or a directory
#   --variant  one setting of the runs, repeated for each (default: SNAPFN_RESTORE_OVERLAP=0,
#              then =1)
#   --profile-warmup  after the cold init, bench/probes/warmup_profile.py on its snapshot
#              (warmup-profile.json: where the restore's warmup and graph capture spend time)
#   --base     a source tree of another commit (e.g. `git archive COMMIT | tar -x -C DIR`):
#              each variant's run of each round runs again with that tree's code restoring the
#              same snapshot, named base-<run>-<round>, side by side on one machine
# The overlap: --modes restore,restore_zygote --rounds 2 (the default variants). Triton's
# start-up work done ahead: the same with --variant SNAPFN_WARM_COMPILER=off
#   --variant SNAPFN_WARM_COMPILER=on. A dropped page
# cache and the read-ahead: --modes restore_cold --variant SNAPFN_RESTORE_READ_AHEAD=0
#   --variant SNAPFN_RESTORE_READ_AHEAD=1 --variant SNAPFN_RESTORE_READ_AHEAD=1,SNAPFN_RESTORE_OVERLAP=1
# A fresh process's imports with the collector running or paused: --modes restore --rounds 5
#   --variant SNAPFN_STARTUP_GC=on --variant SNAPFN_STARTUP_GC=paused
# The stream beside the warmup, and the GIL: --modes restore_zygote --rounds 2
#   --variant SNAPFN_RESTORE_OVERLAP=0 --variant SNAPFN_RESTORE_OVERLAP=1
#   --variant SNAPFN_RESTORE_SWITCH_INTERVAL_US=200
set -uo pipefail
. bench/device-env.sh
name=llama8b modes=restore,restore_zygote rounds=1 tag= profile= base=
variants=()
argv=("$@")
while [ $# -gt 0 ]; do
  case $1 in
    --profile-warmup) profile=1; shift; continue ;;
    --model) name=$2 ;;
    --modes) modes=$2 ;;
    --rounds) rounds=$2 ;;
    --variant) variants+=("$2") ;;
    --base) base=$(cd "$2" && pwd) ;;
    --tag) tag=-$2 ;;
    *) echo "unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
  shift 2
done
[ ${#variants[@]} -gt 0 ] || variants=(SNAPFN_RESTORE_OVERLAP=0 SNAPFN_RESTORE_OVERLAP=1)
what=$name
[ -d "$name" ] && what=$(basename "$name")
results_dir "tier0-env-${what//[:\/]/-}$tag" bash "$0" "${argv[@]}"
device=cuda
[ "$(machine_tag)" = cpu ] && device=cpu
t0=$SECONDS
dir=$(model "$name") || exit 1
echo "[$((SECONDS - t0)) s] model ready"
bench=$work/tier0-env-bench
rm -rf "$bench"
bench_modes init 300 --model "$dir" --device "$device" --workdir "$bench" --modes cold_init \
  --decode-batches 1 --decode-tokens 8
echo "[$((SECONDS - t0)) s] cold init done"
if [ -n "$profile" ]; then
  timeout 200 python3 bench/probes/warmup_profile.py "$bench/snapshot" --model "$dir" \
    --device "$device" --cache-dir "$bench/cache" > "$res/warmup-profile.json" 2> "$res/warmup-profile.err"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['stages'], 'again', d['warmup_again_s'], 'triton', {k: d[k]['slow_s'] for k in ('triton_first_process', 'triton_again')})" \
    "$res/warmup-profile.json" || tail -5 "$res/warmup-profile.err"
  echo "[$((SECONDS - t0)) s] warmup profiled"
fi
for round in $(seq "$rounds"); do
  for variant in "${variants[@]}"; do
    # the run's name: each setting's name after SNAPFN_, lower case, and its value
    run=$(echo "$variant" | sed 's/SNAPFN_//g; s/=//g; s/,/-/g' | tr '[:upper:]_' '[:lower:]-')
    for tree in "" ${base:+base-}; do
      (IFS=,; for setting in $variant; do export "${setting?}"; done
       # the other commit's code first on the path (its own link farm beside ours)
       [ -n "$tree" ] && eval "$(SNAPFN_DEV_PATH=/tmp/snapfn-base bash "$base/infra/dev-pythonpath.sh")"
       bench_modes "$tree$run-$round" 200 --model "$dir" --device "$device" --workdir "$bench" \
         --modes "$modes" --decode-batches 1 --decode-tokens 8)
      echo "[$((SECONDS - t0)) s] ${tree:+the base tree, }$variant, round $round done"
    done
  done
done
python3 bench/startup_summary.py "$res"/*-[0-9]*.json
gpu_tests restore_overlap 120 tests/test_restore_overlap.py ""
gpu_tests compiler_warm 120 tests/test_compiler_warm.py ""
gpu_tests early_context 60 tests/test_early_context.py ""
gpu_tests streamer 120 tests/test_streamer.py ""
tests_summary
echo "[$((SECONDS - t0)) s] done"
