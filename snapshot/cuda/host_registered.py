"""Pinned host memory made fast: anonymous pages advised for huge pages, touched by several
threads, then registered with CUDA in one call (`cuMemHostRegister`).

A weights stream's host ring must be pinned for its copies to run at the link's rate, and a
restore makes its ring while its other stages run. torch's pinned allocation
(`torch.empty(pin_memory=True)`, `cudaHostAlloc`) faults and pins page by page under the
driver's lock: 0.35-0.53 s for a 1 GiB ring on an H100 host, and the restore's own CUDA calls
wait behind it. This memory copies to the device at the same 55 GB/s and is made in 0.07 s
(`bench/probes/pin_probe.py`, `2026-12-07-h100-tier0-env-llama8b-embedding-init`).
"""

from __future__ import annotations

import contextlib
import mmap
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch

from snapfn.snapshot.cuda.driver import driver, ok
from snapfn.snapshot.errors import RestoreFailed


class RegisteredHostMemory:
    """`num_bytes` of pinned host memory as one uint8 tensor (`tensor`); `close()` gives it back
    (and so does the garbage collector, where nobody closed it).

    Registered through the driver API (`cuMemHostRegister`), so that a refusal leaves no error
    behind in the CUDA runtime for torch's next call to raise. Raises RestoreFailed, the memory
    given back, when it cannot be registered (the caller then pins another way).
    """

    def __init__(self, num_bytes: int, device: torch.device, threads: int = 16) -> None:
        self._area = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            self._area.madvise(mmap.MADV_HUGEPAGE)  # 2 MiB pages: fewer faults, fewer to pin
        self.tensor: torch.Tensor | None = torch.frombuffer(self._area, dtype=torch.uint8)
        self._touch(max(1, threads))
        self._unregister = None
        try:
            cu = driver()
            # NOTE: the device's context made current on this thread (the driver call needs
            # one); "cuda" without an index is this thread's current device, as torch reads it
            index = torch.cuda.current_device() if device.index is None else device.index
            torch.cuda.set_device(index)
            address = self.tensor.data_ptr()
            ok(cu.cuMemHostRegister(address, num_bytes, 0), "cuMemHostRegister")
        except RestoreFailed:
            self.close()
            raise
        # NOTE: unregistered before the pages can be unmapped: the area lives as long as this
        # object, whose finalizer runs first (not at interpreter exit: the process is going)
        self._unregister = weakref.finalize(self, cu.cuMemHostUnregister, address)
        self._unregister.atexit = False

    def _touch(self, threads: int) -> None:
        """Fault every page in now, the threads each writing a share (torch's fill_ lets go of
        the GIL), so that registering finds them all present."""
        step = -(-self.tensor.numel() // threads)
        shares = [self.tensor[k * step : (k + 1) * step] for k in range(threads)]
        with ThreadPoolExecutor(threads, thread_name_prefix="host-touch") as pool:
            list(pool.map(lambda share: share.fill_(0), shares))

    def close(self) -> None:
        """Unregister, then unmap. NOTE: a view still alive keeps the pages mapped until it
        goes (mmap unmaps with its last export); copies from it stay correct, only unpinned."""
        if self._unregister is not None:
            self._unregister()
        self.tensor = None
        with contextlib.suppress(BufferError):  # a view still alive: unmapped when it goes
            self._area.close()
