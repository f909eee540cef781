# Sourced by the device scripts in bench/: the source tree importable as snapfn (the GPU box has
# no package registry), criu as carried in .criu, unbuffered output, $out for the results,
# $work (set it first to change it) for the model and snapshots, and `snapfn` as a command.
eval "$(bash infra/dev-pythonpath.sh)"
export PYTHONUNBUFFERED=1 SNAPFN_CRIU_PREFIX=${SNAPFN_CRIU_PREFIX:-$PWD/.criu}
out=${OUT:-bench/results}
work=${work:-/tmp/snapfn-h200}
mkdir -p "$work" "$out"
snapfn() { python3 -m snapfn.handler.cli "$@"; }
