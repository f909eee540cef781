"""`WeightStreamer`: fills preallocated tensors from a restore-layout file, chunks verified.

Reader threads `preadv` the file's chunks (read_plan.py) into a small ring of pinned host slots
(CUDA) or straight into the tensors' memory (CPU); the host → device copies run on their own
CUDA stream (cuda_copies.py), and the chunks are verified while reading goes on (`verify`,
resolved by chunk_checks.py): "sha256" hashes them on a thread pool (about 1 core-second per
GB); "device" (the default on CUDA when the table has `chunk_sum64`) copies each ring slot to a
device staging slot, computes each chunk's sum64 (checksum.py) there on the copy stream and
scatters the bytes to the tensors, so what is checked is what landed in device memory, with one
host sync at the end; "none" checks nothing. A mismatch raises `BadSnapshot` naming the chunk;
the destination tensors then hold unverified bytes and must be discarded.
`load_layout_tensors` allocates the table's tensors and streams the file into them.

Following a download (`arrivals`, e.g. store/arrivals.py's `FileWaiter`): the file is still
being written by a pull, each chunk verified before it is recorded; every reader calls
`arrivals.wait_for(lo, hi)` before its `preadv` of bytes [lo, hi), which blocks until those
chunks are there (or raises BadSnapshot, naming the chunk, if the pull failed). The seconds
readers spent waiting, summed over readers, are the report's `download_wait_s`. Without
`arrivals` (the default) the file is read as it is, with no wait.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from snapfn.snapshot.errors import BadSnapshot, RestoreFailed
from snapfn.snapshot.layout.checksum import odd_weights
from snapfn.snapshot.layout.chunk_checks import ChunkChecks, verify_mode
from snapfn.snapshot.layout.cuda_copies import Ship, StagedCopies, enqueue_copies
from snapfn.snapshot.layout.preads import preadv_exact
from snapfn.snapshot.layout.read_plan import (
    Unit,
    device_bytes,
    host_bytes,
    piece_view,
    plan_units,
    slot_views,
)
from snapfn.snapshot.layout.table import RestoreLayout, dtype_name

LAYOUT = "restore layout"  # what a short read names
RING_PINNINGS = ("register", "alloc")  # how prepare() pins the CUDA ring (see prepare)


@dataclass(frozen=True)
class StreamReport:
    """One `stream_into`: file bytes moved, wall time, and how the chunks were verified."""

    num_bytes: int
    elapsed_s: float  # first read → last copy finished and last chunk checked
    gbps: float
    verify_s: float  # host seconds verifying, summed over threads (0 for "device" on CUDA)
    num_chunks: int
    verify_mode: str  # "sha256", "device" or "none"
    ring_alloc_s: float = 0.0  # pinning the host ring in this call (see prepare), not in elapsed_s
    download_wait_s: float = 0.0  # readers' seconds waiting on a download, summed (arrivals)
    ring_pinning: str = ""  # how the CUDA ring was pinned ("register" or "alloc"; "" on CPU)
    ring_pin_s: float = 0.0  # pinning the host ring, wherever it ran (a side thread's prepare)


class ByteArrivals(Protocol):
    """Bytes of the file still arriving: `wait_for(lo, hi)` blocks until [lo, hi) is there and
    returns the seconds it waited (store/arrivals.py's `FileWaiter`)."""

    def wait_for(self, lo: int, hi: int) -> float: ...


@contextmanager
def _pools(num_threads: int) -> Iterator[tuple[ThreadPoolExecutor, ThreadPoolExecutor]]:
    """A reader pool and a digest pool; on the way out, pending work is cancelled."""
    reads = ThreadPoolExecutor(num_threads, thread_name_prefix="weights-read")
    hashes = ThreadPoolExecutor(num_threads, thread_name_prefix="weights-verify")
    try:
        yield reads, hashes
    finally:
        # NOTE: readers first: a reader may be waiting on a digest that must still finish
        reads.shutdown(cancel_futures=True)
        hashes.shutdown(cancel_futures=True)


class WeightStreamer:
    """Fills preallocated tensors on `device` from a restore-layout file, chunks verified.

    CUDA: `num_threads` readers `preadv` units of whole chunks (up to `slot_bytes`) into a ring
    of `ring_slots` pinned host slots, allocated once per streamer; each slot is copied to the
    device on a dedicated stream and reused only after its copy event (and, with "sha256", its
    digests) are done. With "device" verification a slot is copied whole into a device staging
    slot (a ring as large as the pinned one, held during `stream_into`), each chunk's sum64 is
    computed there into a device vector, and the bytes are then copied on to the tensors; the
    vector is compared with the table's once, at the end. CPU: readers `preadv` straight into the
    destination tensors' memory; "device" then computes sum64 over those bytes on the host.

    `verify`: "auto" (or True) is "device" on CUDA when the table has `chunk_sum64`, else
    "sha256"; "none" (or False) checks nothing. `arrivals`: the file is still being downloaded;
    each read waits for its bytes first (see the module docstring).

    NOTE: when `stream_into` raises BadSnapshot, the destination tensors hold partial or
    unverified bytes and must be discarded; never use them.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        layout: RestoreLayout,
        *,
        device: str | torch.device,
        num_threads: int = 16,
        ring_slots: int = 16,
        slot_bytes: int = 64 << 20,
        verify: str | bool = "auto",
        arrivals: ByteArrivals | None = None,
        ring_pinning: str = "register",
    ) -> None:
        self.path, self.layout, self.device = Path(path), layout, torch.device(device)
        if ring_pinning not in RING_PINNINGS:
            raise ValueError(f"ring_pinning {ring_pinning!r} is not one of {RING_PINNINGS}")
        self.ring_pinning = ring_pinning  # how prepare() pinned the ring ("alloc" after a refusal)
        self._ring_memory = None  # the ring's RegisteredHostMemory ("register")
        self.ring_pin_s = 0.0  # what prepare() took, whichever thread called it
        self.arrivals = arrivals
        self._waited_s = 0.0  # summed over readers, under _wait_lock
        self._wait_lock = threading.Lock()
        self.num_threads, self.ring_slots = max(1, num_threads), ring_slots
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"WeightStreamer streams to cpu or cuda, not {self.device}")
        if self.device.type == "cuda" and (slot_bytes < layout.chunk_bytes or ring_slots < 1):
            raise ValueError(
                f"ring_slots {ring_slots} must be >= 1 and slot_bytes {slot_bytes} must hold a "
                f"{layout.chunk_bytes}-byte chunk"
            )
        self.verify = verify_mode(verify, self.device, layout)
        self._checks = ChunkChecks(self.path, layout, self.verify)
        layout.validate(os.stat(self.path).st_size)
        self._units = plan_units(layout, slot_bytes)
        self._ring: list[tuple[torch.Tensor, memoryview]] | None = None
        self._ring_lock = threading.Lock()  # prepare() may run on a side thread
        self._weights: torch.Tensor | None = None  # odd_weights of a chunk, on the device
        self._iov_max = os.sysconf("SC_IOV_MAX")

    def __enter__(self) -> WeightStreamer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the pinned ring and the sum64 weights."""
        self._ring = self._weights = None
        if self._ring_memory is not None:
            self._ring_memory.close()
            self._ring_memory = None

    def retarget(self, path: str | os.PathLike) -> None:
        """Stream from `path` from now on: the same table's file elsewhere (a process snapshot
        keeps its pinned ring across the checkpoint; each restore reads its own snapshot)."""
        self.path = Path(path)
        self._checks = ChunkChecks(self.path, self.layout, self.verify)
        self.layout.validate(os.stat(self.path).st_size)

    def prepare(self) -> float:
        """Pin the host ring now (CUDA; nothing on CPU); returns the seconds it took.

        `ring_pinning` "register" (the default): one block of anonymous memory, its pages
        touched by the reader threads, registered with CUDA at once (0.07 s a GiB on an H100
        host); "alloc": torch's pinned allocation per slot (0.35-0.53 s a GiB, holding the
        driver's lock meanwhile), also taken where the driver refuses to register. A restore
        calls this on a side thread while other stages run; `stream_into` calls it when nobody
        did.
        """
        with self._ring_lock:
            if self._ring is not None or self.device.type != "cuda":
                return 0.0
            start = time.perf_counter()
            slot_bytes = max((u.file_hi - u.file_lo for u in self._units), default=0)
            num_slots = min(self.ring_slots, len(self._units))
            slots = self._registered_slots(slot_bytes, num_slots)
            if slots is None:
                slots = [
                    torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=True)
                    for _ in range(num_slots)
                ]
            self._ring = [(t, memoryview(t.numpy())) for t in slots]
            self.ring_pin_s = time.perf_counter() - start
            return self.ring_pin_s

    def _registered_slots(self, slot_bytes: int, num_slots: int) -> list[torch.Tensor] | None:
        """The ring's slots as views of one registered block; None where not asked for, or
        refused by the driver (`ring_pinning` then reads "alloc")."""
        if self.ring_pinning != "register" or num_slots == 0:
            return None
        from snapfn.snapshot.cuda.host_registered import RegisteredHostMemory

        try:
            total = slot_bytes * num_slots
            self._ring_memory = RegisteredHostMemory(total, self.device, self.num_threads)
        except RestoreFailed:  # refused: torch's pinned allocation does the same, slower
            self.ring_pinning = "alloc"
            return None
        block = self._ring_memory.tensor
        return [block[k * slot_bytes : (k + 1) * slot_bytes] for k in range(num_slots)]

    def stream_into(self, dest: Mapping[str, torch.Tensor]) -> StreamReport:
        """Fill `dest` (exactly the table's names, shapes and dtypes) from the file."""
        self._check_dest(dest)
        ring_alloc_s = self.prepare()
        weights = self._chunk_weights() if self.verify == "device" else None
        fd = os.open(self.path, os.O_RDONLY)
        self._waited_s = 0.0
        try:
            self.layout.validate(os.fstat(fd).st_size)  # the file may have changed since init
            start = time.perf_counter()
            if self.device.type == "cuda":
                verify_s = self._stream_cuda(fd, device_bytes(dest), weights)
            else:
                verify_s = self._stream_cpu(fd, host_bytes(dest), weights)
            elapsed_s = time.perf_counter() - start
        finally:
            os.close(fd)
        num_bytes, n = self.layout.file_bytes, self.layout.num_chunks
        gbps = num_bytes / elapsed_s / 1e9 if elapsed_s > 0 else 0.0
        pinning = self.ring_pinning if self.device.type == "cuda" else ""
        return StreamReport(
            num_bytes,
            elapsed_s,
            gbps,
            sum(verify_s),
            n,
            self.verify,
            ring_alloc_s,
            self._waited_s,
            pinning,
            self.ring_pin_s,
        )

    def _wait_for(self, unit: Unit) -> None:
        """Following a download: block until the unit's chunks have arrived (see arrivals)."""
        if self.arrivals is None:
            return
        waited_s = self.arrivals.wait_for(unit.file_lo, unit.file_hi)
        with self._wait_lock:
            self._waited_s += waited_s

    def _chunk_weights(self) -> torch.Tensor:
        """The odd weights of one chunk's words on the device, made on first use only."""
        if self._weights is None:
            self._weights = odd_weights(-(-self.layout.chunk_bytes // 8), self.device)
        return self._weights

    def _check_dest(self, dest: Mapping[str, torch.Tensor]) -> None:
        for name in self.layout.tensors:
            if name not in dest:
                raise BadSnapshot(
                    f"tensor {name!r} is in the restore layout but has no destination"
                )
        for name, t in dest.items():
            entry = self.layout.tensors.get(name)
            if entry is None:
                raise BadSnapshot(f"destination {name!r} is not in the restore layout")
            if dtype_name(t.dtype) != entry.dtype or tuple(t.shape) != entry.shape:
                raise BadSnapshot(
                    f"tensor {name!r}: destination is {dtype_name(t.dtype)} {list(t.shape)}, "
                    f"the restore layout has {entry.dtype} {list(entry.shape)}"
                )
            if not t.is_contiguous() or not _on_device(t, self.device):
                raise ValueError(f"destination {name!r} must be contiguous on {self.device}")

    def _stream_cpu(
        self, fd: int, dest: dict[str, memoryview], weights: torch.Tensor | None
    ) -> list[float]:
        with _pools(self.num_threads) as (reads, hashes):
            reading = [reads.submit(self._read_into_tensors, fd, u, dest) for u in self._units]
            checks: list[Future] = []
            for unit, done in zip(self._units, reading, strict=True):
                checks += self._checks.submit(hashes, unit.chunks, done.result(), weights)
            return [c.result() for c in checks]

    def _read_into_tensors(
        self, fd: int, unit: Unit, dest: dict[str, memoryview]
    ) -> list[list[memoryview]]:
        views = [[piece_view(p, dest) for p in c.pieces] for c in unit.chunks]
        self._wait_for(unit)
        preadv_exact(fd, [v for vs in views for v in vs], unit.file_lo, self._iov_max, LAYOUT)
        return views

    def _stream_cuda(
        self, fd: int, dest: dict[str, torch.Tensor], weights: torch.Tensor | None
    ) -> list[float]:
        stream = torch.cuda.Stream(self.device)
        # NOTE: staging is allocated on the current stream before the copy stream waits on it,
        # and freed only after the copy stream is synchronized below
        ring = self._ring or []
        staged = None if weights is None else StagedCopies(self.layout, ring, weights, dest, stream)
        # NOTE: copies must not overtake work already queued on the destinations
        stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with _pools(self.num_threads) as (reads, hashes):
                if staged is None:
                    ship = self._ship_direct(dest, stream, hashes)
                    return [c.result() for c in self._pump_ring(fd, ship, reads)]
                self._pump_ring(fd, staged.ship, reads)
                if (bad := staged.first_mismatch()) is not None:
                    raise self._checks.failed(bad)
                return []
        finally:
            stream.synchronize()  # NOTE: every copy has landed before stream_into returns

    def _ship_direct(
        self, dest: dict[str, torch.Tensor], stream: torch.cuda.Stream, hashes: ThreadPoolExecutor
    ) -> Ship:
        """Pinned slot → tensors; "sha256" hashes the slot on the host meanwhile."""

        def ship(unit: Unit, k: int, slot: torch.Tensor, view: memoryview):
            checks = self._checks.submit(hashes, unit.chunks, slot_views(unit, view), None)
            return enqueue_copies(unit, slot, dest, stream), checks

        return ship

    def _pump_ring(self, fd: int, ship: Ship, reads: ThreadPoolExecutor) -> list[Future]:
        """Read → ship through the ring; a slot is refilled once its copy and checks are done."""
        ring, units = self._ring or [], self._units
        reading = {
            u: reads.submit(self._read_into_slot, fd, units[u], ring[u][1])
            for u in range(len(ring))
        }
        checks: list[Future] = []
        for u, unit in enumerate(units):
            reading.pop(u).result()
            slot, view = ring[u % len(ring)]
            copied, unit_checks = ship(unit, u % len(ring), slot, view)
            checks += unit_checks
            if (nxt := u + len(ring)) < len(units):
                reading[nxt] = reads.submit(self._refill, fd, units[nxt], view, copied, unit_checks)
        return checks

    def _read_into_slot(self, fd: int, unit: Unit, slot: memoryview) -> None:
        self._wait_for(unit)
        preadv_exact(fd, [slot[: unit.file_hi - unit.file_lo]], unit.file_lo, self._iov_max, LAYOUT)

    def _refill(
        self, fd: int, unit: Unit, slot: memoryview, copied: torch.cuda.Event, checks: list[Future]
    ) -> None:
        copied.synchronize()  # NOTE: the slot's last bytes are on their way to the GPU until here
        for check in checks:  # ... and being hashed until these finish (raises on a mismatch)
            check.result()
        self._read_into_slot(fd, unit, slot)


def _on_device(t: torch.Tensor, device: torch.device) -> bool:
    if device.index is None:
        return t.device.type == device.type
    return t.device == device


def load_layout_tensors(
    path: str | os.PathLike, layout: RestoreLayout, device: str | torch.device, **kwargs
) -> dict[str, torch.Tensor]:
    """Allocate the table's tensors on `device` and stream the file into them.

    `kwargs` go to `WeightStreamer` (num_threads, ring_slots, slot_bytes, verify).
    """
    dest = {
        name: torch.empty(e.shape, dtype=getattr(torch, e.dtype), device=device)
        for name, e in layout.tensors.items()
    }
    with WeightStreamer(path, layout, device=device, **kwargs) as streamer:
        streamer.stream_into(dest)
    return dest
