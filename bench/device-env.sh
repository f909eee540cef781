# Sourced by the recipes in bench/ (run from the repository root): the source tree importable as
# snapfn (the GPU machine has no package registry), criu as carried in .criu, unbuffered output,
# $work (set it first to change it) for models, snapshots and caches, `snapfn` as a command, and
# the helpers below. Every recipe writes one results folder through `results_dir`.
eval "$(bash infra/dev-pythonpath.sh)"
export PYTHONUNBUFFERED=1 SNAPFN_CRIU_PREFIX=${SNAPFN_CRIU_PREFIX:-$PWD/.criu}
# the front doors' wheels, where carried (.servewhl, from bench/serve_wheels.sh)
if ls .servewhl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site-serve .servewhl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site-serve
fi
work=${work:-/tmp/snapfn-bench}
mkdir -p "$work"
snapfn() { python3 -m snapfn.handler.cli "$@"; }

# machine_tag: h200 for one NVIDIA H200, h200x2 for two, cpu where nvidia-smi sees no GPU
machine_tag() {
  local names count name
  names=$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null) || names=
  if [ -z "$names" ]; then echo cpu; return; fi
  count=$(printf '%s\n' "$names" | wc -l)
  name=$(printf '%s\n' "$names" | head -1 | sed 's/^NVIDIA //; s/ .*//' | tr '[:upper:]' '[:lower:]')
  if [ "$count" -gt 1 ]; then echo "${name}x$count"; else echo "$name"; fi
}

# results_dir WHAT COMMAND...: this run's results folder, $res, named <date>-<machine>-<what>,
# holding `command` (COMMAND as given, after the SNAPFN_* variables set), `commit`
# ($SNAPFN_COMMIT where set, else git rev-parse HEAD; pass it to the device tool's copy of the
# tree, whose .git is not this checkout's) and `machine`. Under bench/results ($RESULTS to change it); where $OUT is set (the device tool, which
# brings back only a few files) under /tmp/results, packed into $OUT/<folder>.tgz however the
# recipe ends: unpack it with `tar -xzf <folder>.tgz -C bench/results`.
results_dir() {
  local what=$1 name root
  shift
  name="$(date -u +%F)-$(machine_tag)-$what"
  if [ -n "${OUT:-}" ]; then
    root=/tmp/results
    trap "tar -czf '$OUT/$name.tgz' -C '$root' '$name'" EXIT
  else
    root=${RESULTS:-bench/results}
  fi
  res=$root/$name
  rm -rf "$res"
  mkdir -p "$res"
  { env | grep '^SNAPFN_' | grep -v '^SNAPFN_CRIU_PREFIX=' | sort | tr '\n' ' '; quote_words "$@"; } \
    > "$res/command"
  record_commit > "$res/commit"
  record_machine > "$res/machine"
  echo "results: $res"
}

# quote_words WORD...: the words as one shell command line, quoting only those that need it
quote_words() {
  local word line=
  for word in "$@"; do
    if [[ $word =~ ^[A-Za-z0-9_./,:=@%+-]+$ ]]; then line+="$word "; else line+="'${word//\'/\'\\\'\'}' "; fi
  done
  echo "${line% }"
}

record_commit() {
  local head dirty
  if [ -n "${SNAPFN_COMMIT:-}" ]; then
    echo "$SNAPFN_COMMIT (passed in as SNAPFN_COMMIT)"
  elif head=$(git rev-parse HEAD 2> /dev/null); then
    dirty=$(git status --porcelain --untracked-files=no 2> /dev/null | wc -l)
    if [ "$dirty" -gt 0 ]; then echo "$head (with $dirty changed files)"; else echo "$head"; fi
  else
    echo "unknown: no .git here and SNAPFN_COMMIT not set"
  fi
}

record_machine() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2> /dev/null
  echo "$(nproc) CPUs, $(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo) memory"
  python3 -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__)" 2> /dev/null
}

# model NAME: the directory of a benchmark model, written by `snapfn make-model` into $work the
# first time (its log in $res). NAME: llama8b (Llama-3-8B shapes, bf16), glm5 (GLM-5's per-layer
# shapes, FP8, $glm5_layers layers, 2 by default: 1 dense + 1 MoE, + the MTP layer; with
# $glm5_experts set, that many of its 256 routed experts a MoE layer, top 8 kept), embedded
# (the package's own model), PRESET[:DTYPE] (any make-model preset, seed 5), or a directory.
model() {
  local name=$1 dir device
  device=cuda
  [ "$(machine_tag)" = cpu ] && device=cpu
  case $name in
    embedded) python3 -c "from snapfn.handler.llm.embedded import embedded_model_dir as d; print(d())"; return ;;
    llama8b) dir=$work/llama8b; set -- --preset 8b --dtype bf16 ;;
    glm5)
      dir=$work/glm5-l${glm5_layers:-2}${glm5_experts:+-e$glm5_experts}
      set -- --preset glm5-reduced --num-layers "${glm5_layers:-2}" --dtype fp8 \
        ${glm5_experts:+--experts "$glm5_experts"} ;;
    */*) echo "$name"; return ;;
    *:*) dir=$work/${name/:/-}; set -- --preset "${name%%:*}" --dtype "${name#*:}" --seed 5 ;;
    *) dir=$work/$name; set -- --preset "$name" --seed 5 ;;
  esac
  if [ ! -f "$dir/config.json" ]; then
    snapfn make-model "$@" --device "$device" --out "$dir" > "$res/make-model-${name/:/-}.log" 2>&1 \
      || { echo "make-model $name failed: $(tail -1 "$res/make-model-${name/:/-}.log")" >&2; return 1; }
  fi
  echo "$dir"
}

# with_backend BACKEND: SNAPFN_BACKEND set (auto: left to the registry), and for flashinfer the
# carried wheels and JIT cache (device-flashinfer.sh) under $work/steady-flashinfer
with_backend() {
  [ "$1" = auto ] || export SNAPFN_BACKEND=$1
  if [ "$1" = flashinfer ] || { [ "$1" = auto ] && [ -d .whl ]; }; then . bench/device-flashinfer.sh; fi
}

# bench_modes NAME SECONDS ARGS...: `snapfn bench ARGS` into $res/NAME.{json,log}, SECONDS at most;
# prints its table
bench_modes() {
  local name=$1 seconds=$2
  shift 2
  timeout "$seconds" python3 -m snapfn.handler.cli bench "$@" --out "$res/$name.json" > "$res/$name.log" 2>&1
  grep -A12 '^mode' "$res/$name.log" || tail -4 "$res/$name.log"
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
    [ -f "$log" ] || continue
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
  local name=$1 seconds=$2 model=$3
  shift 3
  TRITON_CACHE_DIR=$work/tc-parity timeout "$seconds" python3 bench/probes/model_parity.py \
    "$model" "$@" > "$res/parity-$name.json" 2> "$res/parity-$name.err"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); d['failures']=len(d['failures']); print(sys.argv[2], d)" \
    "$res/parity-$name.json" "$name" || tail -3 "$res/parity-$name.err"
}

# envelope FAST REF: bench/probes/parity_envelope.py on two `parity` runs made with --ref-dtype
# float32 (FAST: the fast backend; REF: --backend torch --graphs ''), into $res/envelope.json
envelope() {
  python3 bench/probes/parity_envelope.py "$res/parity-$1.json" "$res/parity-$2.json" | tee "$res/envelope.json"
}
