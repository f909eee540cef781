"""The CUDA driver API through `cuda.bindings`, for the parts of snapfn that never import torch.

    cu = driver()          the `cuda.bindings.driver` module, `cuInit(0)` done once per process
    value = ok(cu.cuMemCreate(...), "cuMemCreate")     the call's value, or RestoreFailed

Used by the CUDA checkpoint calls (on another process's pid), the releasable regions and the
region-prefetch helper. Nothing is imported until `driver()` is called, so CPU machines never
load cuda.bindings.
"""

from __future__ import annotations

import threading
from typing import Any

from snapfn.snapshot.errors import RestoreFailed, one_line

_init_lock = threading.Lock()
_initialized = False


def driver() -> Any:
    """`cuda.bindings.driver`, initialised; RestoreFailed saying why when it cannot be."""
    global _initialized
    try:
        from cuda.bindings import driver as cu
    except ImportError as exc:
        raise RestoreFailed(f"cuda-bindings is not installed ({exc.name or exc})") from None
    with _init_lock:
        if not _initialized:
            err = cu.cuInit(0)
            err = err[0] if isinstance(err, tuple) else err
            if int(err) != 0:
                raise RestoreFailed(f"cuInit failed: {getattr(err, 'name', err)} (no usable GPU?)")
            _initialized = True
    return cu


def ok(result: Any, what: str) -> Any:
    """The value a driver call returned (None when it returns only its status); RestoreFailed
    naming `what` and the driver's error otherwise."""
    err = result[0] if isinstance(result, tuple) else result
    if int(err) != 0:
        name = getattr(err, "name", str(int(err)))
        raise RestoreFailed(one_line(f"CUDA {what} failed: {name}"))
    return result[1] if isinstance(result, tuple) and len(result) > 1 else None
