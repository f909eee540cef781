"""Process image files the keeper has hashed once and holds unchanged, so that a tier-1 restore
need not hash them again before criu starts.

    images = VerifiedImages.install()        the keeper's main thread, before any lease
    images.hold(snapshot_dir)                 lease, hash and record its image files
    images.verified(asked)                    → which of `asked` are held unchanged
    client.verified_images(address, root, manifest, relpaths)   the restorer's question

Why: a tier-1 restore hashes every image file it hands criu before criu starts (a restored task
runs at once: snapshot/process/snapshot.py), and an 8B's image holds a 1.5 GB memory.bin, a
critical-path cost each restore pays for bytes that have not changed since the last one.

How a file is held: the keeper opens it read-only and takes a read lease (fcntl F_SETLEASE
F_RDLCK) before hashing it. The kernel grants the lease only while no process has the file open
for writing (a shared writable mapping included), and breaks it when one opens it for writing
or truncates it: the opener waits while the keeper is sent SIGIO, whose handler forgets every
held file and closes them (which releases the leases), and only then can the writer change a
byte. A file is answered as verified only while its lease stands, its path still names the
leased inode (same device, inode, size, modification and change times), and the manifest entry
the restorer read for it is the one the keeper hashed it against. What this does not cover is
what hashing before criu does not cover either: a change after the answer and before criu
reads the file; and writes that bypass the file system (the raw block device, as root).

A keeper that cannot lease (another thread than the main one, a file system without leases, a
file open for writing somewhere, not the file's owner without CAP_LEASE) holds nothing and says
why; restores then hash the images themselves, as without a keeper. Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import signal
import stat
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from snapfn.snapshot.errors import SnapfnError, bad_snapshot, one_line


def entry_digest(entry: Mapping[str, Any]) -> str:
    """A manifest `files` entry (size and digests) as one sha256, the same on both sides."""
    return hashlib.sha256(json.dumps(entry, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class Stamp:
    """A file as `stat` sees it; any write changes the times, a replacement the inode."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> Stamp:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def to_json(self) -> list[int]:
        return [self.dev, self.ino, self.size, self.mtime_ns, self.ctime_ns]


@dataclass(frozen=True)
class _Held:
    fd: int  # read-only, its read lease taken
    stamp: Stamp
    entry: str  # entry_digest of the manifest entry it was hashed against
    generation: int  # the lease breaks seen before it was leased


