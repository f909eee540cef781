"""The prefetch helper: makes a restoring worker's regions and fills them, then hands them over.

    python -m snapfn.snapshot.keeper.region_fill '{"snapshot_dir", "address", "specs", "timeout_s"}'

Run by `region_prefetch.PrefetchHelper` beside criu restore (the protocol, the specs and the
worker's side are in region_prefetch.py). In a CUDA context of its own: one `cuMemCreate` per
region with POSIX-fd handles; "file" regions mapped here and filled by reader threads (pread into
pinned slots, copies on each reader's stream), "zero" regions mapped and zeroed; then the fds go
to the first connection on the unix socket at `address` with {"ok", "error", "figures",
"regions"}, and after the worker's ack everything here is let go (the worker's imports keep the
memory). A failure is handed over as its reason; the worker then makes its regions itself.
The socket's directory must be private (the restorer's `prefetch_doc` makes one), and only a
peer of this user or root (SO_PEERCRED, snapshot/unix_socket.py) is handed the fds; another is
refused and the wait goes on. A pinned copy from a keeper is used only when `client.request`
took its lease (a trusted keeper, the file's identity and size), and the bytes it fills are
checked by the worker like streamed ones. Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from snapfn.snapshot.cuda.driver import (
    access_desc,
    allocation_prop,
    driver,
    fd_handle_type,
    map_handle,
    unmap,
    use_primary_context,
)
from snapfn.snapshot.cuda.driver import ok as _ok
from snapfn.snapshot.errors import RestoreFailed, one_line
from snapfn.snapshot.keeper.file_mapping import FileMapping
from snapfn.snapshot.keeper.pinned_cache import PinnedCache
from snapfn.snapshot.keeper.region_prefetch import MAX_MESSAGE, RegionSpec
from snapfn.snapshot.layout.preads import preadv_exact
from snapfn.snapshot.unix_socket import peer_problem, private_dir_problem

SLOT_BYTES = 16 << 20  # pinned staging buffer per reader, two per reader
READS = ("pread", "register")  # how readers get file bytes to the device (see _Fill)
REGISTER_UNIT_BYTES = 64 << 20  # "register": the file range a reader pins and copies at once


@dataclass
class _Made:
    spec: RegionSpec
    handle: Any
    fd: int
    va: int = 0  # mapped here too (fill "file" / "zero"), else 0


class _Fill:
    """One file copied into its region, started on creation. "pread": readers pread into
    pinned slots, each copying its slot to the device on its own stream while it reads the
    next. "register" (an experiment): the file is mapped, and each reader pins a unit of its
    page-cache pages read-only (cuMemHostRegister) and copies it straight from there."""

    def __init__(self, prefetch: RegionPrefetch, made: _Made, ctx: Any) -> None:
        path = prefetch.snapshot_dir / made.spec.path
        self.fd = os.open(path, os.O_RDONLY)
        file_bytes, lo = os.fstat(self.fd).st_size, made.spec.offset
        try:
            self.size = _range_bytes(made.spec, file_bytes)  # the bytes to copy
        except RestoreFailed:
            os.close(self.fd)
            raise
        unit = REGISTER_UNIT_BYTES if prefetch.read == "register" else SLOT_BYTES
        self._units = iter(range(lo, lo + self.size, unit))
        self._lock = threading.Lock()
        self.errors: list[Exception] = []
        self.seconds, self._start = 0.0, time.perf_counter()
        source, reader = self.fd, _reader
        if prefetch.read == "register":
            source, reader = FileMapping(self.fd, file_bytes), _registered_reader
        self._mapping = source if prefetch.read == "register" else None
        # NOTE: file byte `lo + k` lands at `made.va + k`: readers copy to `va + offset - lo`
        end, va = lo + self.size, made.va - lo
        args = (prefetch._cu, ctx, source, end, va, self._next_unit, self.errors)
        self.readers = [
            threading.Thread(target=reader, args=args, daemon=True)
            for _ in range(prefetch.num_threads)
        ]
        for reader in self.readers:
            reader.start()

    def _next_unit(self) -> int | None:
        with self._lock:
            return next(self._units, None)

    def join(self, raise_error: bool = True) -> int:
        """Wait for the readers; the bytes copied (raises the first reader's error)."""
        for reader in self.readers:
            reader.join()
        if self._mapping is not None:
            self._mapping.close()
            self._mapping = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            self.seconds = time.perf_counter() - self._start
        if self.errors and raise_error:
            raise self.errors[0]
        return self.size


class RegionPrefetch:
    """Makes and fills the regions, then serves them once on a unix socket at `address`."""

    def __init__(
        self,
        specs: Sequence[RegionSpec],
        snapshot_dir: Path,
        address: str,
        *,
        num_threads: int = 8,
        read: str = "pread",
        timeout_s: float = 120.0,
        pinned: str = "",
        local: PinnedCache | None = None,
    ) -> None:
        if read not in READS:
            raise ValueError(f"read must be one of {READS}, not {read!r}")
        self.specs, self.snapshot_dir = list(specs), Path(snapshot_dir)
        self.num_threads, self.timeout_s, self.read = max(1, num_threads), timeout_s, read
        self.pinned = (
            pinned  # a pinned-copy keeper's socket (snapshot/keeper/pinned_cache.py), or ""
        )
        self.local = local  # run by the keeper: its own pinned copies, mapped in this process
        self._cancelled = threading.Event()
        self._imports: list[
            tuple[int, int, Any]
        ] = []  # pinned copies mapped here: va, size, handle
        untrusted = private_dir_problem(os.path.dirname(os.path.abspath(address)))
        if untrusted is not None:
            raise RestoreFailed(f"the regions' socket {address} is not private: {untrusted}")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._listener.bind(address)
        self._listener.listen(1)
        self._made: list[_Made] = []
        self._cu: Any = None
        self._ctx_device: Any = None
        self.error: str | None = None
        self.figures: dict[str, Any] = {}

    def run(self) -> bool:
        """Make and fill, serve the first connection, let go. True when the regions were
        made and handed over (a failure is handed over as its reason instead)."""
        start = time.perf_counter()
        try:
            if not self.specs:
                raise RestoreFailed("no regions to make")
            self._make_and_fill(start)
        except Exception as exc:  # noqa: BLE001 - reported to the worker, which falls back
            self.error = one_line(f"{type(exc).__name__}: {exc}")
            self._release()
        self.figures["seconds"] = round(time.perf_counter() - start, 4)
        try:
            return self._serve() and self.error is None
        finally:
            self._listener.close()
            self._release()

    def _make_and_fill(self, start: float) -> None:
        """Context → the file-backed regions, their fill started → the other regions (the KV
        pool zeroed) while the readers run → wait for all. Figures are seconds since start."""
        cu = self._cu = driver()
        devices = {s.device for s in self.specs}
        if len(devices) != 1:
            raise RestoreFailed(f"regions on devices {sorted(devices)}: one device expected")
        self._ctx_device, ctx = use_primary_context(cu, devices.pop())
        self.figures["context_s"] = round(time.perf_counter() - start, 4)
        prop = allocation_prop(cu, "DEVICE", self.specs[0].device)
        ordered = sorted(self.specs, key=lambda s: s.fill != "file")
        fills: list[_Fill] = []
        pinned_bytes = 0
        stream = _ok(cu.cuStreamCreate(1), "cuStreamCreate")  # CU_STREAM_NON_BLOCKING
        try:
            for spec in ordered:
                handle = _ok(cu.cuMemCreate(spec.nbytes, prop, 0), f"cuMemCreate({spec.name})")
                made = _Made(spec, handle, -1)
                self._made.append(made)
                fd = cu.cuMemExportToShareableHandle(handle, fd_handle_type(cu), 0)
                made.fd = int(_ok(fd, "cuMemExportToShareableHandle"))
                if spec.fill != "none":
                    made.va = _map(cu, handle, spec)
                if spec.fill == "file":
                    copied = None
                    try:
                        pinned = self.local is not None or self.pinned
                        copied = self._copy_pinned(made, stream) if pinned else None
                    except RestoreFailed as exc:  # the files are still there: read them
                        self.figures["pinned_miss"] = str(exc)
                    if copied is None:
                        fills.append(_Fill(self, made, ctx))
                    pinned_bytes += copied or 0
                elif spec.fill == "zero":
                    _ok(cu.cuMemsetD32Async(made.va, 0, spec.nbytes // 4, stream), "memset")
            self.figures["made_s"] = round(time.perf_counter() - start, 4)
            copied = sum(fill.join() for fill in fills)
            _ok(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")
            self._drop_imports()
        finally:
            for fill in fills:
                fill.join(raise_error=False)
            cu.cuStreamDestroy(stream)
        self._made.sort(key=lambda m: self.specs.index(m.spec))
        fill_s = max((f.seconds for f in fills), default=0.0)
        self.figures.update(
            threads=self.num_threads,
            read=self.read,
            filled_s=round(time.perf_counter() - start, 4),
            file_bytes=copied + pinned_bytes,
            pinned_bytes=pinned_bytes,
            gbps=round(copied / fill_s / 1e9, 2) if fill_s > 0 else 0.0,
            regions=len(self._made),
            region_bytes=sum(m.spec.nbytes for m in self._made),
        )

    def _copy_pinned(self, made: _Made, stream: Any) -> int | None:
        """Copy `made`'s file from the keeper's pinned copy (PCIe rate, no CPU copy); None,
        with the reason in the figures, when the keeper has none."""
        from snapfn.snapshot.keeper import client as keeper
        from snapfn.snapshot.keeper import pinned_cache

        path, lo = self.snapshot_dir / made.spec.path, made.spec.offset
        if self.local is not None:
            found = self.local.mapped(path)
            if isinstance(found, pinned_cache.Miss):
                self.figures["pinned_miss"] = found.reason
                return None
            va, size = found
            n = _range_bytes(made.spec, size)
            _ok(self._cu.cuMemcpyAsync(made.va, va + lo, n, stream), "cuMemcpyAsync(pinned)")
            return n
        lease = keeper.request(self.pinned, path)
        if isinstance(lease, pinned_cache.Miss):
            self.figures["pinned_miss"] = lease.reason
            return None
        cu = self._cu
        try:
            if lease.location != "host_numa":
                raise RestoreFailed(f"pinned copy of {made.spec.path} is in {lease.location}")
            n = _range_bytes(made.spec, lease.size)
            handle = _ok(cu.cuMemImportFromShareableHandle(lease.fd, fd_handle_type(cu)), "import")
        finally:
            os.close(lease.fd)
        try:
            access = [access_desc(cu, "DEVICE", made.spec.device)]
            va = map_handle(cu, handle, lease.alloc_bytes, access)
        except RestoreFailed:
            cu.cuMemRelease(handle)
            raise
        self._imports.append((va, lease.alloc_bytes, handle))
        _ok(cu.cuMemcpyAsync(made.va, va + lo, n, stream), "cuMemcpyAsync(pinned)")
        return n

    def _drop_imports(self) -> None:
        """Unmap and release the pinned copies mapped here (the keeper keeps them)."""
        cu, imports, self._imports = self._cu, self._imports, []
        for va, nbytes, handle in imports:
            unmap(cu, va, nbytes)
            cu.cuMemRelease(handle)

    def cancel(self) -> None:
        """Stop waiting for the worker (the restore that wanted the regions is gone): the
        memory is let go. A no-op once the regions were handed over."""
        self._cancelled.set()

    def _serve(self) -> bool:
        """Hand the fds to the first trusted connection and wait for its ack; False if none
        came (timed out or cancelled). A peer of another user is refused (its reason in the
        figures: "refused") and the wait goes on."""
        self._listener.settimeout(0.05)
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                if self._cancelled.is_set() or time.monotonic() > deadline:
                    return False
                continue
            except OSError:
                return False
            untrusted = peer_problem(conn)
            if untrusted is None:
                break
            self.figures["refused"] = untrusted
            refusal = {"ok": False, "error": f"not trusted: {untrusted}"}
            with conn, contextlib.suppress(OSError):
                conn.send(json.dumps(refusal).encode())
        with conn:
            conn.settimeout(self.timeout_s)
            message = {"ok": self.error is None, "error": self.error, "figures": self.figures}
            message["regions"] = [m.spec.address for m in self._made] if self.error is None else []
            fds = [m.fd for m in self._made] if self.error is None else []
            try:
                socket.send_fds(conn, [json.dumps(message).encode()], fds)
                return conn.recv(MAX_MESSAGE) == b"mapped"  # its imports hold the memory now
            except OSError:
                return False

    def _release(self) -> None:
        """Let go of the restorer's side of every region (idempotent)."""
        if self._imports:  # a failure before the copies were waited for
            with contextlib.suppress(Exception):
                self._cu.cuCtxSynchronize()
            self._drop_imports()
        cu, made, self._made = self._cu, self._made, []
        for m in made:
            if m.fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(m.fd)
            if m.va:
                unmap(cu, m.va, m.spec.nbytes)
            cu.cuMemRelease(m.handle)
        if self._ctx_device is not None:
            cu.cuDevicePrimaryCtxRelease(self._ctx_device)
            self._ctx_device = None


def _reader(cu, ctx, fd: int, size: int, va: int, next_unit, errors: list) -> None:
    """Copy units [offset, min(offset + SLOT_BYTES, size)) of `fd` to `va + offset` (`va`:
    where file byte 0 would land) until `next_unit` has none left."""
    slots: list[tuple[int, memoryview, Any]] = []
    stream = None
    try:
        _ok(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        stream = _ok(cu.cuStreamCreate(1), "cuStreamCreate")
        k = 0
        while (offset := next_unit()) is not None:
            if len(slots) < 2:
                slots.append(_pinned_slot(cu))
            ptr, view, event = slots[k % 2]
            if k >= 2:
                _ok(cu.cuEventSynchronize(event), "cuEventSynchronize")  # its last copy is done
            n = min(SLOT_BYTES, size - offset)
            preadv_exact(fd, [view[:n]], offset)
            _ok(cu.cuMemcpyHtoDAsync(va + offset, ptr, n, stream), "cuMemcpyHtoDAsync")
            _ok(cu.cuEventRecord(event, stream), "cuEventRecord")
            k += 1
    except Exception as exc:  # noqa: BLE001 - raised by _Fill.join
        errors.append(exc)
    finally:
        if stream is not None:
            cu.cuStreamSynchronize(stream)
            cu.cuStreamDestroy(stream)
        for ptr, _, event in slots:
            cu.cuEventDestroy(event)
            cu.cuMemFreeHost(ptr)


def _registered_reader(cu, ctx, mapping: FileMapping, size, va, next_unit, errors) -> None:
    pending: list[tuple[int, Any]] = []  # (host address registered, event of its copy)
    stream = None
    page = os.sysconf("SC_PAGE_SIZE")

    def finish_oldest() -> None:
        host, event = pending.pop(0)
        _ok(cu.cuEventSynchronize(event), "cuEventSynchronize")
        cu.cuEventDestroy(event)
        _ok(cu.cuMemHostUnregister(host), "cuMemHostUnregister")

    try:
        _ok(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        stream = _ok(cu.cuStreamCreate(1), "cuStreamCreate")
        while (offset := next_unit()) is not None:
            if len(pending) == 2:
                finish_oldest()
            n = min(REGISTER_UNIT_BYTES, size - offset)
            host = mapping.address + offset
            flags = 0x08  # CU_MEMHOSTREGISTER_READ_ONLY: page-cache pages, pinned unwritable
            _ok(cu.cuMemHostRegister(host, -(-n // page) * page, flags), "cuMemHostRegister")
            event = _ok(cu.cuEventCreate(2), "cuEventCreate")
            pending.append((host, event))
            _ok(cu.cuMemcpyHtoDAsync(va + offset, host, n, stream), "cuMemcpyHtoDAsync")
            _ok(cu.cuEventRecord(event, stream), "cuEventRecord")
        while pending:
            finish_oldest()
    except Exception as exc:  # noqa: BLE001 - raised by _Fill.join
        errors.append(exc)
    finally:
        if stream is not None:
            cu.cuStreamSynchronize(stream)
            cu.cuStreamDestroy(stream)
        for host, event in pending:
            cu.cuEventDestroy(event)
            cu.cuMemHostUnregister(host)


def prefetch_from_doc(doc: dict[str, Any], local: PinnedCache | None = None) -> RegionPrefetch:
    """The RegionPrefetch a `prefetch_doc` describes (listening at its address)."""
    return RegionPrefetch(
        [RegionSpec.from_json(s) for s in doc["specs"]],
        Path(doc["snapshot_dir"]),
        doc["address"],
        num_threads=int(doc.get("num_threads", 8)),
        read=doc.get("read", "pread"),
        timeout_s=float(doc["timeout_s"]),
        pinned=str(doc.get("pinned", "")),
        local=local,
    )


def main(argv: list[str]) -> int:
    prefetch = prefetch_from_doc(json.loads(argv[1]))
    ok = prefetch.run()
    if prefetch.error is not None:
        print(f"[snapfn prefetch] {prefetch.error}", file=sys.stderr, flush=True)
    return 0 if ok else 1


def _range_bytes(spec: RegionSpec, file_bytes: int) -> int:
    """The bytes a "file" region takes from a file of `file_bytes`: from its offset up to its
    size or the file's end; RestoreFailed when a whole file (offset 0) is larger than it."""
    if spec.offset == 0 and file_bytes > spec.nbytes:
        raise RestoreFailed(f"{spec.path}: {file_bytes} bytes do not fit region {spec.name!r}")
    return max(0, min(file_bytes, spec.offset + spec.nbytes) - spec.offset)


# ---- driver helpers ------------------------------------------------------------------------------
def _map(cu, handle, spec: RegionSpec) -> int:
    return map_handle(cu, handle, spec.nbytes, [access_desc(cu, "DEVICE", spec.device)])


def _pinned_slot(cu) -> tuple[int, memoryview, Any]:
    ptr = int(_ok(cu.cuMemHostAlloc(SLOT_BYTES, 0), "cuMemHostAlloc"))
    view = memoryview((ctypes.c_ubyte * SLOT_BYTES).from_address(ptr)).cast("B")
    event = _ok(cu.cuEventCreate(2), "cuEventCreate")  # CU_EVENT_DISABLE_TIMING
    return ptr, view, event


if __name__ == "__main__":
    sys.exit(main(sys.argv))
