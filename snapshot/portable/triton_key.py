"""Triton's own hash, `triton_key`, begun beside torch's import.

A process's first Triton compile-cache lookup hashes Triton's Python sources and its 0.5 GB
shared library (`triton_key`, kept for the process by `functools.lru_cache`): 0.43 s on the
H200 (bench/results/2026-12-02-h200-tier0-env-embedded-warmup-profile). It needs Triton and
not torch (Triton's import does not import torch), and the hashing releases the GIL, so a fresh
process can run it on a thread while its main thread imports torch. `start` does that;
`handler/llm/kernels/triton/warm.py`, which does the rest of Triton's start-up once torch is
there, joins it. `SNAPFN_WARM_COMPILER=off` turns both off.

# NOTE: imports neither torch nor Triton at module level: it runs before torch's import.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

VARIABLE = "SNAPFN_WARM_COMPILER"


def enabled(environ=os.environ) -> bool:
    """Whether Triton's start-up work runs ahead: SNAPFN_WARM_COMPILER is "on" (the default) or
    "off"."""
    value = environ.get(VARIABLE, "on")
    if value not in ("on", "off"):
        raise ValueError(f"{VARIABLE} must be 'on' or 'off', got {value!r}")
    return value == "on"


def triton_key_function() -> Callable[[], str] | None:
    """Triton's `triton_key` (in `triton.runtime.cache` from 3.4, `triton.compiler.compiler`
    before), or None."""
    for module in ("triton.runtime.cache", "triton.compiler.compiler"):
        key = getattr(importlib.import_module(module), "triton_key", None)
        if key is not None:
            return key
    return None


def start(environ=os.environ) -> Future | None:
    """`triton_key` computed on a daemon thread; the future answers its seconds (None where
    this Triton has no `triton_key`). None where the warm is off or Triton is not installed."""
    if not enabled(environ) or importlib.util.find_spec("triton") is None:
        return None
    done: Future = Future()

    def run() -> None:
        begun = time.perf_counter()
        try:
            key = triton_key_function()
            if key is not None:
                key()
            done.set_result(round(time.perf_counter() - begun, 4) if key is not None else None)
        except BaseException as exc:  # noqa: BLE001  (handed to whoever joins the future)
            done.set_exception(exc)

    threading.Thread(target=run, name="snapfn-triton-key", daemon=True).start()
    return done
