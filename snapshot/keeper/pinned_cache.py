"""Pinned host copies of a snapshot's weight files that outlive restores (tier 1 on CUDA).

    snapfn pin --snapshot DIR [--socket PATH]     the keeper (snapshot/keeper/daemon.py) holds the
                                                  files the process image's regions are filled
                                                  from in pinned host memory (PinnedCache)
    lease = keeper.request(address, path)         a prefetch helper: an fd of the pinned copy,
                                                  or a Miss saying why (no keeper, not pinned,
                                                  the file changed since); the keeper's own
                                                  prefetches copy from its mapping (`mapped`)

Why: a tier-1 restore's helper copies the weights page cache → pinned slots → GPU, and that CPU
copy tops out at 18–33 GB/s on the lent H200 machines (`bench/probes/fill_numa.py`), 0.6 s of an
8B restore. Pinned memory copies at the PCIe rate, 55 GB/s, but pinning is per process and costs
as much as the copy. A CUDA VMM allocation located on the host (CU_MEM_LOCATION_TYPE_HOST_NUMA) is
pinned and can be exported as a POSIX fd: the keeper makes one per file and fills it once; each
restore's helper imports the fd, maps it and copies from it (`bench/probes/host_vmm.py`: import
and map 0.06 s, 55.3 GB/s). The price: the files' bytes stay pinned in RAM while the keeper runs.

Protocol (the keeper's "file" op, SOCK_SEQPACKET, one request per connection): →
{"dev", "ino", "size", "mtime_ns"} of the file as the client sees it; ← {"ok": true, "identity",
"size", "alloc_bytes", "location"} with the fd, or {"ok": false, "reason"}. A copy is matched by
the file's identity (device, inode, size, modification time). The client (`client.request`)
trusts only a keeper of its own user or root (snapshot/unix_socket.py) and takes a lease only
for the identity it asked, of that file's size, in an allocation that holds it; the bytes are
checked where they land: the worker checks every chunk's sum64 on the GPU after the hand-over,
as it checks streamed weights, so a wrong copy is refused like a damaged file and the restore
falls back.

Backends: "cuda" (the above) and "memfd" (an unpinned memfd with the file's bytes: the protocol
without a GPU, for tests and for CPU machines, where nothing reads it).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from snapfn.snapshot.errors import RestoreFailed, one_line
from snapfn.snapshot.layout.preads import preadv_exact
from snapfn.snapshot.unix_socket import default_dir

MAX_MESSAGE = 1 << 16
# "cuda": a copy in CUDA host-NUMA memory, exportable; "page-cache": the file's page-cache pages
# registered in place (the keeper's own prefetches only); "memfd": the protocol without a GPU
BACKENDS = ("cuda", "page-cache", "memfd")
LOCATIONS = ("host_numa", "memfd")  # where a leased copy is: "cuda" copies, "memfd" copies
FILL_THREADS = 8
FILL_BYTES = 64 << 20


@dataclass(frozen=True)
class FileIdentity:
    """What a pinned copy is matched on: the file as `os.stat` sees it."""

    dev: int
    ino: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: Path | str) -> FileIdentity:
        st = os.stat(path)
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def to_json(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Lease:
    """A pinned copy handed to a client: its fd (the client closes it) and its sizes."""

    fd: int
    size: int  # the file's bytes
    alloc_bytes: int  # the allocation's, rounded up to its granularity
    location: str  # "host_numa" (CUDA) or "memfd"


@dataclass(frozen=True)
class Miss:
    """No pinned copy for this file, and why."""

    reason: str


def default_socket(environ: Mapping[str, str]) -> str:
    """Where `snapfn keeper` / `snapfn pin` listens and a restore looks, unless told otherwise:
    keeper.sock in this user's private socket directory (snapshot/unix_socket.py)."""
    return str(default_dir(environ) / "keeper.sock")


@dataclass
class _Pinned:
    identity: FileIdentity
    fd: int
    alloc_bytes: int
    release: Callable[[], None]
    va: int = 0  # where the keeper maps it, device-readable (cuda), else 0


