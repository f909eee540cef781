"""The snapshot directory format: manifest, checksums, atomic publish, validation.

A snapshot is a directory that a `SnapshotWriter` fills as a hidden temp sibling
(`.<name>.tmp-<pid>-<16 hex>`) and publishes by rename. `manifest.json` is written last and
lists every other regular file in the directory; nothing else may be there (no unlisted file, no
symlink, no special file). Wire format of manifest.json (a UTF-8 JSON object):

    {
      "format_version": 1,                         # FORMAT_VERSION; any other is refused
      "created_at": "2025-06-01T12:00:00+00:00",   # UTC, ISO 8601, seconds
      "compat": {...},                             # compat_key() of the writer (compat.py)
      ...                                          # the caller's fields (model hash, memory
                                                   # plan, graph buckets, startup manifest)
      "files": {                                   # sorted; POSIX paths relative to the dir
        "tokenizer.json": {"size": 9085657, "sha256": "<64 hex>"},
        "weights/rank0.bin": {"size": 16106127360, "sha256": "<64 hex>" | null,
                              "chunk_bytes": 67108864, "chunks": ["<64 hex>", ...]}
      }
    }

A file larger than the writer's `chunk_bytes` (64 MiB by default), and every file registered with
digests computed elsewhere (`register_chunked`), carries `chunks`: the sha256 of each
`chunk_bytes` slice, the last one shorter; `sha256` of the whole file may then be null. A file
without `chunks` always has `sha256`.

Reading: `validate_snapshot` refuses, with a one-line message naming the file (and chunk), any
snapshot whose directory or manifest is missing, unparsable or of another format version, whose
compat key differs from the current one, which lists an unsafe path (absolute, `..`, not
canonical) or a file that is missing or has another size, or which holds a file it does not list.
`verify="sizes"` (every cold start) also hashes every file without `chunks`; chunked files are
verified by whoever streams them (`chunk_digests`, `check_chunk`). `verify="full"` hashes
everything, in parallel threads.

Atomic-replace guarantee: `dest` is always either absent, the previous complete snapshot or the
new complete snapshot; never a half-written directory. On Linux filesystems with
renameat2(RENAME_EXCHANGE) (ext4, xfs, btrfs, tmpfs, ...) old and new swap in one step, so a
reader that finds a snapshot at `dest` before a publish finds one at every moment after it.
Elsewhere the old snapshot is renamed aside and the new one renamed in: between those two renames
`dest` is briefly absent (a reader sees "missing" and falls back), and a crash there leaves no
snapshot rather than a broken one. The replaced snapshot is deleted afterwards: a reader still
reading it may fail with a missing file or a digest mismatch, a refusal, never silent use of
mixed files. Temp dirs of writers that died (pid gone and directory lock free) are removed by the
next writer of the same `dest`.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import secrets
import shutil
import sys
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import Any, TypeVar

from snapfn.snapshot.compat import FORMAT_VERSION, check_compat, compat_key
from snapfn.snapshot.errors import BadSnapshot, IncompatibleSnapshot

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "FORMAT_VERSION",
    "MANIFEST",
    "VERIFY_MODES",
    "SnapshotWriter",
    "check_chunk",
    "check_compat",
    "chunk_digests",
    "compat_key",
    "read_manifest",
    "remove_stale_temp_dirs",
    "validate_snapshot",
    "verify_files",
]

MANIFEST = "manifest.json"
DEFAULT_CHUNK_BYTES = 64 << 20
VERIFY_MODES = ("sizes", "full")
_READ_BLOCK_BYTES = 8 << 20
_REQUIRED_KEYS: dict[str, type] = {"created_at": str, "compat": dict, "files": dict}
_RESERVED_KEYS = ("format_version", "created_at", "files")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_TEMP_SUFFIX = re.compile(r"(\d+)-[0-9a-f]{16}")
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
T = TypeVar("T")
R = TypeVar("R")


# ---------------------------------------------------------------- reading and validating


def read_manifest(snapshot_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Load and shape-check `snapshot_dir/manifest.json`; BadSnapshot/IncompatibleSnapshot if not."""
    root = Path(snapshot_dir)
    if not root.is_dir():
        raise _bad(root, "no snapshot directory there")
    try:
        manifest = json.loads((root / MANIFEST).read_bytes())
    except FileNotFoundError:
        raise _bad(root, f"{MANIFEST} is missing (incomplete or not a snapshot)") from None
    except OSError as e:
        raise _bad(root, f"cannot read {MANIFEST}: {e.strerror}") from None
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise _bad(root, f"{MANIFEST} is not valid JSON ({e})") from None
    _check_manifest_shape(root, manifest)
    return manifest


