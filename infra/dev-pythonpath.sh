#!/usr/bin/env bash
# Make `import snapfn.handler` / `snapfn.snapshot` work from a source tree without installing
# (machines with no package registry, e.g. the GPU box): links the two top-level folders under
# a `snapfn` namespace directory and prints the PYTHONPATH to export.
#   eval "$(bash infra/dev-pythonpath.sh)"
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest=${SNAPFN_DEV_PATH:-/tmp/snapfn-dev}
mkdir -p "$dest/snapfn"
ln -sfn "$root/handler" "$dest/snapfn/handler"
ln -sfn "$root/snapshot" "$dest/snapfn/snapshot"
echo "export PYTHONPATH=$dest\${PYTHONPATH:+:\$PYTHONPATH}"
