"""A span: one reserved range of addresses whose pieces are mapped on demand, given back before
a checkpoint and mapped again at the same addresses after a restore — the memory behind a
function's releasable pool (`SpanPool`, a torch MemPool over a span).

    span = Span.reserve(device, reserve_bytes)   the addresses, reserved once, nothing mapped
    address = span.map_segment(nbytes)           the next piece at the bump pointer, mapped
    span.unmap_segment(address)                  its memory given back (its addresses are never
                                                 handed out again)
    span.segments()                              the pieces mapped now: [(address, nbytes)]
    span.release()                               every piece's memory given back; addresses kept
    span.map_runs(runs)                          after a restore: fresh memory for each run (a run
                                                 covers consecutive pieces, one mapping each)
    span.adopt_runs(fds)                         or the memory a restorer made, one fd per run
    span.view(address, nbytes)                   a uint8 tensor over mapped bytes
    pool = SpanPool(device)                      a torch MemPool over a CUDA span: what
    with pool.routing(): ...                     what this thread allocates inside lands in it

CUDA (`cuMemAddressReserve` once; `cuMemCreate` + `cuMemMap` per piece or run): the reservation
survives the CUDA driver checkpoint, so the addresses stay valid across a restore, and tensors,
modules and captured graphs that point into the span work unchanged once its runs are mapped and
filled. CPU: one anonymous private mapping; `release()` drops its pages (criu dumps only pages
that are present); mapping has nothing to do and pages read as zeros until written. The CPU
span exists so that the pool's planning, image and restore logic run on machines without a GPU.

NOTE: a run's memory is one mapping: after `map_runs`/`adopt_runs` a piece inside a run is
unmapped only with the whole run, once every piece of it was unmapped.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from snapfn.snapshot.cuda.driver import ok as _ok
from snapfn.snapshot.cuda.regions import (
    ALIGN,
    CudaArray,
    device_memory_props,
    pluggable_allocator,
    round_up,
)
from snapfn.snapshot.errors import RestoreFailed


@dataclass(frozen=True)
class Run:
    """Consecutive pieces mapped as one: `nbytes` at `address`."""

    address: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.address + self.nbytes


class Span:
    """Addresses reserved once on `device`; pieces mapped and unmapped inside them."""

    def __init__(self, device: torch.device, base: int, reserved_bytes: int, granularity: int):
        self.device, self.base, self.reserved_bytes = device, base, reserved_bytes
        self.granularity = granularity
        self.top = base  # the bump pointer: addresses below it were handed out once
        self._pieces: dict[int, int] = {}  # address → nbytes, mapped
        self._runs: dict[int, _MappedRun] = {}  # run address → its mapping (after a restore)
        self._lock = threading.Lock()

    @staticmethod
    def reserve(device: torch.device | str, reserve_bytes: int) -> Span:
        device = torch.device(device)
        if device.type == "cuda":
            return CudaSpan.make(device, reserve_bytes)
        if device.type == "cpu":
            return CpuSpan.make(reserve_bytes)
        raise ValueError(f"no spans on {device.type}")

    # ---- pieces ------------------------------------------------------------------------------
    def map_segment(self, nbytes: int) -> int | None:
        """Map `nbytes` (rounded up to the granularity) at the bump pointer: its address, or
        None when the reservation is used up or the device is out of memory."""
        nbytes = round_up(max(nbytes, 1), self.granularity)
        with self._lock:
            address = self.top
            if address + nbytes > self.base + self.reserved_bytes:
                return None
            if not self._map_piece(address, nbytes):
                return None
            self._pieces[address] = nbytes
            self.top = address + nbytes
        return address

    def unmap_segment(self, address: int) -> None:
        """Give piece `address`'s memory back (a piece inside a run: once the run is empty)."""
        with self._lock:
            nbytes = self._pieces.pop(address, None)
            if nbytes is None:
                return
            run = next((r for r in self._runs.values() if r.holds(address)), None)
            if run is None:
                self._unmap_piece(address, nbytes)
                return
            run.pieces.discard(address)
            if not run.pieces:
                del self._runs[run.run.address]
                self._unmap_run(run)

    def segments(self) -> list[tuple[int, int]]:
        """The pieces handed out and not unmapped since: [(address, nbytes)], by address."""
        with self._lock:
            return sorted(self._pieces.items())

    def view(self, address: int, nbytes: int) -> torch.Tensor:
        """A uint8 tensor over `nbytes` at `address` (which must be mapped)."""
        if address < self.base or address + nbytes > self.top:
            raise ValueError(f"[{address:#x}, +{nbytes}) is not inside this span")
        return self._view(address, nbytes)

    # ---- a checkpoint and a restore -----------------------------------------------------------
    def release(self) -> int:
        """Give back the memory of every piece (and run); the bytes given back."""
        with self._lock:
            released = sum(self._pieces.values())
            for run in self._runs.values():
                self._unmap_run(run)
            in_runs = {a for r in self._runs.values() for a in r.pieces}
            for address, nbytes in self._pieces.items():
                if address not in in_runs:
                    self._unmap_piece(address, nbytes)
            self._runs = {}
        return released

    def map_runs(self, runs: Sequence[Run]) -> None:
        """Fresh memory for each run (contents undefined on CUDA, zeros on CPU)."""
        self._take_runs(runs, {run.address: None for run in runs})

    def adopt_runs(self, runs: Sequence[Run], fds: Mapping[int, int]) -> None:
        """Map the memory another process made for each run ({run address: POSIX fd}, every fd
        closed here). RestoreFailed, with nothing mapped, unless every run was adopted."""
        missing = [hex(r.address) for r in runs if r.address not in fds]
        try:
            if missing or len(fds) != len(runs):
                raise RestoreFailed(f"the restorer's regions do not match ours (missing {missing})")
            self._take_runs(runs, dict(fds))
        finally:
            for fd in fds.values():
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _take_runs(self, runs: Sequence[Run], fds: Mapping[int, int | None]) -> None:
        with self._lock:
            if self._runs:
                raise RestoreFailed("the span's runs are mapped already")
            taken: list[_MappedRun] = []
            try:
                for run in runs:
                    pieces = {a for a in self._pieces if run.address <= a < run.end}
                    inside = all(a + self._pieces[a] <= run.end for a in pieces)
                    if not pieces or not inside or run.address not in self._pieces:
                        raise RestoreFailed(f"run [{run.address:#x}, +{run.nbytes}) is no run")
                    taken.append(self._map_run(run, pieces, fds[run.address]))
            except BaseException:
                for mapped in taken:
                    self._unmap_run(mapped)
                raise
            self._runs = {m.run.address: m for m in taken}

    # ---- the backend --------------------------------------------------------------------------
    def _map_piece(self, address: int, nbytes: int) -> bool:
        raise NotImplementedError

    def _unmap_piece(self, address: int, nbytes: int) -> None:
        raise NotImplementedError

    def _map_run(self, run: Run, pieces: set[int], fd: int | None) -> _MappedRun:
        raise NotImplementedError

    def _unmap_run(self, mapped: _MappedRun) -> None:
        raise NotImplementedError

    def _view(self, address: int, nbytes: int) -> torch.Tensor:
        raise NotImplementedError