def validate_snapshot(
    snapshot_dir: str | os.PathLike[str],
    current_compat: dict[str, Any] | None = None,
    verify: str = "sizes",
    num_threads: int | None = None,
) -> dict[str, Any]:
    """Return the manifest of a snapshot that passes every check; raise (one line) otherwise.

    `verify="sizes"`: listing, sizes, and sha256 of every file without chunk digests.
    `verify="full"`: also every chunk digest and whole-file sha256, hashed in parallel threads.
    """
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {VERIFY_MODES}, not {verify!r}")
    root = Path(snapshot_dir)
    manifest = read_manifest(root)
    if current_compat is not None:
        try:
            check_compat(manifest["compat"], current_compat)
        except IncompatibleSnapshot as e:
            raise IncompatibleSnapshot(_one_line(f"snapshot {root}: {e}")) from None
    files = manifest["files"]
    _check_listing(root, files)
    unchunked = [relpath for relpath, entry in files.items() if "chunks" not in entry]
    verify_files(root, manifest, sorted(files) if verify == "full" else unchunked, num_threads)
    return manifest


def verify_files(
    snapshot_dir: str | os.PathLike[str],
    manifest: dict[str, Any],
    relpaths: Iterable[str],
    num_threads: int | None = None,
) -> None:
    """Hash `relpaths` (every chunk, and the whole file where sha256 is recorded) in parallel.

    Raises BadSnapshot naming the first mismatch in (path, chunk) order.
    """
    root = Path(snapshot_dir)
    ranges = sorted(r for p in relpaths for r in _digest_ranges(p, manifest["files"][p]))
    digests = _run_parallel(lambda r: _sha256_range(root, r), ranges, num_threads)
    for expected, got in zip(ranges, digests, strict=True):
        if got != expected.sha256:
            raise _bad(root, f"{expected.describe()} sha256 mismatch ({_mismatch(expected, got)})")


def chunk_digests(manifest: dict[str, Any], relpath: str) -> tuple[int, list[str]]:
    """(chunk_bytes, per-chunk sha256) of `relpath`; a file without chunks is one chunk."""
    entry = manifest["files"].get(relpath)
    if entry is None:
        raise BadSnapshot(_one_line(f"{relpath!r} is not listed in {MANIFEST}"))
    if "chunks" in entry:
        return entry["chunk_bytes"], list(entry["chunks"])
    return entry["size"], [entry["sha256"]]


def check_chunk(relpath: str, index: int, data: bytes | memoryview, expected_sha256: str) -> None:
    """Raise BadSnapshot unless sha256(`data`) is `expected_sha256` (chunk `index` of relpath)."""
    got = hashlib.sha256(data).hexdigest()
    if got != expected_sha256:
        raise BadSnapshot(
            _one_line(
                f"{relpath!r} chunk {index} sha256 mismatch "
                f"(expected {expected_sha256[:16]}.., got {got[:16]}..)"
            )
        )


