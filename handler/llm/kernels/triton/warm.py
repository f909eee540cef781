"""Triton's once-a-process start-up work that needs no GPU, done before the first kernel runs.

A process's first Triton launch imports Triton's compiler, and its first compile-cache lookup
hashes Triton's own files (`triton_key`: its Python sources and its 0.5 GB shared library); each
kernel's first launch hashes the kernel's source. None of it touches CUDA. In a restore, all of
it fell inside the warmup stage: on the H200, 0.43 s of `triton_key` and 0.29 s of imports in a
1.16 s warmup (bench/probes/warmup_profile.py;
bench/results/2026-12-02-h200-tier0-env-embedded-warmup-profile).

`warm_compiler` does that work ahead: a zygote calls it before it forks (`ZYGOTE_PRELOAD`
names it), so every restore forked from it starts with it done; a restore in a fresh process
runs it in a thread beside its first stages (the hashing releases the GIL) and joins it before
the warmup, and begins `triton_key` earlier still, beside torch's import
(`snapshot/portable/triton_key.py`), which `warm_compiler` then joins instead of hashing again.
`SNAPFN_WARM_COMPILER=off` leaves the work to the first launch, as before.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import time
from concurrent.futures import Future
from typing import Any

from snapfn.snapshot.portable.triton_key import VARIABLE, enabled, triton_key_function

# this package's kernel modules: importing each runs its @triton.jit decorators
KERNEL_MODULES = ("kernels", "gemv", "attention", "mla", "absorb", "indexer", "moe", "sampling")
__all__ = ["VARIABLE", "enabled", "warm_compiler"]


def warm_compiler(environ=os.environ, key_started: Future | None = None) -> dict[str, Any]:
    """Import Triton's compiler and the kernel modules, hash Triton's files (or join
    `key_started`, the thread `triton_key.start` began for them) and each kernel's source; what
    it did, for the startup manifest. Nothing here initialises CUDA."""
    if not enabled(environ):
        return {"skipped": f"{VARIABLE}=off"}
    if importlib.util.find_spec("triton") is None:
        return {"skipped": "triton is not installed"}
    start = time.perf_counter()
    modules = [importlib.import_module(f"{__package__}.{name}") for name in KERNEL_MODULES]
    figures: dict[str, Any] = {}
    if key_started is not None:
        # NOTE: joined before key() below: lru_cache does not lock, so calling it while the
        # thread hashes would hash the 0.5 GB library a second time
        waited = time.perf_counter()
        figures["triton_key_s"] = key_started.result()
        figures["triton_key_wait_s"] = round(time.perf_counter() - waited, 4)
    key = triton_key_function()
    if key is None:
        return {"skipped": "this Triton has no triton_key to compute ahead"}
    key()  # cached for the process (functools.lru_cache)
    hashed = sum(_hash_sources(module) for module in modules)
    figures.update(kernels_hashed=hashed, seconds=round(time.perf_counter() - start, 4))
    return figures


def _hash_sources(module) -> int:
    """Each `@triton.jit` function's source hash in `module` (its `cache_key`, computed once
    and kept on the function); how many."""
    from triton.runtime.jit import JITFunction

    count = 0
    for value in vars(module).values():
        fn = value
        while not isinstance(fn, JITFunction) and hasattr(fn, "fn"):  # autotuned, heuristics
            fn = fn.fn
        if isinstance(fn, JITFunction) and fn.__module__ == module.__name__:
            _ = fn.cache_key
            count += 1
    return count
