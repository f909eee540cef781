"""Page-cache pre-warm, residency and drop for snapshot files (Linux; never imports torch).

Contract:

- `residency(paths)` maps each file (`mmap` + `mincore` through ctypes, nothing is read) and
  counts the pages the kernel holds in its page cache. An empty file has no pages and counts
  as fully resident, so an all-empty set reports `fraction == 1.0`.
- `prewarm(paths)` reads every byte of every file with a pool of threads, each read one
  `block_bytes` range (`os.preadv` into a reusable per-thread buffer), so that a later restore
  reads from memory instead of disk. It reports bytes, seconds, GB/s and residency before/after.
- `read_ahead(paths)` reads the files into the page cache on a daemon thread, in order, one
  `READ_AHEAD_BLOCK` at a time into one reused buffer, and returns at once, so that a
  restore's first stages (its interpreter's imports) run while the disk reads. (Not
  `POSIX_FADV_WILLNEED`: the kernel caps one advice at its readahead window, a few MB.) It
  reads nothing where the files are mostly resident already or would not fit the memory the
  kernel has free (they would evict each other), and says which; that check runs on the thread
  too (`mincore` over a 16 GB file walks 4M pages: 0.3 s on the 2-core CPU machine). With
  `io_class="idle"` its thread asks the disk to serve the process's other reads first (`ioprio.py`).
- `drop(paths)` asks the kernel to evict the files' clean pages (`POSIX_FADV_DONTNEED`; no fsync
  is done, so dirty pages stay) and says whether residency actually went down. Writing "1" to
  /proc/sys/vm/drop_caches (every clean page of every file on the host) happens only when the
  caller asks for it and runs as root.

Used by the init phase (pre-warm stage), by the benchmark (cold vs warm reads) and by doctor.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import os
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

_DROP_CACHES = Path("/proc/sys/vm/drop_caches")
_LOW_BIT = bytes(b & 1 for b in range(256))  # mincore byte -> 1 if the page is resident


@dataclass(frozen=True)
class ResidencyReport:
    """How much of a set of files sits in the page cache."""

    num_files: int
    total_bytes: int
    resident_bytes: int
    fraction: float  # resident share of the bytes, in [0, 1]; 1.0 when there are no bytes


@dataclass(frozen=True)
class PrewarmReport:
    """What one `prewarm` call read and how fast."""

    num_bytes: int
    elapsed_s: float
    gbps: float
    before: ResidencyReport
    after: ResidencyReport


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc


def _raise_errno(what: str, path: Path) -> NoReturn:
    err = ctypes.get_errno()
    raise OSError(err, f"{what}: {os.strerror(err)}", str(path))


def _resident_bytes(path: Path) -> tuple[int, int]:
    """(file size, resident bytes) of one file; the last page counts only its in-file part."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0, 0
        libc = _libc()
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            _raise_errno("mmap", path)
        try:
            page_bytes = mmap.PAGESIZE
            num_pages = (size + page_bytes - 1) // page_bytes
            vec = (ctypes.c_ubyte * num_pages)()
            if libc.mincore(addr, size, vec) != 0:
                _raise_errno("mincore", path)
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    flags = bytes(vec)
    resident_pages = flags.translate(_LOW_BIT).count(1)
    last_resident = flags[-1] & 1
    tail_missing = (num_pages * page_bytes - size) if last_resident else 0
    return size, resident_pages * page_bytes - tail_missing


def residency(paths: Iterable[str | os.PathLike]) -> ResidencyReport:
    """Page-cache residency of `paths` (Linux `mincore`); reads no file data."""
    num_files = total = resident = 0
    for path in paths:
        size, got = _resident_bytes(Path(path))
        num_files += 1
        total += size
        resident += got
    return ResidencyReport(num_files, total, resident, resident / total if total else 1.0)


def _read_range(fd: int, offset: int, num_bytes: int, local: threading.local, block: int) -> int:
    buf = getattr(local, "buf", None)
    if buf is None:
        buf = local.buf = memoryview(bytearray(block))
    done = 0
    while done < num_bytes:
        got = os.preadv(fd, [buf[: num_bytes - done]], offset + done)
        if got == 0:
            break  # the file shrank under us; count what was read
        done += got
    return done


def _read_all(paths: list[Path], num_threads: int, block_bytes: int) -> int:
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    try:
        jobs = []
        for fd in fds:
            size = os.fstat(fd).st_size
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            jobs += [(fd, o, min(block_bytes, size - o)) for o in range(0, size, block_bytes)]
        local = threading.local()
        with ThreadPoolExecutor(max(1, num_threads), thread_name_prefix="prewarm") as pool:
            sizes = pool.map(lambda j: _read_range(*j, local, block_bytes), jobs)
            return sum(sizes)
    finally:
        for fd in fds:
            os.close(fd)


READ_AHEAD_BLOCK = 8 << 20  # bytes one read of the read-ahead takes: it notices a stop between
READ_AHEAD_RESIDENT = 0.9  # resident share above which a read-ahead starts nothing
READ_AHEAD_MEMORY_SHARE = 0.5  # of MemAvailable, the most a read-ahead may ask for


