"""The CUDA driver checkpoint API, called from a helper process on another process's pid.

    lock(pid) → checkpoint(pid)      before criu dumps the process: its GPU state (contexts,
                                     device memory still allocated, loaded modules, graphs)
                                     moves to host memory, which criu then dumps
    restore(pid) → unlock(pid)       after criu restored it: the GPU state goes back

`cuCheckpointProcess{Lock,Checkpoint,Restore,Unlock,GetState}` are in `cuda.bindings.driver`
(driver 550+ / CUDA 12.4+ expose them; measured with driver 580 and cuda-bindings 13.3). The
caller needs `cuInit(0)` once, never a context of its own. Each call raises RestoreFailed with
the driver's error name; `available()` says, without raising, whether this machine has the API.
Nothing here imports cuda.bindings until called, so CPU machines never load it.
"""

from __future__ import annotations

import time
from typing import Any

from snapfn.snapshot.cuda.driver import driver
from snapfn.snapshot.errors import RestoreFailed

LOCK_TIMEOUT_MS = 20_000


def available() -> tuple[bool, str]:
    """(True, reason) when cuda.bindings imports, cuInit succeeds and the API is there."""
    try:
        cu = driver()
    except RestoreFailed as exc:
        return False, str(exc)
    if not hasattr(cu, "cuCheckpointProcessLock"):
        return False, "this cuda-bindings has no cuCheckpointProcess* (needs CUDA 12.4+ bindings)"
    err = cu.cuDriverGetVersion()
    version = int(err[1]) if int(err[0]) == 0 else 0
    if version < 12040:
        return False, f"the CUDA driver API version {version} has no checkpoint API (needs 12.4+)"
    return True, f"CUDA driver checkpoint API available (driver API {version})"


def lock(pid: int, timeout_ms: int = LOCK_TIMEOUT_MS) -> float:
    """Wait for the process's in-flight GPU work, then block its further CUDA calls."""
    return _call(pid, "cuCheckpointProcessLock", "CUcheckpointLockArgs", timeout_ms)


def checkpoint(pid: int) -> float:
    return _call(pid, "cuCheckpointProcessCheckpoint", "CUcheckpointCheckpointArgs")


def restore(pid: int) -> float:
    return _call(pid, "cuCheckpointProcessRestore", "CUcheckpointRestoreArgs")


def unlock(pid: int) -> float:
    return _call(pid, "cuCheckpointProcessUnlock", "CUcheckpointUnlockArgs")


def state(pid: int) -> str:
    """ "CU_PROCESS_STATE_RUNNING" / "…_LOCKED" / "…_CHECKPOINTED" / "…_FAILED"."""
    cu = driver()
    err, value = cu.cuCheckpointProcessGetState(pid)
    _check(err, "cuCheckpointProcessGetState", pid)
    return value.name


def uses_cuda(pid: int) -> bool:
    """Whether the process has a CUDA context (the driver answers for it), without raising."""
    try:
        cu = driver()
        err, _ = cu.cuCheckpointProcessGetState(pid)
    except (RestoreFailed, AttributeError):
        return False
    return int(err) == 0


def _call(pid: int, function: str, args_type: str, timeout_ms: int | None = None) -> float:
    cu = driver()
    args = getattr(cu, args_type)()
    if timeout_ms is not None and hasattr(args, "timeoutMs"):
        args.timeoutMs = timeout_ms
    start = time.perf_counter()
    result = getattr(cu, function)(pid, args)
    _check(result[0] if isinstance(result, tuple) else result, function, pid)
    return time.perf_counter() - start


def _check(err: Any, function: str, pid: int) -> None:
    if int(err) != 0:
        raise RestoreFailed(f"{function}(pid {pid}) failed: {getattr(err, 'name', err)}")
