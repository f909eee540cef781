"""A file mapped read-only and shared — its page-cache pages at an address a CUDA driver call
can take (cuMemHostRegister), which Python's mmap module does not give for read-only maps."""

from __future__ import annotations

import ctypes
import os

from snapfn.snapshot.errors import RestoreFailed


class FileMapping:
    """`size` bytes of the file open as `fd`, mapped PROT_READ / MAP_SHARED at `address`."""

    def __init__(self, fd: int, size: int) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t] + [ctypes.c_int] * 3
        libc.mmap.argtypes += [ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self._libc, self.size = libc, max(size, 1)
        address = libc.mmap(None, self.size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
        if address in (None, ctypes.c_void_p(-1).value):
            raise RestoreFailed(f"mmap of the weights failed: {os.strerror(ctypes.get_errno())}")
        self.address = int(address)

    def close(self) -> None:
        self._libc.munmap(self.address, self.size)
