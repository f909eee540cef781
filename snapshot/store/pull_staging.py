"""Where a pull from the S3 store writes before it publishes, and its progress journal.

A pull of a snapshot whose manifest.json has sha256 D into `dest` works in the hidden sibling
`.<name>.pull-<first 16 hex of D>`, flock'ed while the pull runs:

    .<name>.pull-<16 hex>/
      journal.jsonl    one JSON line per verified range: {"relpath", "offset", "length", "sha256"}
      snapshot/        the snapshot's files, preallocated at their sizes and filled by pwrite;
                       manifest.json is written here last, then this directory is renamed to dest

A range is journaled only after its bytes matched the manifest's sha256 and were fdatasync'ed,
so a rerun after an interruption (a kill, a network failure, a refusal) skips every journaled
range and fetches only the rest. The name carries the manifest's digest: a rerun against a
changed manifest starts afresh, and removes the unlocked staging dirs of older pulls into
`dest`. A torn last journal line (a kill mid-write) is ignored.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
from pathlib import Path
from types import TracebackType

from snapfn.snapshot.errors import BadRequest
from snapfn.snapshot.portable.format import MANIFEST
from snapfn.snapshot.portable.staging import remove_if_unlocked, remove_tree

JOURNAL = "journal.jsonl"
SNAPSHOT_DIR = "snapshot"
Range = tuple[str, int, int, str]  # (relpath, offset, length, sha256)


def staging_dir_for(dest: Path, manifest_sha256: str) -> Path:
    return dest.with_name(f".{dest.name}.pull-{manifest_sha256[:16]}")


class PullStaging:
    """`with PullStaging(dest, manifest_sha256) as staging:` — create or resume.

    Leaving the block keeps the directory (and its journal) for a rerun; `remove()` after the
    snapshot is installed deletes it.
    """

    def __init__(self, dest: Path, manifest_sha256: str) -> None:
        self.root = staging_dir_for(dest, manifest_sha256)
        self.files = self.root / SNAPSHOT_DIR
        self._dest = dest
        self._fd: int | None = None
        self._journal_lock = threading.Lock()

    def __enter__(self) -> PullStaging:
        self._dest.parent.mkdir(parents=True, exist_ok=True)
        for other in sorted(self._dest.parent.glob(f".{self._dest.name}.pull-*")):
            if other != self.root:
                remove_if_unlocked(other)  # an older manifest's pull, abandoned
        self.files.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._close()
            raise BadRequest(f"another pull into {self._dest} is running ({self.root})") from None
        if (self.files / MANIFEST).exists():
            (self.files / MANIFEST).unlink()  # a pull that died between manifest and rename
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._close()

    def verified(self) -> set[Range]:
        """The ranges journaled as verified by earlier runs of this pull."""
        try:
            lines = (self.root / JOURNAL).read_text().splitlines()
        except FileNotFoundError:
            return set()
        done = set()
        for line in lines:
            try:
                record = json.loads(line)
                done.add((record["relpath"], record["offset"], record["length"], record["sha256"]))
            except (ValueError, KeyError, TypeError):
                continue  # a torn line from a run killed mid-write
        return done

    def record(self, verified: Range) -> None:
        """Journal one verified range (its bytes already fdatasync'ed)."""
        relpath, offset, length, sha256 = verified
        record = {"relpath": relpath, "offset": offset, "length": length, "sha256": sha256}
        with self._journal_lock, open(self.root / JOURNAL, "a") as f:
            f.write(json.dumps(record) + "\n")

    def open_file(self, relpath: str, size: int) -> int:
        """An fd of `relpath` under `files`, created or reopened, at exactly `size` bytes."""
        path = self.files / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def remove(self) -> None:
        self._close()
        remove_tree(self.root)

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
