"""Publishing a snapshot: fill a staging dir, write the manifest last, install it atomically.

`SnapshotWriter(dest)` fills a hidden temp sibling of `dest` (staging.py), hashes every file it
was not given digests for (`register_chunked`), fsyncs the files, writes manifest.json last
(format.py describes it), fsyncs every directory, and then installs the directory at `dest` by
rename. Leaving the `with` block by an exception, or without publish(), removes the temp dir and
leaves `dest` as it was. Before it starts, a writer removes the temp dirs of writers of the same
`dest` that died.

Atomic-replace guarantee: `dest` is always either absent, the previous complete snapshot or the
new complete snapshot; never a half-written directory. On Linux filesystems with
renameat2(RENAME_EXCHANGE) (ext4, xfs, btrfs, tmpfs, ...) old and new swap in one step, so a
reader that finds a snapshot at `dest` before a publish finds one at every moment after it.
Elsewhere the old snapshot is renamed aside and the new one renamed in: between those two renames
`dest` is briefly absent (a reader sees "missing" and falls back), and a crash there leaves no
snapshot rather than a broken one. The replaced snapshot is deleted afterwards: a reader still
reading it may fail with a missing file or a digest mismatch, a refusal, never silent use of
mixed files. Only a directory holding a snapshot (or an empty one) is ever replaced.
"""

from __future__ import annotations

import errno
import json
import os
import sys
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any

from snapfn.snapshot.errors import bad_snapshot, one_line
from snapfn.snapshot.portable.compat import FORMAT_VERSION
from snapfn.snapshot.portable.digests import digest_ranges, num_chunks, run_parallel, sha256_range
from snapfn.snapshot.portable.format import (
    MANIFEST,
    digests_problem,
    entry_problem,
    list_files,
    relpath_problem,
)
from snapfn.snapshot.portable.signature import (
    CONFIGURED,
    SIGNATURE,
    configured,
    signature_bytes,
)
from snapfn.snapshot.portable.staging import (
    make_locked_temp_dir,
    remove_stale_temp_dirs,
    remove_tree,
    temp_sibling,
)

__all__ = ["DEFAULT_CHUNK_BYTES", "SnapshotWriter", "install_snapshot"]

DEFAULT_CHUNK_BYTES = 64 << 20
_RESERVED_KEYS = ("format_version", "created_at", "files")
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


class SnapshotWriter:
    """Fill a temp sibling of `dest`, then publish it there atomically.

        with SnapshotWriter(dest) as w:
            (w.root / "tokenizer.json").write_bytes(blob)
            w.register_chunked("weights/rank0.bin", chunk_bytes, digests, None)
            w.publish({"compat": compat_key("cuda"), "memory_plan": {...}})

    Leaving the block by an exception, or without publish(), removes the temp dir and leaves
    `dest` as it was. See the module docstring for the replace guarantee.
    """

    def __init__(
        self,
        dest: str | os.PathLike[str],
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        num_threads: int | None = None,
        signing_key: Any = CONFIGURED,
    ) -> None:
        """`signing_key`: a SnapshotKey, None (no signature), or by default the configured one
        (portable/signature.py), which signs the manifest when it can."""
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, not {chunk_bytes}")
        self.signing_key = signing_key
        self.dest = Path(dest).absolute()
        self.chunk_bytes = chunk_bytes
        self.num_threads = num_threads
        self._root: Path | None = None
        self._lock_fd: int | None = None
        self._registered: dict[str, dict[str, Any]] = {}
        self._published = False

    @property
    def root(self) -> Path:
        """The temp directory the snapshot's files go into (inside `with`, before publish)."""
        if self._root is None or self._published:
            raise RuntimeError("SnapshotWriter.root is only valid inside `with`, before publish()")
        return self._root

    def __enter__(self) -> SnapshotWriter:
        self.dest.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temp_dirs(self.dest)
        self._root, self._lock_fd = make_locked_temp_dir(self.dest)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if self._root is not None and not self._published:
                remove_tree(self._root)
        finally:
            self._unlock()

    def register_chunked(
        self, relpath: str, chunk_bytes: int, chunk_sha256: list[str], file_sha256: str | None
    ) -> None:
        """Record digests computed while `relpath` was written; publish() will not re-hash it.

        publish() checks that len(chunk_sha256) fits the file's size and `chunk_bytes`.
        """
        problem = relpath_problem(relpath) or digests_problem(
            chunk_bytes, list(chunk_sha256), file_sha256
        )
        if problem:
            raise ValueError(one_line(f"register_chunked({relpath!r}): {problem}"))
        self._registered[relpath] = {
            "sha256": file_sha256,
            "chunk_bytes": chunk_bytes,
            "chunks": list(chunk_sha256),
        }

    def publish(self, manifest: dict[str, Any]) -> Path:
        """Hash, fsync, write manifest.json last, and make the snapshot appear at `dest`.

        `manifest` holds the caller's fields and must include `compat` (a compat_key() dict);
        `format_version`, `created_at` and `files` are set here. Returns `dest`.
        """
        root = self.root
        header = _manifest_header(manifest)
        on_disk = list_files(root)
        header["files"] = self._describe_files(root, on_disk)
        run_parallel(lambda p: _fsync_path(root / p), sorted(on_disk), self.num_threads)
        raw = (json.dumps(header, indent=1) + "\n").encode()
        write_durably(root / MANIFEST, raw)
        key = configured(self.signing_key)
        if key is not None and key.can_sign:  # NOTE: inside the staging dir: never unsigned
            write_durably(root / SIGNATURE, signature_bytes(key, raw))  # once published
        _fsync_tree_dirs(root)
        replaced = _install(root, self.dest)
        self._published = True
        self._unlock()
        if replaced is not None:
            remove_tree(replaced)
        return self.dest

    def _describe_files(self, root: Path, on_disk: dict[str, int]) -> dict[str, dict[str, Any]]:
        """The manifest's `files`: registered digests checked, every other file hashed here."""
        for reserved in (MANIFEST, SIGNATURE):
            if reserved in on_disk:
                raise ValueError(f"do not write {reserved} yourself: publish() writes it")
        unwritten = sorted(set(self._registered) - set(on_disk))
        if unwritten:
            raise bad_snapshot(
                self.dest, f"cannot publish: {unwritten[0]!r} was registered, not written"
            )
        entries = {p: self._entry_for(p, size) for p, size in sorted(on_disk.items())}
        todo = [
            where
            for relpath, entry in entries.items()
            if relpath not in self._registered
            for where in digest_ranges(relpath, entry)
        ]
        digests = run_parallel(lambda r: sha256_range(root, r), todo, self.num_threads)
        for where, digest in zip(todo, digests, strict=True):
            entry = entries[where.relpath]
            if where.whole_file:
                entry["sha256"] = digest
            else:
                entry["chunks"][where.chunk] = digest
        return entries

    def _entry_for(self, relpath: str, size: int) -> dict[str, Any]:
        """A files entry: registered digests (checked against size), or placeholders to fill."""
        if relpath in self._registered:
            entry = {"size": size, **self._registered[relpath]}
            problem = entry_problem(entry)
            if problem:
                raise bad_snapshot(self.dest, f"cannot publish {relpath!r}: {problem}")
            return entry
        placeholder = "0" * 64
        if size <= self.chunk_bytes:
            return {"size": size, "sha256": placeholder}
        return {
            "size": size,
            "sha256": None,
            "chunk_bytes": self.chunk_bytes,
            "chunks": [placeholder] * num_chunks(size, self.chunk_bytes),
        }

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def install_snapshot(staged: str | os.PathLike[str], dest: str | os.PathLike[str]) -> Path:
    """Install `staged`, a complete snapshot its caller filled, fsynced and verified, at `dest`.

    For writers that fill a directory themselves (the S3 store's pull copies a manifest as it
    is): fsyncs every directory under `staged`, installs it with the replace guarantee above and
    deletes the snapshot it replaced. Returns `dest`.
    """
    dest = Path(dest).absolute()
    _fsync_tree_dirs(Path(staged))
    replaced = _install(Path(staged), dest)
    if replaced is not None:
        remove_tree(replaced)
    return dest


