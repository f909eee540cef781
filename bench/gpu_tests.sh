#!/usr/bin/env bash
# GPU tests of named test files, one after another (they share the GPU), each into
# gpu-tests-<name>.log, then their passed counts and failures. Writes
# <date>-<machine>-gpu-tests[-TAG]/.
#
# Usage: bash bench/gpu_tests.sh [--tag TAG] [--timeout 420] FILE[:K] ...
#   FILE  a file under tests/ (test_gpu.py); K: pytest -k K
set -uo pipefail
. bench/device-env.sh
tag= seconds=420
argv=("$@")
while [ $# -gt 0 ]; do
  case $1 in
    --tag) tag=-$2; shift 2 ;;
    --timeout) seconds=$2; shift 2 ;;
    -*) echo "unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
    *) break ;;
  esac
done
[ $# -gt 0 ] || { echo "name at least one test file (see the header of $0)" >&2; exit 2; }
results_dir "gpu-tests$tag" bash "$0" "${argv[@]}"
for pair in "$@"; do
  file=${pair%%:*} key=
  [ "$file" = "$pair" ] || key=${pair#*:}
  name=${file#test_} name=${name%.py}${key:+-${key// /_}}
  gpu_tests "$name" "$seconds" "tests/$file" "$key"
done
tests_summary
