# Sourced by the recipes in bench/ after device-env.sh (through `with_backend`): the carried
# flashinfer wheels (.whl, from bench/flashinfer_wheels.sh) installed into /tmp/site and
# importable, and flashinfer's JIT cache (.ficache/flashinfer-jit.tgz) unpacked where
# FLASHINFER_WORKSPACE_BASE points (under $work/steady-flashinfer, as the steady bench's workdir
# lays it out), so that no kernel of it compiles on the device.
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
export FLASHINFER_DISABLE_VERSION_CHECK=1
cache="$work/steady-flashinfer/cache/compile/flashinfer"
mkdir -p "$cache"
if [ -f .ficache/flashinfer-jit.tgz ]; then tar -xzf .ficache/flashinfer-jit.tgz -C "$cache"; fi
export FLASHINFER_WORKSPACE_BASE="$cache"
# save_jit_cache: that cache as flashinfer-jit.tgz in $OUT (beside the results, not in them), to
# carry as .ficache/ next time, when none was carried (a fresh machine otherwise compiles
# flashinfer's kernels again)
save_jit_cache() {
  [ -f .ficache/flashinfer-jit.tgz ] && return
  [ -n "${OUT:-}" ] || return
  tar -czf "$OUT/flashinfer-jit.tgz" -C "$cache" . && ls -la "$OUT/flashinfer-jit.tgz"
}