class VerifiedImages:
    """The keeper's held image files (by absolute path). Made by `install` on the main thread,
    whose SIGIO handler drops them all when any lease breaks.

    A break bumps `_generation` first: a file is answered only while the breaks seen equal
    those seen before it was leased, whatever the threads were doing when the signal came."""

    def __init__(self) -> None:
        self._held: dict[str, _Held] = {}
        self._lock = threading.Lock()
        self._generation = 0  # lease breaks seen (SIGIO)
        self._dropped = 0  # the generation the last drop handled

    @classmethod
    def install(cls) -> VerifiedImages:
        """The keeper's images, its SIGIO handler set (ValueError off the main thread: a lease
        broken without it would kill the keeper, SIGIO's default action)."""
        images = cls()
        signal.signal(signal.SIGIO, lambda *_: images._on_break())
        return images

    def hold(self, snapshot_dir: Path, num_threads: int | None = None) -> tuple[int, int]:
        """Lease, hash (against the manifest, its signature checked as a restore checks it)
        and hold `snapshot_dir`'s process image files, every rank's: (files, bytes) held.
        BadSnapshot when a digest does not match; SnapfnError saying why nothing is held."""
        from snapfn.snapshot.portable.format import (
            PROCESS_IMAGES,
            STREAM_VERIFIED,
            parse_manifest,
            read_manifest_bytes,
        )
        from snapfn.snapshot.portable.signature import check_signature, configured

        root = Path(snapshot_dir).absolute()
        raw = read_manifest_bytes(root)
        check_signature(root, configured(), raw)
        files = parse_manifest(root, raw)["files"]
        images = sorted(
            p for p in files if p.startswith(PROCESS_IMAGES) and not STREAM_VERIFIED.fullmatch(p)
        )
        if not images:
            raise bad_snapshot(root, "holds no process image files to hash")
        generation = self._generation
        leased: dict[str, _Held] = {}
        try:
            for relpath in images:  # NOTE: leased first, so nothing changes them once hashed
                entry = entry_digest(files[relpath])
                leased[str(root / relpath)] = _lease(root / relpath, entry, generation)
            # NOTE: hashed through the leased fds, never by path: a path may name another file
            # by the time it is opened again (a folder swapped in and back)
            _verify_held(root, files, {r: leased[str(root / r)] for r in images}, num_threads)
            for path, held in leased.items():  # the paths still name the leased files
                if Stamp.of(os.stat(path)) != held.stamp:
                    raise SnapfnError(f"{path} changed while it was hashed")
            with self._lock:
                if self._generation != generation:
                    raise SnapfnError("an image file was opened for writing while it was hashed")
                replaced = [self._held.pop(p) for p in leased if p in self._held]
                self._held.update(leased)
                leased = {}
        finally:
            for held in leased.values():
                os.close(held.fd)
        for held in replaced:
            os.close(held.fd)
        self._settle()
        return len(images), sum(files[p]["size"] for p in images)

    def verified(self, asked: Mapping[str, Any]) -> list[str]:
        """The paths of `asked` ({path: {"stamp": [...], "entry": digest}}) held unchanged: no
        lease broken since, the path naming the leased inode, stamped and described as the
        asker sees them."""
        with self._lock:
            held = dict(self._held)
        self._settle()
        found = []
        for path, seen in asked.items():
            mine = held.get(path)
            if mine is None or not isinstance(seen, dict):
                continue
            try:
                now = Stamp.of(os.stat(path))
            except (OSError, TypeError, ValueError):
                continue
            same = now == mine.stamp and seen.get("stamp") == mine.stamp.to_json()
            if same and seen.get("entry") == mine.entry and mine.generation == self._generation:
                found.append(path)
        return found

    def drop(self) -> None:
        """Forget every held file and close it, which releases its lease (a writer waits on it)."""
        generation = self._generation
        with self._lock:
            held, self._held = self._held, {}
            self._dropped = generation
        for h in held.values():
            with contextlib.suppress(OSError):
                os.close(h.fd)

    def _on_break(self) -> None:
        """SIGIO, on the main thread, between two of its bytecodes: a lease is being broken.
        Every file is untrusted at once; they are closed here unless the lock is taken (by the
        main thread itself, in `hold`, or by a request's thread), whose holder closes them
        (`_settle`) once it lets go."""
        self._generation += 1
        if self._lock.acquire(blocking=False):
            self._lock.release()
            self.drop()

    def _settle(self) -> None:
        if self._dropped != self._generation:
            self.drop()

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)


def _lease(path: Path, entry: str, generation: int) -> _Held:
    # NOTE: O_NONBLOCK: a FIFO in its place, or a lease someone else holds, is refused at once
    # instead of waited on
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        why = "leased by another process" if exc.errno == errno.EWOULDBLOCK else exc.strerror
        raise SnapfnError(one_line(f"cannot hold {path}: {why}")) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SnapfnError(f"cannot hold {path}: not a regular file")
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
        return _Held(fd, Stamp.of(os.fstat(fd)), entry, generation)
    except OSError as exc:
        os.close(fd)
        why = "open for writing elsewhere" if exc.errno == errno.EAGAIN else exc.strerror
        raise SnapfnError(one_line(f"no read lease on {path}: {why}")) from None
    except BaseException:
        os.close(fd)
        raise


def _verify_held(
    root: Path, files: Mapping[str, Any], held: Mapping[str, _Held], num_threads: int | None
) -> None:
    """Hash each held file's recorded ranges through its fd; BadSnapshot at the first
    mismatch (in path, chunk order), or where its size is not the recorded one."""
    from snapfn.snapshot.portable.digests import digest_ranges, sha256_fd
    from snapfn.snapshot.portable.format import verify_ranges

    for relpath, h in held.items():
        if h.stamp.size != files[relpath]["size"]:
            size = files[relpath]["size"]
            raise bad_snapshot(root, f"{relpath!r} is {h.stamp.size} bytes, not {size}")
    ranges = sorted(r for relpath in held for r in digest_ranges(relpath, files[relpath]))
    verify_ranges(root, ranges, num_threads, hash_range=lambda r: sha256_fd(held[r.relpath].fd, r))


def ask(root: Path, files: Mapping[str, Any], relpaths: Iterable[str]) -> dict[str, Any]:
    """The restorer's question for `relpaths` of the snapshot at `root` (its manifest's
    `files`): {absolute path: {"stamp", "entry"}}; files it cannot stat are left out."""
    asked = {}
    for relpath in relpaths:
        path = Path(root).absolute() / relpath
        try:
            stamp = Stamp.of(os.stat(path))
        except OSError:
            continue
        asked[str(path)] = {"stamp": stamp.to_json(), "entry": entry_digest(files[relpath])}
    return asked
