# Sourced by the device scripts in bench/ after device-env.sh: the carried flashinfer wheels
# (.whl) installed into /tmp/site and importable, and flashinfer's JIT cache (.ficache) unpacked
# where FLASHINFER_WORKSPACE_BASE points (under $work/steady-flashinfer, as the steady bench's
# workdir lays it out), so that no kernel of it compiles on the device.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PYTHONPATH:/tmp/site
export FLASHINFER_DISABLE_VERSION_CHECK=1
cache="$work/steady-flashinfer/cache/compile/flashinfer"
mkdir -p "$cache"
if [ -f .ficache/flashinfer-jit.tgz ]; then tar -xzf .ficache/flashinfer-jit.tgz -C "$cache"; fi
export FLASHINFER_WORKSPACE_BASE="$cache"
# save_jit_cache: that cache as $out/flashinfer-jit.tgz, to carry as .ficache/ next time, when
# none was carried (a fresh machine otherwise compiles flashinfer's kernels again)
save_jit_cache() {
  [ -f .ficache/flashinfer-jit.tgz ] && return
  tar -czf "$out/flashinfer-jit.tgz" -C "$cache" . && ls -la "$out/flashinfer-jit.tgz"
}
