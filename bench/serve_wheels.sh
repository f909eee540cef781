#!/usr/bin/env bash
# Fetch, on a machine with a package registry, the wheels the GPU machine lacks for the front
# doors (flask and gunicorn for `snapfn serve`, pydantic for its request schemas) and for
# structured output (llguidance, and jsonschema for its GPU tests) into
# .servewhl/ (git-ignored; carry it to the device run). The GPU machine has python 3.12 and no
# registry; bench/device-env.sh installs what it finds there into /tmp/site-serve.
# Usage: bash bench/serve_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d .servewhl flask==3.1.3 gunicorn==27.0.1 itsdangerous==2.2.0 blinker==1.9.0 \
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  llguidance==1.9.1 jsonschema==4.26.0 jsonschema_specifications==2025.9.1 \
  referencing==0.37.0 rpds_py==2026.9.1 attrs==26.1.0
ls -l .servewhl
