# Sourced by the device scripts in bench/: the source tree importable as snapfn (the GPU box has
# no package registry), criu as carried in .criu, unbuffered output, $out for the results,
# $work (set it first to change it) for the model and snapshots, and `snapfn` as a command.
eval "$(bash infra/dev-pythonpath.sh)"
export PYTHONUNBUFFERED=1 SNAPFN_CRIU_PREFIX=${SNAPFN_CRIU_PREFIX:-$PWD/.criu}
out=${OUT:-bench/results}
work=${work:-/tmp/snapfn-h200}
mkdir -p "$work" "$out"
snapfn() { python3 -m snapfn.handler.cli "$@"; }
# results_tarball NAME: this run's results go under $res (/tmp/NAME, emptied first) and, however
# the script ends, into one tarball $out/h200-NAME.tgz ($OUT brings back only a few files)
results_tarball() {
  res=/tmp/$1; rm -rf "$res"; mkdir -p "$res"
  trap "tar -czf '$out/h200-$1.tgz' -C '$res' ." EXIT
}
# make_glm5: the GLM-5-shaped benchmark model (FP8, 1 dense + 1 MoE layer) at $work/glm5, its
# log in $res
make_glm5() {
  snapfn make-model --preset glm5-reduced --num-layers 2 --dtype fp8 --device cuda \
    --out "$work/glm5" > "$res/make-model.log" 2>&1
}
