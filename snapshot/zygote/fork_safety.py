"""Fork hygiene for the zygote: what must hold before it forks, and what a child resets after.

NOTE: CUDA must not be initialised in the zygote before fork — a child forked after its parent
initialised CUDA cannot use CUDA. `fork_safety_problem` says why forking now would give broken
workers: CUDA initialised (a preload module touched it), or a Python thread other than the main
one running (a lock another thread holds stays held forever in the child). Native pools that
shut themselves down at fork (OpenBLAS) are fine; a worker calls `torch.set_num_threads` itself,
after fork.

Before fork the zygote imports its preload modules and runs their preload calls
(`preload_modules`, timed per entry). After
fork the child resets the signal handling the zygote installed (`reset_signals`), takes the
requester's fds as its stdin/stdout/stderr (`adopt_stdio`) and reseeds `random` and, when
loaded, numpy's global state (`reseed`), so workers forked in a row do not share random streams.
"""

from __future__ import annotations

import importlib
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Sequence

from snapfn.snapshot.imports import collector_paused


def preload_modules(modules: Sequence[str]) -> dict[str, float]:
    """Preload each entry in order (`preload`), the cyclic collector paused (imports leave
    little for it: `snapshot.imports`); seconds per entry."""
    seconds: dict[str, float] = {}
    with collector_paused():
        for name in modules:
            start = time.perf_counter()
            preload(name)
            seconds[name] = time.perf_counter() - start
    return seconds


def preload(entry: str) -> None:
    """Import `entry`, a module; `module:function`: import it, then call the function (no
    arguments: start-up work that needs no CUDA, done once for every child)."""
    module, _, function = entry.partition(":")
    imported = importlib.import_module(module)
    if function:
        getattr(imported, function)()


def fork_safety_problem() -> str | None:
    """Why forking this process now would give broken workers, or None if it is safe."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return (
            "CUDA is initialised in the zygote (a preload module touched it); a forked worker"
            " could not use CUDA. Move CUDA work into the worker's target."
        )
    if threading.active_count() > 1:
        names = ", ".join(t.name for t in threading.enumerate() if t is not threading.main_thread())
        return f"Python threads are running in the zygote ({names}); their locks would stay held"
    return None


def count_native_threads() -> int:
    """Threads of this process, native pools included (Python threads where /proc is absent)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def reset_signals(handled: Sequence[int]) -> None:
    """In the child: no wakeup fd, default handlers for `handled` and SIGINT, nothing blocked."""
    signal.set_wakeup_fd(-1)
    for sig in handled:
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, ())


def adopt_stdio(fds: Sequence[int]) -> None:
    """In the child: make `fds` its 0/1/2 (closing the originals), line-buffered on a tty."""
    for target_fd, fd in enumerate(fds):
        os.dup2(fd, target_fd)
    for fd in set(fds):
        os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=stream.isatty())


def reseed() -> None:
    """In the child: fresh seeds for `random` and, when loaded, numpy's global state."""
    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
