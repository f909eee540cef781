"""Bandwidth floors a weight restore is measured against (`snapfn bench`).

`measure_h2d_gbps(device)`: pinned host → device copy bandwidth in GB/s, the ceiling a CUDA copy
stream can reach (ValueError on a device that is not CUDA). `measure_disk_read_gbps(path)`: read
bandwidth of a file in GB/s after asking the kernel to drop it from the page cache.
`measure_memory_gbps(device)` and `measure_matmul_tflops(device, dtype)`: the device's memory
bandwidth and dense matmul rate, the rooflines of steady-state decode and prefill.
"""

from __future__ import annotations

import os
import time

import torch

from snapfn.snapshot.portable import pagecache


def measure_h2d_gbps(device: str | torch.device, nbytes: int = 1 << 30, repeats: int = 3) -> float:
    """Pinned host → device copy bandwidth, GB/s: the ceiling a CUDA stream can reach."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"measure_h2d_gbps needs a CUDA device, not {device}")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev.copy_(host, non_blocking=True)  # warm-up
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    return repeats * nbytes / (time.perf_counter() - start) / 1e9


def measure_disk_read_gbps(path: str | os.PathLike, num_threads: int = 16) -> float:
    """Read bandwidth of `path` after asking the kernel to drop it from the page cache, GB/s.

    Cold-ish: where the kernel ignores POSIX_FADV_DONTNEED (tmpfs), this is a page-cache read.
    """
    pagecache.drop([path])
    return pagecache.prewarm([path], num_threads=num_threads).gbps


def measure_memory_gbps(
    device: str | torch.device, nbytes: int = 1 << 30, repeats: int = 5
) -> float:
    """Device memory bandwidth, GB/s: bytes read plus bytes written by a tensor copy on `device`
    (HBM on a GPU, DRAM on the CPU) — what a memory-bound decode step can stream per second."""
    device = torch.device(device)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    _sync(device)
    return 2 * repeats * nbytes / (time.perf_counter() - start) / 1e9


def measure_matmul_tflops(
    device: str | torch.device, dtype: torch.dtype, n: int | None = None, repeats: int = 5
) -> float:
    """Dense matmul rate on `device` in `dtype`, TFLOP/s (2·n³ per n×n product)."""
    device = torch.device(device)
    n = n or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    torch.matmul(a, b)  # warm-up (and the library's own setup)
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        torch.matmul(a, b)
    _sync(device)
    return 2 * n**3 * repeats / (time.perf_counter() - start) / 1e12


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