@dataclass
class _MappedRun:
    run: Run
    pieces: set[int]  # the pieces it holds that are not unmapped yet
    handle: Any = None

    def holds(self, address: int) -> bool:
        return self.run.address <= address < self.run.end


class CpuSpan(Span):
    @classmethod
    def make(cls, reserve_bytes: int) -> CpuSpan:
        nbytes = round_up(max(reserve_bytes, 1), ALIGN)
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0)
        mapping = mmap.mmap(-1, nbytes, flags=flags)
        base = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
        span = cls(torch.device("cpu"), base, nbytes, ALIGN)  # pieces as on CUDA: 2 MiB
        span._map, span._bytes = mapping, torch.frombuffer(mapping, dtype=torch.uint8)
        return span

    def _map_piece(self, address: int, nbytes: int) -> bool:
        return True  # anonymous pages appear, zero-filled, on first touch

    def _unmap_piece(self, address: int, nbytes: int) -> None:
        self._madvise_dontneed(address, nbytes)

    def _map_run(self, run: Run, pieces: set[int], fd: int | None) -> _MappedRun:
        if fd is not None:
            raise RestoreFailed("a CPU span adopts no memory from another process")
        return _MappedRun(run, pieces)

    def _unmap_run(self, mapped: _MappedRun) -> None:
        self._madvise_dontneed(mapped.run.address, mapped.run.nbytes)

    def _view(self, address: int, nbytes: int) -> torch.Tensor:
        lo = address - self.base
        return self._bytes[lo : lo + nbytes]

    def _madvise_dontneed(self, address: int, nbytes: int) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        if libc.madvise(address, nbytes, mmap.MADV_DONTNEED) != 0:
            raise OSError(ctypes.get_errno(), f"madvise({address:#x}, {nbytes}) failed")

    def resident_bytes(self) -> int:
        """Bytes of the used addresses backed by memory now (mincore), to check a release."""
        libc = ctypes.CDLL(None, use_errno=True)
        used = self.top - self.base
        pages = used // mmap.PAGESIZE
        if not pages:
            return 0
        vec = (ctypes.c_ubyte * pages)()
        if libc.mincore(ctypes.c_void_p(self.base), ctypes.c_size_t(used), vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
        return sum(b & 1 for b in vec) * mmap.PAGESIZE


class CudaSpan(Span):
    @classmethod
    def make(cls, device: torch.device, reserve_bytes: int) -> CudaSpan:
        """NOTE: no torch calls: a SpanPool makes its span inside torch's allocator too."""
        from cuda.bindings import driver as cu

        index = device.index if device.index is not None else 0
        prop, access, granularity = device_memory_props(cu, index)
        granularity = max(granularity, ALIGN)
        nbytes = round_up(max(reserve_bytes, 1), granularity)
        base = int(_ok(cu.cuMemAddressReserve(nbytes, granularity, 0, 0), "reserve"))
        span = cls(torch.device("cuda", index), base, nbytes, granularity)
        span._cu, span._prop, span._access = cu, prop, access
        span._handles: dict[int, Any] = {}
        return span

    def _create_and_map(self, address: int, nbytes: int, handle: Any = None) -> Any:
        cu = self._cu
        if handle is None:
            handle = _ok(cu.cuMemCreate(nbytes, self._prop, 0), "cuMemCreate")
        try:
            _ok(cu.cuMemMap(address, nbytes, 0, handle, 0), "cuMemMap")
        except RestoreFailed:
            cu.cuMemRelease(handle)
            raise
        _ok(cu.cuMemSetAccess(address, nbytes, [self._access], 1), "cuMemSetAccess")
        return handle

    def _unmap(self, address: int, nbytes: int, handle: Any) -> None:
        _ok(self._cu.cuMemUnmap(address, nbytes), "cuMemUnmap")
        _ok(self._cu.cuMemRelease(handle), "cuMemRelease")

    def _map_piece(self, address: int, nbytes: int) -> bool:
        try:
            self._handles[address] = self._create_and_map(address, nbytes)
        except RestoreFailed:  # out of memory: torch raises its own OOM on a None address
            return False
        return True

    def _unmap_piece(self, address: int, nbytes: int) -> None:
        handle = self._handles.pop(address, None)
        if handle is not None:
            self._unmap(address, nbytes, handle)

    def _map_run(self, run: Run, pieces: set[int], fd: int | None) -> _MappedRun:
        handle = None
        if fd is not None:
            from snapfn.snapshot.cuda.driver import fd_handle_type

            cu = self._cu
            handle = _ok(cu.cuMemImportFromShareableHandle(fd, fd_handle_type(cu)), "import")
        return _MappedRun(run, pieces, self._create_and_map(run.address, run.nbytes, handle))

    def _unmap_run(self, mapped: _MappedRun) -> None:
        if mapped.handle is not None:
            self._unmap(mapped.run.address, mapped.run.nbytes, mapped.handle)
            mapped.handle = None

    def _view(self, address: int, nbytes: int) -> torch.Tensor:
        return torch.as_tensor(CudaArray(address, nbytes), device=self.device)


def plan_runs(pieces: Sequence[tuple[int, int]], max_runs: int = 128) -> list[Run]:
    """Runs over `pieces` ([(address, nbytes)], by address): touching pieces join one run;
    while there are more than `max_runs`, the two runs with the smallest gap between them join
    (the gap's addresses are mapped too: a restorer hands over one fd per run, and a socket
    message carries a few hundred)."""
    runs: list[list[int]] = []
    for address, nbytes in sorted(pieces):
        if runs and runs[-1][1] == address:
            runs[-1][1] = address + nbytes
        else:
            runs.append([address, address + nbytes])
    while len(runs) > max_runs:
        i = min(range(len(runs) - 1), key=lambda k: runs[k + 1][0] - runs[k][1])
        runs[i : i + 2] = [[runs[i][0], runs[i + 1][1]]]
    return [Run(lo, hi - lo) for lo, hi in runs]


class SpanPool:
    """A torch MemPool whose segments are pieces of one CUDA span: what `routing()` allocates
    is released with the span before a checkpoint and mapped again at the same addresses after
    a restore.

    While `routing()` is open, this thread's allocations go to the pool; a CUDA graph captured
    meanwhile still allocates into its own private pool, as it would without snapfn, so a
    graph's intermediates never share blocks with the pool's tensors (seen on the H200, torch
    2.11: tests/test_function_gpu.py). NOTE: torch's stream filter
    (`_cuda_beginAllocateCurrentStreamToPool`) only works while the stream captures. The allocator callbacks run inside torch's allocator, with its lock held:
    they call the driver only, never torch.
    """

    def __init__(self, device: torch.device | str, reserve_bytes: int | None = None) -> None:
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"a SpanPool lives on a CUDA device, not {device}")
        if not hasattr(torch._C, "_cuda_beginAllocateCurrentThreadToPool"):
            raise RuntimeError(f"torch {torch.__version__} cannot route a thread's allocations")
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        torch.zeros(1, device=self.device)  # the primary context exists and is current
        if reserve_bytes is None:  # NOTE: addresses are cheap; freed pieces' are never reused
            reserve_bytes = 4 * torch.cuda.mem_get_info(self.device)[1]
        self.span = CudaSpan.make(self.device, reserve_bytes)
        self._callbacks, self.allocator = pluggable_allocator(self._malloc, self._free)
        self.pool = torch.cuda.MemPool(allocator=self.allocator)

    @contextlib.contextmanager
    def routing(self) -> Iterator[None]:
        """Route this thread's allocations to the pool while inside."""
        index = self.device.index
        torch._C._cuda_beginAllocateCurrentThreadToPool(index, self.pool.id)
        try:
            yield
        finally:
            torch._C._cuda_endAllocateToPool(index, self.pool.id)

    def live_blocks(self) -> list[tuple[int, int]]:
        """The pool's blocks in use now, [(address, nbytes)] by address, from torch's allocator
        snapshot (a block freed but still recorded on another stream counts as in use)."""
        blocks = []
        lo, hi = self.span.base, self.span.top
        for segment in torch.cuda.memory_snapshot():
            if not lo <= int(segment["address"]) < hi:
                continue
            for block in segment["blocks"]:
                if block["state"] != "inactive":
                    blocks.append((int(block["address"]), int(block["size"])))
        return sorted(blocks)

    def _malloc(self, size: int, device: int, stream: int) -> int | None:
        return self.span.map_segment(size)

    def _free(self, ptr: int, size: int, device: int, stream: int) -> None:
        span = getattr(self, "span", None)  # None while the pool is being collected
        if span is not None:
            span.unmap_segment(ptr)