class ReadAhead:
    """A `read_ahead` in flight: `stop()` ends it between ranges; `figures()` says what it did;
    `check`: its thread first decides whether to read at all (`_why_not_read`)."""

    def __init__(
        self,
        paths: list[Path],
        skipped: str | None = None,
        check: bool = False,
        io_class: str | None = None,
    ) -> None:
        self.paths = paths
        self.skipped = skipped
        self._check = check
        self.io_class = io_class  # its thread's I/O class (ioprio.py); None: the process's
        self.io_class_error: str | None = None
        self.read_bytes = 0
        self.seconds = 0.0
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="snapfn-readahead", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        start = time.perf_counter()
        if self._check and (why := _why_not_read(self.paths)) is not None:
            self.skipped = why
            return
        if self.io_class is not None:
            from snapfn.snapshot.portable.ioprio import set_thread_class

            self.io_class_error = set_thread_class(self.io_class)
        buf = memoryview(bytearray(READ_AHEAD_BLOCK))
        try:
            for path in self.paths:
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                    offset = 0
                    while not self._stop.is_set():
                        got = os.preadv(fd, [buf], offset)  # the GIL is let go while it reads
                        if got == 0:
                            break
                        offset += got
                        self.read_bytes += got
                finally:
                    os.close(fd)
        except OSError as exc:  # advice only: a restore reads the files itself all the same
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.seconds = time.perf_counter() - start

    def stop(self) -> None:
        self._stop.set()

    def wait(self, timeout_s: float | None = None) -> None:
        """Until its thread ends (reading or deciding not to), at most `timeout_s`."""
        if self._thread is not None:
            self._thread.join(timeout_s)

    def figures(self) -> dict[str, object]:
        if self.skipped is not None:
            return {"skipped": self.skipped}
        done = self._thread is not None and not self._thread.is_alive()
        out: dict[str, object] = {"read_bytes": self.read_bytes, "done": done}
        if done:
            out["seconds"] = round(self.seconds, 3)
        if self.error is not None:
            out["error"] = self.error
        if self.io_class is not None:
            from snapfn.snapshot.portable.ioprio import scheduler

            out["io_class"] = self.io_class_error or self.io_class
            out["scheduler"] = scheduler(self.paths[0])
        return out


def read_ahead(paths: Iterable[str | os.PathLike], io_class: str | None = None) -> ReadAhead:
    """Start reading `paths` into the page cache in the background (see the module docstring);
    the returned job has started, or says in `skipped` why not. `io_class` ("idle"): its
    thread's I/O class, so that the disk serves the process's other reads first (ioprio.py)."""
    files = [Path(p) for p in paths if Path(p).is_file()]
    if not files:
        return ReadAhead(files, skipped="no files")
    job = ReadAhead(files, check=True, io_class=io_class)
    job._start()
    return job


def _why_not_read(files: list[Path]) -> str | None:
    """Why a read-ahead of `files` should read nothing (see the module docstring), or None."""
    try:
        held = residency(files)
    except OSError as exc:
        return f"residency unknown ({exc.strerror})"
    if held.fraction >= READ_AHEAD_RESIDENT:
        return f"{held.fraction:.0%} resident already"
    free = _mem_available()
    missing = held.total_bytes - held.resident_bytes
    if free is not None and missing > free * READ_AHEAD_MEMORY_SHARE:
        return f"{missing / 1e9:.1f} GB to read, {free / 1e9:.1f} GB of memory free"
    return None


def _mem_available() -> int | None:
    """The kernel's estimate of memory free for new pages (bytes), None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def prewarm(
    paths: Iterable[str | os.PathLike], num_threads: int = 16, block_bytes: int = 16 << 20
) -> PrewarmReport:
    """Read every byte of `paths` in parallel so that they sit in the page cache."""
    files = [Path(p) for p in paths]
    before = residency(files)
    start = time.perf_counter()
    num_bytes = _read_all(files, num_threads, block_bytes)
    elapsed_s = time.perf_counter() - start
    gbps = num_bytes / elapsed_s / 1e9 if elapsed_s > 0 else 0.0
    return PrewarmReport(num_bytes, elapsed_s, gbps, before, residency(files))


def drop(paths: Iterable[str | os.PathLike], *, drop_caches: bool = False) -> bool:
    """Evict the files' clean pages from the page cache; True when they are gone or fewer.

    Returns whether the kernel actually dropped something: residency went down, or nothing was
    resident to begin with. `POSIX_FADV_DONTNEED` is advice: tmpfs and overlay-backed files may
    ignore it, and dirty (unsynced) pages stay. `drop_caches=True` also writes "1" to
    /proc/sys/vm/drop_caches — host-wide — and only when running as root; otherwise it is not
    attempted and the return value tells whether the per-file advice was enough.
    """
    files = [Path(p) for p in paths]
    before = residency(files)
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    if drop_caches and os.geteuid() == 0:
        _DROP_CACHES.write_text("1")
    after = residency(files)
    return after.resident_bytes == 0 or after.resident_bytes < before.resident_bytes
