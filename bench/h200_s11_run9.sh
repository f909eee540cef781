#!/usr/bin/env bash
# Device run on one H200 (session 11, run 9, on run 8's machine; sent as this one command line):
# the glm-small whole-model greedy cases through flashinfer, eager and with decode graphs, with
# the float32 modules (the indexer's `weights_proj`, the MoE router) through the fused GEMV.
# Usage (device tool; carry .whl, .ficache): bash bench/h200_s11_run9.sh
. bench/device-env.sh; . bench/device-flashinfer.sh; timeout 150 python3 -m pytest -v -m gpu -p no:cacheprovider tests/test_flashinfer.py -k "engine_greedy-glm" > $out/h200-gpu-tests-s11run9-flashinfer.log 2>&1; grep -E "PASSED|FAILED|ERROR|^E  |passed|failed" $out/h200-gpu-tests-s11run9-flashinfer.log | tail -8
