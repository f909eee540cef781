"""Make a restored process unique again: every restore of one image starts from the same memory.

Without this, every replica restored from one process snapshot would draw the same "random"
numbers (Python's `random`, NumPy's global generator, torch's CPU and CUDA generators), hand out
the same request ids and report the clock of the init. `refresh()` runs first thing after a
restore, before any after-restore hook, and:

- re-seeds `random`, NumPy's legacy global generator and torch's CPU and CUDA generators from
  fresh entropy (`os.urandom`) — only the modules already imported, nothing is imported here;
- calls every `on_refresh(fn)` callback in registration order (the LLM engine registers one
  that gives request ids a fresh prefix);
- returns what it did, for the startup manifest.

What a function author still owns (README "Writing a function"): anything the function holds
that must differ per replica or per start — its own `numpy.random.Generator` / `random.Random`
instances, UUIDs or tokens made at init, cached timestamps or hostnames, open connections and
file handles (close them in a before-snapshot hook, reopen them after restore). `uuid.uuid4()`,
`secrets` and `os.urandom` read the kernel's entropy and need nothing. Python's string hash
seed (PYTHONHASHSEED) is fixed for the process's life and cannot change after a restore.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

_callbacks: list[Callable[[], Any]] = []


def on_refresh(fn: Callable[[], Any]) -> Callable[[], Any]:
    """Register `fn` to run at every refresh (after each restore); returns `fn`."""
    _callbacks.append(fn)
    return fn


def refresh() -> dict[str, Any]:
    seed = int.from_bytes(os.urandom(8), "little")
    reseeded = ["random"]
    import random

    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed % 2**32)
        reseeded.append("numpy")
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(seed % 2**63)  # seeds the CPU and every initialised CUDA generator
        reseeded.append("torch")
        if torch.cuda.is_initialized():
            reseeded.append("torch.cuda")
    for fn in _callbacks:
        fn()
    return {
        "reseeded": reseeded,
        "callbacks": len(_callbacks),
        "host": socket.gethostname(),
        "wall_clock": time.time(),
    }