class PinnedCache:
    """The keeper's files, each copied into a pinned allocation of its own (served by daemon.py)."""

    def __init__(self, backend: str = "cuda", device: int = 0) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
        self.backend, self.device = backend, device
        self._files: dict[FileIdentity, _Pinned] = {}
        self._cu: Any = None
        self._ctx: Any = None

    def add(self, path: Path | str) -> FileIdentity:
        """Copy `path` into a pinned allocation of its own; returns the identity it is served by."""
        identity = FileIdentity.of(path)
        if identity in self._files:
            return identity
        make = {"cuda": self._make_cuda, "page-cache": self._register, "memfd": _make_memfd}
        self._files[identity] = make[self.backend](Path(path), identity)
        return identity

    def lease(self, asked: FileIdentity) -> tuple[int, dict[str, Any]] | str:
        """The fd of `asked`'s pinned copy and the reply that goes with it, or why there is none."""
        found = self._files.get(asked)
        if found is None:
            return self._why_not(asked)
        if found.fd < 0:
            return "page-cache pins serve the keeper's own prefetches only (it makes the regions)"
        location = "host_numa" if self.backend == "cuda" else "memfd"
        return found.fd, {
            "identity": asked.to_json(),
            "size": asked.size,
            "alloc_bytes": found.alloc_bytes,
            "location": location,
        }

    def mapped(self, path: Path | str) -> tuple[int, int] | Miss:
        """(address, size) of `path`'s pinned copy as mapped here, readable by the device's
        copies (the keeper's own prefetches copy from it), or a Miss saying why not."""
        try:
            asked = FileIdentity.of(path)
        except OSError as exc:
            return Miss(one_line(str(exc)))
        found = self._files.get(asked)
        if found is None:
            return Miss(self._why_not(asked))
        if not found.va:
            return Miss(f"{self.backend} copies are not mapped for the device")
        return found.va, asked.size

    def _why_not(self, asked: FileIdentity) -> str:
        same_file = [i for i in self._files if (i.dev, i.ino) == (asked.dev, asked.ino)]
        if same_file:
            return "the file changed since it was pinned (size or modification time)"
        return "this file is not pinned here"

    def close(self) -> None:
        files, self._files = self._files, {}
        for pinned in files.values():
            if pinned.fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(pinned.fd)
            pinned.release()

    @property
    def pinned_bytes(self) -> int:
        return sum(i.size for i in self._files)

    def _driver(self) -> Any:
        """The driver, with the device's primary context retained (once) and current in the
        calling thread."""
        from snapfn.snapshot.cuda.driver import driver, ok, use_primary_context

        if self._cu is None:
            cu = driver()
            self._ctx = use_primary_context(cu, self.device)[1]
            self._cu = cu
        ok(self._cu.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
        return self._cu

    def _make_cuda(self, path: Path, identity: FileIdentity) -> _Pinned:
        from snapfn.snapshot.cuda.driver import (
            access_desc,
            allocation_prop,
            fd_handle_type,
            map_handle,
            ok,
            unmap,
        )

        cu = self._driver()
        node = _numa_node(cu, self.device)
        prop = allocation_prop(cu, "HOST_NUMA", node)
        grain = int(ok(cu.cuMemGetAllocationGranularity(prop, 0), "granularity"))
        alloc_bytes = max(grain, -(-identity.size // grain) * grain)
        handle = ok(cu.cuMemCreate(alloc_bytes, prop, 0), "cuMemCreate(host)")
        try:
            # NOTE: the device may read it too: the keeper's own prefetches copy from here
            accesses = [access_desc(cu, "HOST_NUMA", node), access_desc(cu, "DEVICE", self.device)]
            va = map_handle(cu, handle, alloc_bytes, accesses, grain)
        except RestoreFailed:
            cu.cuMemRelease(handle)
            raise

        def release() -> None:
            unmap(cu, va, alloc_bytes)
            cu.cuMemRelease(handle)

        try:
            _fill_from_file(path, va, identity.size)
            fd = int(ok(cu.cuMemExportToShareableHandle(handle, fd_handle_type(cu), 0), "export"))
        except BaseException:
            release()
            raise

        return _Pinned(identity, fd, alloc_bytes, release, va)

    def _register(self, path: Path, identity: FileIdentity) -> _Pinned:
        """The file's own page-cache pages, mapped and pinned in place (cuMemHostRegister,
        read-only): no second copy in RAM, copied to the GPU at the PCIe rate like a pinned
        copy, but only by this process (nothing to export)."""
        from snapfn.snapshot.cuda.driver import ok
        from snapfn.snapshot.keeper.file_mapping import FileMapping

        cu = self._driver()
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            mapping = FileMapping(fd, identity.size)
        finally:
            os.close(fd)  # the mapping keeps the file
        page = os.sysconf("SC_PAGE_SIZE")
        nbytes = -(-mapping.size // page) * page
        try:
            # NOTE: CU_MEMHOSTREGISTER_READ_ONLY (0x08): page-cache pages, pinned unwritable
            ok(cu.cuMemHostRegister(mapping.address, nbytes, 0x08), "cuMemHostRegister")
        except RestoreFailed:
            mapping.close()
            raise

        def release() -> None:
            cu.cuMemHostUnregister(mapping.address)
            mapping.close()

        try:
            va = int(ok(cu.cuMemHostGetDevicePointer(mapping.address, 0), "device pointer"))
        except RestoreFailed:
            release()
            raise
        return _Pinned(identity, -1, nbytes, release, va)


def _make_memfd(path: Path, identity: FileIdentity) -> _Pinned:
    fd = os.memfd_create(f"snapfn-pinned-{path.name}", os.MFD_CLOEXEC)
    with open(path, "rb") as src:
        while chunk := src.read(FILL_BYTES):
            os.write(fd, chunk)
    return _Pinned(identity, fd, identity.size, lambda: None)


def _fill_from_file(path: Path, address: int, size: int) -> None:
    """pread `path` into host memory at `address` on FILL_THREADS threads."""
    import ctypes

    view = memoryview((ctypes.c_ubyte * max(size, 1)).from_address(address)).cast("B")
    units = iter(range(0, size, FILL_BYTES))
    lock, errors = threading.Lock(), []
    fd = os.open(path, os.O_RDONLY)

    def reader() -> None:
        try:
            while True:
                with lock:
                    offset = next(units, None)
                if offset is None:
                    return
                preadv_exact(
                    fd, [view[offset : min(size, offset + FILL_BYTES)]], offset, what=str(path)
                )
        except Exception as exc:  # noqa: BLE001 - raised below
            errors.append(exc)

    threads = [threading.Thread(target=reader) for _ in range(FILL_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    os.close(fd)
    if errors:
        raise errors[0]


def _numa_node(cu, device: int) -> int:
    """The GPU's host NUMA node (0 when the machine does not say, as on the lent VM)."""
    from snapfn.snapshot.cuda.driver import ok

    bus = ok(cu.cuDeviceGetPCIBusId(32, device), "cuDeviceGetPCIBusId")
    bus = (bus.decode() if isinstance(bus, bytes) else str(bus)).split("\0")[0].lower()
    try:
        return max(0, int(Path(f"/sys/bus/pci/devices/{bus}/numa_node").read_text()))
    except (OSError, ValueError):
        return 0


# ---- snapfn pin -----------------------------------------------------------------------------------
def files_to_pin(snapshot_dir: Path) -> list[Path]:
    """The files a tier-1 restore's helper fills the worker's regions from."""
    from snapfn.snapshot.errors import bad_snapshot
    from snapfn.snapshot.keeper.region_prefetch import RegionSpec
    from snapfn.snapshot.portable.format import read_manifest

    manifest = read_manifest(snapshot_dir)
    specs = [RegionSpec.from_json(s) for s in (manifest.get("process") or {}).get("regions", [])]
    paths = sorted({snapshot_dir / s.path for s in specs if s.fill == "file"})
    if not paths:
        raise bad_snapshot(snapshot_dir, "holds no process image whose regions are read from files")
    return paths
