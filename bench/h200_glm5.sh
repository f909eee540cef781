#!/usr/bin/env bash
# Device run on one H200: the cold-start benchmark on the GLM-5-shaped model (glm_moe_dsa, FP8),
# at reduced depth (1 dense + 1 MoE layer + the MTP layer: 24 GB) so that the checkpoint and its
# snapshot both fit the 64 GB disk. transformers cannot run FP8 GLM here (its FP8 path needs the
# `kernels` package), so mode (a) is left out.
set -euo pipefail
work=/tmp/snapfn-h200-glm
. bench/device-env.sh
python3 -m snapfn.handler.cli make-model --preset glm5-reduced --num-layers 2 --dtype fp8 --device cuda --out "$work/glm5"
python3 -m snapfn.handler.cli bench --model "$work/glm5" --device cuda --workdir "$work/bench" \
  --modes safetensors,cold_init,restore,restore_zygote,restore_cold --decode-batches 1,32 --decode-tokens 16 \
  --out "$out/h200-glm5-reduced-fp8.json" --plot "$out/h200-glm5-reduced-fp8.png"
