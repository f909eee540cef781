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


def use_primary_context(cu: Any, index: int) -> tuple[Any, Any]:
    """Retain device `index`'s primary context and make it this thread's current one:
    (device, context). The caller releases it with cuDevicePrimaryCtxRelease(device)."""
    device = ok(cu.cuDeviceGet(index), "cuDeviceGet")
    ctx = ok(cu.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")
    ok(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return device, ctx


# ---- VMM pieces shared by the regions, the prefetch helper and the pinned copies ----------------
def fd_handle_type(cu: Any) -> Any:
    """The shareable-handle type snapfn exports and imports VMM memory as: a POSIX fd."""
    return cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


def allocation_prop(cu: Any, location: str, location_id: int) -> Any:
    """A pinned `cuMemCreate` allocation at `location` ("DEVICE", "HOST_NUMA"), fd-exportable."""
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = getattr(cu.CUmemLocationType, f"CU_MEM_LOCATION_TYPE_{location}")
    prop.location.id = location_id
    prop.requestedHandleTypes = fd_handle_type(cu)
    return prop


def access_desc(cu: Any, location: str, location_id: int) -> Any:
    """Read-write access to a mapping from `location` ("DEVICE", "HOST_NUMA")."""
    access = cu.CUmemAccessDesc()
    access.location.type = getattr(cu.CUmemLocationType, f"CU_MEM_LOCATION_TYPE_{location}")
    access.location.id = location_id
    access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return access


def map_handle(cu: Any, handle: Any, nbytes: int, accesses: list[Any], align: int = 2 << 20) -> int:
    """Reserve `nbytes` of address space, map `handle` there and grant `accesses`; the address."""
    va = int(ok(cu.cuMemAddressReserve(nbytes, align, 0, 0), "cuMemAddressReserve"))
    try:
        ok(cu.cuMemMap(va, nbytes, 0, handle, 0), "cuMemMap")
        ok(cu.cuMemSetAccess(va, nbytes, accesses, len(accesses)), "cuMemSetAccess")
    except RestoreFailed:
        cu.cuMemUnmap(va, nbytes)  # NOTE: fails harmlessly when the map itself failed
        cu.cuMemAddressFree(va, nbytes)
        raise
    return va


def unmap(cu: Any, va: int, nbytes: int) -> None:
    """Undo `map_handle` (the handle itself is the caller's to release)."""
    cu.cuMemUnmap(va, nbytes)
    cu.cuMemAddressFree(va, nbytes)