def _check_manifest_shape(root: Path, manifest: Any) -> None:
    if not isinstance(manifest, dict):
        raise _bad(root, f"{MANIFEST} is not a JSON object")
    if "format_version" not in manifest:
        raise _bad(root, f"{MANIFEST} lacks required key 'format_version'")
    version = manifest["format_version"]
    if isinstance(version, bool) or version != FORMAT_VERSION:
        raise IncompatibleSnapshot(
            _one_line(
                f"snapshot {root}: format_version is {version!r}, this build reads {FORMAT_VERSION}"
            )
        )
    for key, kind in _REQUIRED_KEYS.items():
        if key not in manifest:
            raise _bad(root, f"{MANIFEST} lacks required key {key!r}")
        if not isinstance(manifest[key], kind):
            raise _bad(root, f"{MANIFEST} key {key!r} is not a JSON {kind.__name__}")
    for relpath, entry in manifest["files"].items():
        problem = _relpath_problem(relpath) or _entry_problem(entry)
        if problem:
            raise _bad(root, f"{MANIFEST} lists {relpath!r}: {problem}")


def _relpath_problem(relpath: str) -> str | None:
    """Why `relpath` may not name a file inside a snapshot, or None if it may."""
    if not relpath or "\\" in relpath or "\0" in relpath:
        return "not a plain relative path"
    if PurePosixPath(relpath).is_absolute():
        return "absolute path"
    if ".." in relpath.split("/"):
        return "path escapes the snapshot directory (..)"
    if str(PurePosixPath(relpath)) != relpath:
        return "path is not in canonical form"
    if relpath == MANIFEST:
        return "reserved name"
    return None


def _entry_problem(entry: Any) -> str | None:
    """Why a `files` entry is malformed, or None."""
    if not isinstance(entry, dict):
        return "entry is not a JSON object"
    size, sha256, chunks = entry.get("size"), entry.get("sha256"), entry.get("chunks")
    if not _is_count(size):
        return f"size {size!r} is not a byte count"
    if chunks is None:
        return None if _is_hex64(sha256) else f"sha256 {sha256!r} is not 64 lowercase hex digits"
    chunk_bytes = entry.get("chunk_bytes")
    problem = _digests_problem(chunk_bytes, chunks, sha256)
    if problem is None and len(chunks) != _num_chunks(size, chunk_bytes):
        return f"{len(chunks)} chunk digests for {size} bytes in chunks of {chunk_bytes}"
    return problem


def _digests_problem(chunk_bytes: Any, chunks: Any, file_sha256: Any) -> str | None:
    if not _is_count(chunk_bytes) or chunk_bytes == 0:
        return f"chunk_bytes {chunk_bytes!r} is not a positive byte count"
    if not isinstance(chunks, list) or not all(_is_hex64(c) for c in chunks):
        return "chunks is not a list of sha256 digests (64 lowercase hex digits)"
    if file_sha256 is not None and not _is_hex64(file_sha256):
        return f"sha256 {file_sha256!r} is not 64 lowercase hex digits"
    return None


def _check_listing(root: Path, files: dict[str, Any]) -> None:
    """Every listed file exists with its recorded size; nothing unlisted is there."""
    on_disk = _list_files(root)
    on_disk.pop(MANIFEST, None)
    for relpath in sorted(files):
        if relpath not in on_disk:
            raise _bad(root, f"{relpath!r} is listed in {MANIFEST} but missing")
        if on_disk[relpath] != files[relpath]["size"]:
            raise _bad(
                root,
                f"{relpath!r} has {on_disk[relpath]} bytes, {MANIFEST} says "
                f"{files[relpath]['size']} (truncated or overwritten)",
            )
    extra = sorted(set(on_disk) - set(files))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise _bad(root, f"{extra[0]!r} is not listed in {MANIFEST}{more}")