def _manifest_header(fields: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(fields, dict):
        raise TypeError(f"publish() takes a dict of manifest fields, not {type(fields).__name__}")
    clash = [key for key in _RESERVED_KEYS if key in fields]
    if clash:
        raise ValueError(f"manifest keys {clash} are set by publish(), do not pass them")
    if not isinstance(fields.get("compat"), dict):
        raise ValueError("publish() needs manifest['compat'] = compat_key(...)")
    json.dumps(fields, allow_nan=False)  # fail now, before hashing, if it is not plain JSON
    created_at = datetime.now(UTC).isoformat(timespec="seconds")
    return {"format_version": FORMAT_VERSION, "created_at": created_at, **fields}


def _install(staged: Path, dest: Path) -> Path | None:
    """Make `staged` appear at `dest`; return where the snapshot it replaced now lies, if any."""
    if not os.path.lexists(dest) and _rename_unless_taken(staged, dest):
        _fsync_path(dest.parent)
        return None
    check_replaceable(dest)
    if _exchange(staged, dest):
        _fsync_path(dest.parent)
        return staged
    aside = temp_sibling(dest)
    os.rename(dest, aside)
    try:
        os.rename(staged, dest)
    except BaseException:
        os.rename(aside, dest)
        raise
    _fsync_path(dest.parent)
    return aside


def _rename_unless_taken(source: Path, dest: Path) -> bool:
    """rename(2), answering False if a non-empty directory appeared at `dest` meanwhile."""
    try:
        os.rename(source, dest)
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
            return False
        raise
    return True


def check_replaceable(dest: Path) -> None:
    """Refuse to replace anything but a directory that holds a snapshot (or nothing)."""
    if dest.is_symlink() or not dest.is_dir():
        raise FileExistsError(f"refusing to replace {str(dest)!r}: not a directory")
    if not (dest / MANIFEST).is_file() and any(dest.iterdir()):
        raise FileExistsError(f"refusing to replace {str(dest)!r}: not a snapshot (no {MANIFEST})")


def _exchange(first: Path, second: Path) -> bool:
    """Swap two paths in one step with renameat2(RENAME_EXCHANGE); False where unsupported."""
    if sys.platform != "linux":
        return False
    import ctypes  # NOTE: only a replacing publish needs it

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False  # glibc < 2.28 or another libc
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p]
    renameat2.argtypes += [ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    a, b = os.fsencode(first), os.fsencode(second)
    if renameat2(_AT_FDCWD, a, _AT_FDCWD, b, _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False  # kernel or filesystem without RENAME_EXCHANGE
    raise OSError(err, os.strerror(err), str(first), None, str(second))


def write_durably(path: Path, data: bytes) -> None:
    """Create `path` (it must not exist) holding `data`, fsynced."""
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree_dirs(root: Path) -> None:
    """fsync every directory under `root`, deepest first, so every entry is on disk."""
    for directory, _subdirs, _files in os.walk(root, topdown=False):
        _fsync_path(Path(directory))
