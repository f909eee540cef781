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
# steady_glm5 NAME SECONDS [VAR=VALUE ...]: the GLM-5-shaped model's steady bench on flashinfer
# at batch 1 and 8 (the VAR=VALUE switches set), into $res/steady-NAME.{json,log}; prints its
# decode line. Every run shares one workdir, $work/steady-flashinfer, so that flashinfer's JIT
# cache (device-flashinfer.sh unpacks it there) is one path that each run reuses. Decode steps
# are timed over 128 tokens ($steady_tokens): session 15's runs at 32 scattered +-5% from one
# process to the next.
steady_glm5() {
  local name=$1 seconds=$2; shift 2
  env SNAPFN_BACKEND=flashinfer "$@" timeout "$seconds" python3 -m snapfn.handler.cli bench \
    --model "$work/glm5" --device cuda --workdir "$work/steady-flashinfer" --modes steady \
    --decode-batches 1,8 --decode-tokens "${steady_tokens:-128}" --prefill-tokens 2048 \
    --out "$res/steady-$name.json" > "$res/steady-$name.log" 2>&1
  echo "$name: $(grep -o 'decode ms/step.*' "$res/steady-$name.log" || tail -2 "$res/steady-$name.log")"
}
# gpu_tests NAME SECONDS FILE K: `pytest -m gpu` on FILE's cases matching K (verbose, its own
# Triton cache, SECONDS at most) into $res/gpu-tests-NAME.log; run several with & and wait
gpu_tests() {
  TRITON_CACHE_DIR=$work/tc-$1 timeout "$2" python3 -m pytest -v -m gpu -p no:cacheprovider "$3" \
    -k "$4" > "$res/gpu-tests-$1.log" 2>&1
}
# tests_summary: each $res/gpu-tests-*.log's passed count, its failures and pytest's last line
tests_summary() {
  for log in "$res"/gpu-tests-*.log; do
    echo "$log: $(grep -c PASSED "$log") passed"; grep -E "^E  |FAILED|ERROR|passed|failed" "$log" | tail -6
  done
}
# profile_summary NAME [TOP]: a decode_profile.py output, $res/NAME.json: its step figures and its
# TOP (30) kernels by time; else the tail of $res/NAME.err
profile_summary() {
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: v for k, v in d.items() if k != 'top'}); [print(' ', t['us'], t['calls_per_step'], t['kernel'][:90]) for t in d['top'][:int(sys.argv[2])]]" \
    "$res/$1.json" "${2:-30}" || tail -3 "$res/$1.err"
}
# parity NAME SECONDS MODEL [ARGS...]: bench/probes/model_parity.py on MODEL (ARGS passed on,
# e.g. --ref-dtype float32), into $res/parity-NAME.{json,err}, Triton's tuning cached in
# $work/tc-parity; prints its counts with the failures counted, not listed
parity() {
  local name=$1 seconds=$2 model=$3; shift 3
  TRITON_CACHE_DIR=$work/tc-parity timeout "$seconds" python3 bench/probes/model_parity.py \
    "$model" "$@" > "$res/parity-$name.json" 2> "$res/parity-$name.err"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); d['failures']=len(d['failures']); print(sys.argv[2], d)" \
    "$res/parity-$name.json" "$name" || tail -3 "$res/parity-$name.err"
}
# envelope FAST REF: bench/probes/parity_envelope.py on two `parity` runs made with --ref-dtype
# float32 (FAST: the fast backend; REF: --backend torch --graphs ''): its verdict line
envelope() {
  python3 bench/probes/parity_envelope.py "$res/parity-$1.json" "$res/parity-$2.json"
}