def _list_files(root: Path) -> dict[str, int]:
    """relpath -> size of every regular file under `root`; refuses symlinks and special files."""
    files: dict[str, int] = {}
    pending = [(root, "")]
    while pending:
        directory, prefix = pending.pop()
        with os.scandir(directory) as entries:
            for entry in entries:
                relpath = prefix + entry.name
                if entry.is_symlink():
                    raise _bad(root, f"{relpath!r} is a symlink (not allowed in a snapshot)")
                if entry.is_dir(follow_symlinks=False):
                    pending.append((Path(entry.path), relpath + "/"))
                elif entry.is_file(follow_symlinks=False):
                    files[relpath] = entry.stat(follow_symlinks=False).st_size
                else:
                    raise _bad(root, f"{relpath!r} is not a regular file or directory")
    return files


# ---------------------------------------------------------------- hashing


@dataclass(frozen=True, order=True)
class _Range:
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


def _digest_ranges(relpath: str, entry: dict[str, Any]) -> list[_Range]:
    ranges = []
    if "chunks" in entry:
        step = entry["chunk_bytes"]
        for index, digest in enumerate(entry["chunks"]):
            length = min(step, entry["size"] - index * step)
            ranges.append(_Range(relpath, False, index, index * step, length, digest))
    if entry.get("sha256") is not None:
        ranges.append(_Range(relpath, True, 0, 0, None, entry["sha256"]))
    return ranges


def _sha256_range(root: Path, where: _Range) -> str:
    """sha256 of `where`'s bytes; an OSError becomes a one-line BadSnapshot."""
    digest = hashlib.sha256()
    remaining = sys.maxsize if where.length is None else where.length
    buffer = memoryview(bytearray(min(_READ_BLOCK_BYTES, remaining)))
    try:
        with open(root / where.relpath, "rb", buffering=0) as f:
            f.seek(where.offset)
            while remaining > 0:
                num_read = f.readinto(buffer[: min(len(buffer), remaining)])
                if not num_read:
                    break
                digest.update(buffer[:num_read])
                remaining -= num_read
    except OSError as e:
        raise _bad(root, f"cannot read {where.relpath!r}: {e.strerror or e}") from None
    return digest.hexdigest()


def _run_parallel(fn: Callable[[T], R], items: Sequence[T], num_threads: int | None) -> list[R]:
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


# ---------------------------------------------------------------- writing and publishing


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
    ) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, not {chunk_bytes}")
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
        self._root, self._lock_fd = _make_locked_temp_dir(self.dest)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if self._root is not None and not self._published:
                _remove_tree(self._root)
        finally:
            self._unlock()

    def register_chunked(
        self, relpath: str, chunk_bytes: int, chunk_sha256: list[str], file_sha256: str | None
    ) -> None:
        """Record digests computed while `relpath` was written; publish() will not re-hash it.

        publish() checks that len(chunk_sha256) fits the file's size and `chunk_bytes`.
        """
        problem = _relpath_problem(relpath) or _digests_problem(
            chunk_bytes, list(chunk_sha256), file_sha256
        )
        if problem:
            raise ValueError(_one_line(f"register_chunked({relpath!r}): {problem}"))
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
        on_disk = _list_files(root)
        header["files"] = self._describe_files(root, on_disk)
        _run_parallel(lambda p: _fsync_path(root / p), sorted(on_disk), self.num_threads)
        _write_durably(root / MANIFEST, (json.dumps(header, indent=1) + "\n").encode())
        _fsync_tree_dirs(root)
        replaced = _install(root, self.dest)
        self._published = True
        self._unlock()
        if replaced is not None:
            _remove_tree(replaced)
        return self.dest

    def _describe_files(self, root: Path, on_disk: dict[str, int]) -> dict[str, dict[str, Any]]:
        """The manifest's `files`: registered digests checked, every other file hashed here."""
        if MANIFEST in on_disk:
            raise ValueError(f"do not write {MANIFEST} yourself: publish() writes it")
        unwritten = sorted(set(self._registered) - set(on_disk))
        if unwritten:
            raise _bad(self.dest, f"cannot publish: {unwritten[0]!r} was registered, not written")
        entries = {p: self._entry_for(p, size) for p, size in sorted(on_disk.items())}
        todo = [
            where
            for relpath, entry in entries.items()
            if relpath not in self._registered
            for where in _digest_ranges(relpath, entry)
        ]
        digests = _run_parallel(lambda r: _sha256_range(root, r), todo, self.num_threads)
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
            problem = _entry_problem(entry)
            if problem:
                raise _bad(self.dest, f"cannot publish {relpath!r}: {problem}")
            return entry
        placeholder = "0" * 64
        if size <= self.chunk_bytes:
            return {"size": size, "sha256": placeholder}
        return {
            "size": size,
            "sha256": None,
            "chunk_bytes": self.chunk_bytes,
            "chunks": [placeholder] * _num_chunks(size, self.chunk_bytes),
        }

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def remove_stale_temp_dirs(dest: str | os.PathLike[str]) -> list[Path]:
    """Remove temp dirs beside `dest` left by writers that died; return the ones removed.

    A temp dir is stale when the pid in its name is not alive on this host and its directory
    lock (flock, held by a live writer until publish or exit) can be taken.
    """
    dest = Path(dest)
    prefix = f".{dest.name}.tmp-"
    removed = []
    for candidate in sorted(dest.parent.iterdir()):
        if not candidate.name.startswith(prefix):
            continue
        match = _TEMP_SUFFIX.fullmatch(candidate.name[len(prefix) :])
        if match and not _pid_alive(int(match.group(1))) and _remove_if_unlocked(candidate):
            removed.append(candidate)
    return removed


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


