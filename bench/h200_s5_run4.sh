#!/usr/bin/env bash
# Device run on one H200 (session 5, run 4): the tier-1 GPU tests with flashinfer installed, so
# that "auto" picks it (run 3 ran out of its test time before they finished).
# Usage (device tool; carry .criu and .whl): bash bench/h200_s5_run4.sh
set -uo pipefail
. bench/device-env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PYTHONPATH:/tmp/site
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/test_process_gpu.py > "$out/h200-gpu-tests-s5run4.log" 2>&1
grep -E "^E  |^FAILED|^ERROR|passed|failed|SKIPPED" "$out/h200-gpu-tests-s5run4.log" | tail -20
