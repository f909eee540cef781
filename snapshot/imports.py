"""A start-up's imports with Python's cyclic garbage collector paused.

Importing torch makes a few hundred thousand objects that live as long as the process. The
collector counts allocations and, as they pile up, walks every tracked object again, the older
generations included: on the 2-core CPU machine `import snapfn.handler.llm.build` spent about a
quarter of its time in those walks (1.90 s with the collector on, 1.42 s with it off, medians of
7 runs, 2026-12-02). Imports leave almost no garbage, so `collector_paused` turns the collector
off around them, and the first `import_for_startup` of a process (torch's import, in a fresh
one) then freezes what they made (`gc.freeze`: moved where the collector never looks again), as
a zygote freezes its preloaded heap before it forks.
`SNAPFN_STARTUP_GC=on` imports with the collector running and freezes nothing (`paused`, the
default, as above): to time the difference on one machine.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import time
from collections.abc import Iterator, Mapping, Sequence

from snapfn.snapshot.errors import BadRequest

STARTUP_GC = ("paused", "on")
_FROZEN = False  # whether `import_for_startup` froze this process's objects (once a process)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic collector off inside the block (as it was, after)."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def import_for_startup(entries: Sequence[str], env: Mapping[str, str] = os.environ) -> float:
    """Import the module of each entry (`module`, or `module:function`: the module only) with
    the collector paused; the first time in a process, then freeze every object there is
    (SNAPFN_STARTUP_GC=on: neither); seconds taken. A module already imported (a zygote's
    child) costs a dictionary lookup.

    NOTE: only the first call freezes, after a collection over what is not frozen yet (in a
    fresh process, before torch, a few milliseconds): a later one would freeze what the
    process made since (a worker's first model, a test session's fixtures), and a cycle among
    frozen objects is never freed."""
    global _FROZEN
    mode = env.get("SNAPFN_STARTUP_GC", "paused")
    if mode not in STARTUP_GC:
        raise BadRequest(f"SNAPFN_STARTUP_GC must be one of {', '.join(STARTUP_GC)}, not {mode!r}")
    start = time.perf_counter()
    freeze = mode == "paused" and not _FROZEN
    if freeze:
        gc.collect()
    with collector_paused() if mode == "paused" else contextlib.nullcontext():
        for entry in entries:
            importlib.import_module(entry.partition(":")[0])
        if freeze:
            gc.freeze()
            _FROZEN = True
    return time.perf_counter() - start