def _temp_sibling(dest: Path) -> Path:
    return dest.with_name(f".{dest.name}.tmp-{os.getpid()}-{secrets.token_hex(8)}")


def _make_locked_temp_dir(dest: Path) -> tuple[Path, int]:
    """mkdir a temp sibling of `dest` and flock it for as long as we write into it."""
    temp = _temp_sibling(dest)
    temp.mkdir()
    fd = os.open(temp, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        _remove_tree(temp)
        raise
    return temp, fd


def _install(staged: Path, dest: Path) -> Path | None:
    """Make `staged` appear at `dest`; return where the snapshot it replaced now lies, if any."""
    if not os.path.lexists(dest) and _rename_unless_taken(staged, dest):
        _fsync_path(dest.parent)
        return None
    _check_replaceable(dest)
    if _exchange(staged, dest):
        _fsync_path(dest.parent)
        return staged
    aside = _temp_sibling(dest)
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


def _check_replaceable(dest: Path) -> None:
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


def _remove_if_unlocked(path: Path) -> bool:
    """Remove `path` if no live writer holds its flock; True if removed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except (FileNotFoundError, NotADirectoryError):
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False  # a live writer holds it (from another pid namespace, say)
    else:
        _remove_tree(path)
        return True
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return True  # not a pid a writer could have: leave the directory alone
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_tree(path: Path) -> None:
    """rmtree that tolerates entries vanishing under it (another cleaner got there first)."""

    def tolerate_missing(exc: BaseException) -> None:
        if not isinstance(exc, FileNotFoundError):
            raise exc

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=lambda _fn, _path, exc: tolerate_missing(exc))
    else:
        shutil.rmtree(path, onerror=lambda _fn, _path, info: tolerate_missing(info[1]))


def _write_durably(path: Path, data: bytes) -> None:
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


# ---------------------------------------------------------------- small helpers


def _bad(root: Path, reason: str) -> BadSnapshot:
    return BadSnapshot(_one_line(f"snapshot {root}: {reason}"))


def _one_line(message: str) -> str:
    return " ".join(message.splitlines())


def _mismatch(expected: _Range, got: str) -> str:
    return f"expected {expected.sha256[:16]}.., got {got[:16]}.."


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_hex64(value: Any) -> bool:
    return isinstance(value, str) and _HEX64.fullmatch(value) is not None


def _num_chunks(size: int, chunk_bytes: int) -> int:
    return -(-size // chunk_bytes)
