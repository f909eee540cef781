"""Which ranges of a pull in flight are verified and written, for readers that follow it.

    arrivals = Arrivals(where, manifest["files"])   the pull's ranges, none arrived yet
    arrivals.record(relpath, offset)                 the pull: this range matched its sha256
                                                     and is on disk (fdatasync'ed, journaled)
    arrivals.fail(reason)                            the pull stopped: waiters raise
    waited_s = arrivals.wait_for(relpath, lo, hi)    a reader: block until bytes [lo, hi) of
                                                     relpath are all there; the seconds waited

A range is what one ranged GET of the pull fetches and checks (store/transfer.py): a chunk of a
chunked file, or the whole of a file without chunks. A wait on bytes whose ranges never arrive
(the pull failed or was stopped) raises BadSnapshot, one line, naming the snapshot, the first
range it waited for and why the pull stopped. `file_waiter(relpath)` binds one file, which is
what a weight streamer takes (layout/streamer.py `arrivals`). Thread-safe: one condition
variable for the whole pull. No S3, no torch.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from snapfn.snapshot.errors import bad_snapshot


@dataclass(frozen=True)
class _FileRanges:
    size: int
    range_bytes: int  # a chunked file's chunk_bytes; a file without chunks is one range

    def indices(self, lo: int, hi: int) -> range:
        if self.size == 0:
            return range(1)  # an empty file: its one empty range
        last = -(-min(hi, self.size) // self.range_bytes)
        return range(lo // self.range_bytes, max(last, lo // self.range_bytes + 1))

    def describe(self, relpath: str, index: int) -> str:
        lo = index * self.range_bytes
        hi = min(lo + self.range_bytes, self.size) - 1
        return f"{relpath!r} chunk {index} (bytes {lo}..{hi})"


class Arrivals:
    """The verified ranges of one pull, and the condition its readers wait on."""

    def __init__(self, where: Any, files: dict[str, dict[str, Any]]) -> None:
        self.where = where
        self._files = {
            relpath: _FileRanges(e["size"], e.get("chunk_bytes") or max(1, e["size"]))
            for relpath, e in files.items()
        }
        self._arrived: dict[str, set[int]] = {relpath: set() for relpath in files}
        self._failed: str | None = None
        self._changed = threading.Condition()

    def record(self, relpath: str, offset: int) -> None:
        """The range of `relpath` starting at `offset` is verified and on disk."""
        ranges = self._files[relpath]
        with self._changed:
            self._arrived[relpath].add(offset // ranges.range_bytes if ranges.size else 0)
            self._changed.notify_all()

    def fail(self, reason: str) -> None:
        """The pull stopped (`reason`, one line): every wait for a range not there raises."""
        with self._changed:
            self._failed = self._failed or reason
            self._changed.notify_all()

    def wait_for(self, relpath: str, lo: int = 0, hi: int | None = None) -> float:
        """Block until bytes [lo, hi) of `relpath` (default: all of it) have arrived; the
        seconds spent waiting. BadSnapshot (one line) if the pull stopped before they did."""
        ranges = self._files[relpath]
        needed = ranges.indices(lo, ranges.size if hi is None else hi)
        arrived = self._arrived[relpath]
        start = time.perf_counter()
        with self._changed:
            self._changed.wait_for(
                lambda: self._failed is not None or all(i in arrived for i in needed)
            )
            missing = next((i for i in needed if i not in arrived), None)
            if missing is not None:
                what = ranges.describe(relpath, missing)
                raise bad_snapshot(self.where, f"{what} never arrived: {self._failed}")
        return time.perf_counter() - start

    def wait_for_files(self, relpaths: list[str]) -> float:
        """Block until every range of `relpaths` has arrived; the seconds spent waiting."""
        return sum(self.wait_for(relpath) for relpath in relpaths)

    def file_waiter(self, relpath: str) -> FileWaiter:
        return FileWaiter(self, relpath)


@dataclass(frozen=True)
class FileWaiter:
    """`wait_for(lo, hi)` on one file of a pull in flight (what a weight streamer calls before
    each read)."""

    arrivals: Arrivals
    relpath: str

    def wait_for(self, lo: int, hi: int) -> float:
        return self.arrivals.wait_for(self.relpath, lo, hi)
