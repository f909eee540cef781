#!/usr/bin/env bash
# Fetch, on a machine with a package registry, the wheels the GPU machine needs for the
# flashinfer backend into .whl/ (git-ignored; carry it to the device run). The GPU machine has
# python 3.12 and no registry; there: pip install --no-deps .whl/*.whl
# Usage: bash bench/flashinfer_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d .whl flashinfer-python==0.6.9 apache-tvm-ffi==0.1.15.post2 cuda-tile==1.7.0
ls -l .whl
