"""A pull from the S3 store that a restore follows: download and weight streaming overlap.

    pull = OverlappedPull(uri, dest, raw, streamed=("weights/rank0.bin",), client=client)
    pull.start()                                    the pull, on its own thread
    restore(make_fn, pull.files, arriving=pull)     runtime.py: reads pull.files as it fills
    pull.close()                                    joined; the pull's error, or None

The pull is store/transfer.py's, unchanged in what it guarantees — ranged GETs in threads, each
range checked against its sha256, fdatasync'ed and journaled before anyone reads it, the
whole-file sha256s and the listing checked, manifest.json written last and the folder installed
at `dest` atomically, a failed or interrupted run resumable from its journal — with three
additions for its follower (the `Arriving` protocol of runtime.py):

- the files in `streamed` (the weights a restore streams) are fetched after every other file,
  each chunk in file order, so that the restore validates and sets up on the small files while
  the weights still download, and its streamer reads close behind the pull;
- every verified range is recorded in `arrivals` (store/arrivals.py): `wait_files` waits on
  every file but the streamed ones, `waiter(relpath)` is what the streamer waits on before each
  read, and a failed pull makes every waiter raise BadSnapshot naming the chunk it waited for;
- the pull installs the folder only once its follower has stopped reading the staging paths
  (`finish`, or `release` after a failed restore, or `close`), so no path moves under a restore.

The restore reads `files`, the pull's staging folder (pull_staging.py), which has no
manifest.json until the pull publishes: nothing half-downloaded ever looks like a snapshot.
`on_exit`, when given, runs on the pull's thread once the pull has ended, whatever its outcome
(the cache releases its lock there).

A pull of a `part` (transfer.py) is followed the same way but never publishes: the cache starts
one for a process snapshot's portable tier once the whole snapshot's pull was refused
(`refused`: why, one line), and the tier-0 restore that follows it says so.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from snapfn.snapshot.errors import one_line
from snapfn.snapshot.portable.format import parse_manifest
from snapfn.snapshot.stages import Log
from snapfn.snapshot.store.arrivals import Arrivals, FileWaiter
from snapfn.snapshot.store.pull_staging import SNAPSHOT_DIR, staging_dir_for
from snapfn.snapshot.store.s3 import S3Location


class OverlappedPull:
    """A pull of `uri` into `dest` on its own thread, followed by a restore of `files`."""

    def __init__(
        self,
        uri: str,
        dest: Path,
        manifest_bytes: bytes,
        *,
        streamed: tuple[str, ...],
        client: Any,
        num_threads: int,
        log: Log | None = None,
        on_exit: Callable[[], None] | None = None,
        part: tuple[str, ...] | None = None,
        refused: str | None = None,
    ) -> None:
        """`part`: pull only these files, publishing nothing; `refused`: why the whole
        snapshot's pull was refused (module docstring)."""
        self.uri, self.dest, self.manifest_bytes = uri, Path(dest), manifest_bytes
        self.where = S3Location.parse(uri)
        self.manifest = parse_manifest(self.where, manifest_bytes)
        self.part, self.refused = part, refused
        self.pulled = sorted(self.manifest["files"] if part is None else part)
        self.streamed = tuple(p for p in streamed if p in self.pulled)
        sha256 = hashlib.sha256(manifest_bytes).hexdigest()
        self.files = staging_dir_for(self.dest, sha256) / SNAPSHOT_DIR
        self.arrivals = Arrivals(self.where, self.manifest["files"])
        self.fetched_s: float | None = None  # start → every range fetched and checked
        self.published_s: float | None = None  # start → installed at dest
        self._client, self._num_threads, self._log, self._on_exit = (
            client,
            num_threads,
            log,
            on_exit,
        )
        self._released = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="snapfn-pull", daemon=True)
        self._start = 0.0

    def start(self) -> OverlappedPull:
        self._start = time.perf_counter()
        self._thread.start()
        return self

    # ---- the runtime's Arriving protocol ------------------------------------------------------
    def wait_files(self, figures: dict[str, Any]) -> None:
        """Every file but the streamed ones is verified in `files` (the restore's first read)."""
        small = sorted(set(self.pulled) - set(self.streamed))
        figures["waited_s"] = round(self.arrivals.wait_for_files(small), 4)
        figures.update(files=len(small), bytes=self._bytes(small), source=self.uri)

    def waiter(self, relpath: str) -> FileWaiter:
        return self.arrivals.file_waiter(relpath)

    def finish(self, figures: dict[str, Any]) -> None:
        """Stop reading; wait for the pull to publish (a part: to verify); its figures, or its
        error raised."""
        self.release()
        self._thread.join()
        if self._error is not None:
            raise self._error
        total = self._bytes(self.pulled)
        figures.update(
            source=self.uri,
            overlapped=True,
            bytes=total,
            fetched_s=round(self.fetched_s or 0.0, 4),
            gbps=round(total / max(self.fetched_s or 0.0, 1e-9) / 1e9, 3),
        )
        if self.part is None:
            figures.update(published_s=round(self.published_s or 0.0, 4), path=str(self.dest))
        else:
            figures.update(part=len(self.pulled), path=str(self.files))

    def release(self) -> None:
        self._released.set()

    # ---- the caller's end ----------------------------------------------------------------------
    def close(self) -> BaseException | None:
        """Release, wait for the pull to end; the error it ended with, or None (published)."""
        self.release()
        self._thread.join()
        return self._error

    def _run(self) -> None:
        from snapfn.snapshot.store.transfer import pull

        try:
            pull(
                self.uri,
                self.dest,
                client=self._client,
                num_threads=self._num_threads,
                manifest_bytes=self.manifest_bytes,
                log=self._log,
                arrivals=self.arrivals,
                last=self.streamed,
                before_publish=self._before_publish,
                part=self.part,
            )
            if self.part is None:
                self.published_s = time.perf_counter() - self._start
        except BaseException as exc:  # NOTE: raised again by finish(), and returned by close()
            self._error = exc
            self.arrivals.fail(one_line(f"{type(exc).__name__}: {exc}"))
        finally:
            if self._on_exit is not None:
                self._on_exit()

    def _before_publish(self) -> None:
        self.fetched_s = time.perf_counter() - self._start
        self._released.wait()  # NOTE: installing renames `files`: its reader must be done

    def _bytes(self, relpaths: list[str]) -> int:
        return sum(self.manifest["files"][p]["size"] for p in relpaths)
