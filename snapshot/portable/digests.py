"""sha256 over byte ranges of snapshot files, hashed in parallel threads.

A manifest entry (see format.py) names what its digests cover: each `chunk_bytes` slice of the
file (the last one shorter) when it has `chunks`, and the whole file when its `sha256` is not
null. `digest_ranges` turns an entry into those ranges, `sha256_range` hashes one (an unreadable
file is a one-line BadSnapshot), and `run_parallel` maps over them in a thread pool, results in
order. The reader (`format.verify_files`) compares the results; the writer
(`publish.SnapshotWriter`) records them.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from snapfn.snapshot.errors import bad_snapshot

_READ_BLOCK_BYTES = 8 << 20
T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True, order=True)
class DigestRange:
    """A byte range of one file and its expected sha256; sorts a file's chunks before its whole."""

    relpath: str
    whole_file: bool
    chunk: int
    offset: int
    length: int | None  # None: to the end of the file
    sha256: str

    def describe(self) -> str:
        if self.whole_file:
            return repr(self.relpath)
        end = self.offset + (self.length or 0) - 1
        return f"{self.relpath!r} chunk {self.chunk} (bytes {self.offset}..{end})"


def digest_ranges(relpath: str, entry: dict[str, Any]) -> list[DigestRange]:
    """The ranges a `files` entry records digests for: its chunks, then the whole file."""
    ranges = []
    if "chunks" in entry:
        step = entry["chunk_bytes"]
        for index, digest in enumerate(entry["chunks"]):
            length = min(step, entry["size"] - index * step)
            ranges.append(DigestRange(relpath, False, index, index * step, length, digest))
    if entry.get("sha256") is not None:
        ranges.append(DigestRange(relpath, True, 0, 0, None, entry["sha256"]))
    return ranges


def sha256_range(root: Path, where: DigestRange) -> str:
    """sha256 of `where`'s bytes; an OSError becomes a one-line BadSnapshot."""
    try:
        with open(root / where.relpath, "rb", buffering=0) as f:
            return sha256_fd(f.fileno(), where)
    except OSError as e:
        raise bad_snapshot(root, f"cannot read {where.relpath!r}: {e.strerror or e}") from None


def sha256_fd(fd: int, where: DigestRange) -> str:
    """sha256 of `where`'s bytes read from the open file `fd` (by pread: its offset is left as
    it is); a file shorter than the range gives the digest of what it holds."""
    digest = hashlib.sha256()
    remaining = sys.maxsize if where.length is None else where.length
    # NOTE: the buffer is no larger than what is left to read: an 8 MiB one for each of a
    # snapshot's ~600 small kernel-cache files cost 0.45 s of every restore's validate stage on
    # the H200 (zero-filled and faulted in, then unmapped; commit 6ddc196)
    left = max(0, os.fstat(fd).st_size - where.offset)
    buffer = memoryview(bytearray(max(1, min(_READ_BLOCK_BYTES, remaining, left))))
    offset = where.offset
    while remaining > 0:
        num_read = os.preadv(fd, [buffer[: min(len(buffer), remaining)]], offset)
        if not num_read:
            break
        digest.update(buffer[:num_read])
        remaining -= num_read
        offset += num_read
    return digest.hexdigest()


def run_parallel(fn: Callable[[T], R], items: Sequence[T], num_threads: int | None) -> list[R]:
    """fn over items in a thread pool, results in order (hashlib and reads release the GIL).

    On the first exception the queued work is cancelled and the exception propagates.
    """
    if not items:
        return []
    workers = num_threads or min(16, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=min(workers, len(items))) as pool:
        try:
            return list(pool.map(fn, items))
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise


def num_chunks(size: int, chunk_bytes: int) -> int:
    """How many `chunk_bytes` slices cover `size` bytes (the last one may be shorter)."""
    return -(-size // chunk_bytes)
