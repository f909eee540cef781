#!/usr/bin/env bash
# Device run on one H200: GPU tests, then the cold-start benchmark on an 8B-class llama (bf16).
# Usage (device tool): bash bench/h200_llama8b.sh   — results land in $OUT (or bench/results)
set -euo pipefail
. bench/device-env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py tests/test_checksum.py tests/test_streamer.py tests/test_zygote.py 2>&1 | tail -15
python3 -m snapfn.handler.cli make-model --preset 8b --dtype bf16 --device cuda --out "$work/llama8b"
python3 -m snapfn.handler.cli bench --model "$work/llama8b" --device cuda --workdir "$work/bench" \
  --decode-batches 1,32 --decode-tokens 32 \
  --out "$out/h200-llama8b-bf16.json" --plot "$out/h200-llama8b-bf16.png"
