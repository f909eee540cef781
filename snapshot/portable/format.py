"""The snapshot directory format: the manifest's wire format, and reading and validating it.

A snapshot is a directory whose `manifest.json` lists every other regular file in it; nothing
else may be there (no unlisted file, no symlink, no special file). `publish.SnapshotWriter`
writes one, manifest last, and publishes it atomically. Wire format of manifest.json (a UTF-8
JSON object):

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
canonical), a size or chunk_bytes past `MAX_FILE_BYTES`, or a file that is missing or has another
size, or which holds a file it does not list.
The manifest is read with bounded size and depth (`MAX_MANIFEST_BYTES`, `MAX_JSON_DEPTH`):
anything but a regular file at `manifest.json` (a directory, a FIFO, a socket, a device, a
symlink) is refused from its `lstat`, before any read, and it is opened non-blocking in case it
is swapped meanwhile; it must be UTF-8. `load_json` is that bounded parser, for the tables
manifests carry too. The keys a function reads from its own section are its to check (the
runtime's `check_manifest` hook); `tier`, when present, is "portable" or "process".
`verify="sizes"` (every cold start) also hashes every file without `chunks`; chunked files are
verified by whoever streams them (`chunk_digests`, `check_chunk`). `verify="full"` hashes
everything, in parallel threads (digests.py).

The entry checks (`relpath_problem`, `entry_problem`, `digests_problem`) and `list_files` are
also what the writer applies before publishing, so it never writes a manifest this module refuses.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from collections.abc import Callable, Iterable
from pathlib import Path, PurePosixPath
from typing import Any

from snapfn.snapshot.errors import BadSnapshot, IncompatibleSnapshot, bad_snapshot, one_line
from snapfn.snapshot.portable.compat import FORMAT_VERSION, check_compat
from snapfn.snapshot.portable.digests import (
    DigestRange,
    digest_ranges,
    num_chunks,
    run_parallel,
    sha256_range,
)
from snapfn.snapshot.portable.signature import CONFIGURED, SIGNATURE, check_signature, configured

__all__ = [
    "MANIFEST",
    "VERIFY_MODES",
    "check_chunk",
    "chunk_digests",
    "digests_problem",
    "entry_problem",
    "list_files",
    "load_json",
    "parse_manifest",
    "read_manifest",
    "read_manifest_bytes",
    "relpath_problem",
    "validate_snapshot",
    "verify_files",
]

MANIFEST = "manifest.json"
VERIFY_MODES = ("sizes", "full")
# files whose reader checks each chunk's digest as it streams it, before any byte is used: the
# LLM's weights (weights/streamer.py) and a function's device memory image
# (handler/function/device_memory.py); every other file a restore reads is hashed first
STREAM_VERIFIED = re.compile(r"weights/rank\d+\.bin|process(-rank\d+)?/cuda\d+\.bin")
# a tier-1 snapshot's process image folders (`process`, `process-rank1`, …), which a tier-0
# restore does not read
PROCESS_IMAGES = ("process/", "process-rank")
TIERS = ("portable", "process")
# An 8B llama's manifest, its compile caches' 553 files listed, is ~0.2 MB, nested 9 deep.
MAX_MANIFEST_BYTES = 64 << 20
MAX_JSON_DEPTH = 32
# A listed file's size and chunk_bytes: 1 PiB, far past any model's weights, well inside off_t
# and a float's exact integers, so no size reaches os.ftruncate or arithmetic that overflows.
MAX_FILE_BYTES = 1 << 50
_REQUIRED_KEYS: dict[str, type] = {"created_at": str, "compat": dict, "files": dict}
_HEX64 = re.compile(r"[0-9a-f]{64}")


# ---------------------------------------------------------------- reading and validating


def read_manifest(snapshot_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Load and shape-check `snapshot_dir/manifest.json`; BadSnapshot/IncompatibleSnapshot if not."""
    root = Path(snapshot_dir)
    return parse_manifest(root, read_manifest_bytes(root))


def read_manifest_bytes(snapshot_dir: str | os.PathLike[str]) -> bytes:
    """The exact bytes of `snapshot_dir/manifest.json`, at most MAX_MANIFEST_BYTES of them.

    BadSnapshot (one line) when the directory or the file is missing, or when the file is not
    a regular one — refused from its `lstat`, before any read (a FIFO would block the reader) —
    or is larger than that.
    """
    root = Path(snapshot_dir)
    if not root.is_dir():
        raise bad_snapshot(root, "no snapshot directory there")
    return read_regular_file(root, MANIFEST, MAX_MANIFEST_BYTES)


def read_regular_file(root: Path, relpath: str, max_bytes: int) -> bytes:
    """The bytes of `root/relpath`, refused (BadSnapshot naming `root`) unless it is a regular
    file of at most `max_bytes`: the kind is checked before it is opened, and the open neither
    follows a symlink nor blocks on a FIFO swapped in meanwhile."""
    path = root / relpath
    try:
        kind = _kind(os.lstat(path).st_mode)
        if kind is None:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                info = os.fstat(fd)
                kind = _kind(info.st_mode)
                if kind is None and info.st_size <= max_bytes:
                    return _read_at_most(fd, relpath, root, max_bytes)
            finally:
                os.close(fd)
    except FileNotFoundError:
        raise bad_snapshot(root, f"{relpath} is missing (incomplete or not a snapshot)") from None
    except OSError as e:
        raise bad_snapshot(root, f"cannot read {relpath}: {e.strerror}") from None
    if kind is not None:
        raise bad_snapshot(root, f"{relpath} is {kind}, not a regular file")
    raise bad_snapshot(
        root, f"{relpath} is {info.st_size} bytes, more than the {max_bytes} allowed"
    )


def _read_at_most(fd: int, relpath: str, root: Path, max_bytes: int) -> bytes:
    pieces, total = [], 0
    while piece := os.read(fd, min(1 << 20, max_bytes + 1 - total)):
        pieces.append(piece)
        total += len(piece)
        if total > max_bytes:  # it grew while being read
            raise bad_snapshot(root, f"{relpath} is more than the {max_bytes} bytes allowed")
    return b"".join(pieces)


def _kind(mode: int) -> str | None:
    """None for a regular file, else what the file is, for a refusal."""
    if stat.S_ISREG(mode):
        return None
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symlink"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    )
    return next((name for test, name in kinds if test(mode)), "a special file")


def load_json(data: bytes | str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse JSON text (UTF-8 when bytes) nested at most `max_depth` containers deep.

    ValueError (its message one line, saying what is wrong) otherwise: invalid UTF-8, invalid
    JSON, an object naming a key twice (parsers disagree on which one counts: a file or tensor
    listed twice would be read one way and checked another), or nesting deeper than that — the parser's own recursion limit included, so a deeply
    nested document is refused rather than raising RecursionError. Size is the caller's bound
    (it read the bytes).
    """
    try:
        text = data.decode("utf-8") if isinstance(data, bytes | bytearray) else data
        doc = json.loads(text, object_pairs_hook=_object_of_unique_keys)
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 ({e.reason} at byte {e.start})") from None
    except RecursionError:
        raise ValueError(f"nested more than {max_depth} levels deep") from None
    except _DuplicateKey as e:
        raise ValueError(str(e)) from None
    except ValueError as e:  # JSONDecodeError
        raise ValueError(one_line(f"not valid JSON ({e})")) from None
    if _depth_exceeds(doc, max_depth):
        raise ValueError(f"nested more than {max_depth} levels deep")
    return doc


class _DuplicateKey(ValueError):
    pass


def _object_of_unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    doc = dict(pairs)
    if len(doc) != len(pairs):
        seen: set[str] = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise _DuplicateKey(f"an object names the key {_r(twice, 80)} twice")
    return doc


def _depth_exceeds(doc: Any, max_depth: int) -> bool:
    """Whether `doc` nests containers more than `max_depth` deep (walked without recursion)."""
    pending = [(doc, 1)] if isinstance(doc, dict | list) else []
    while pending:
        node, depth = pending.pop()
        if depth > max_depth:
            return True
        children = node.values() if isinstance(node, dict) else node
        pending.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False


def parse_manifest(where: object, data: bytes) -> dict[str, Any]:
    """Parse and shape-check the bytes of a manifest.json; `where` names the snapshot in refusals.

    `read_manifest` reads a directory's; the S3 store (store/transfer.py) checks a fetched one with it.
    """
    if len(data) > MAX_MANIFEST_BYTES:
        raise bad_snapshot(
            where, f"{MANIFEST} is {len(data)} bytes, more than the {MAX_MANIFEST_BYTES} allowed"
        )
    try:
        manifest = load_json(data)
    except ValueError as e:
        raise bad_snapshot(where, f"{MANIFEST} is {e}") from None
    _check_manifest_shape(where, manifest)
    return manifest


def validate_snapshot(
    snapshot_dir: str | os.PathLike[str],
    current_compat: dict[str, Any] | None = None,
    verify: str = "sizes",
    num_threads: int | None = None,
    key: Any = CONFIGURED,
    compat_fields: Iterable[str] | None = None,
    manifest_bytes: bytes | None = None,
    unread: Callable[[str], bool] | None = None,
) -> dict[str, Any]:
    """Return the manifest of a snapshot that passes every check; raise (one line) otherwise.

    `manifest_bytes`: the manifest to check the directory against, instead of its own
    manifest.json (a snapshot still being pulled into it, which has none yet: store/overlap.py).

    `compat_fields`: the compat key's fields that must match `current_compat` (default: all;
    a portable restore passes compat.LAYOUT_FIELDS and drops the caches on the rest).

    `verify="sizes"`: listing, sizes, and the digests of every file a restore reads as it is,
    hashed in parallel threads: all but the files whose reader checks each chunk as it streams
    it (`STREAM_VERIFIED`: the weights, a function's device memory) and those `unread(path)`
    says this restore does not read (a tier-0 restore: the process images, `PROCESS_IMAGES`).
    `verify="full"`: every chunk digest and whole-file sha256 of every file.
    With a snapshot key (`key`, by default the configured one: signature.py) the manifest's
    signature is checked first, before anything in it is trusted.
    """
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {VERIFY_MODES}, not {verify!r}")
    root = Path(snapshot_dir)
    raw = read_manifest_bytes(root) if manifest_bytes is None else manifest_bytes
    check_signature(root, configured(key), raw)
    manifest = parse_manifest(root, raw)
    if current_compat is not None:
        try:
            check_compat(manifest["compat"], current_compat, compat_fields)
        except IncompatibleSnapshot as e:
            raise IncompatibleSnapshot(one_line(f"snapshot {root}: {e}")) from None
    files = manifest["files"]
    check_listing(root, files)
    skipped = unread or (lambda _: False)
    read = [p for p in files if not STREAM_VERIFIED.fullmatch(p) and not skipped(p)]
    verify_files(root, manifest, sorted(files) if verify == "full" else read, num_threads)
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
    ranges = sorted(r for p in relpaths for r in digest_ranges(p, manifest["files"][p]))
    verify_ranges(snapshot_dir, ranges, num_threads)


def verify_ranges(
    snapshot_dir: str | os.PathLike[str],
    ranges: list[DigestRange],
    num_threads: int | None = None,
    where: Any = None,
    hash_range: Callable[[DigestRange], str] | None = None,
) -> None:
    """Hash `ranges` of the files under `snapshot_dir` in parallel (`hash_range`, by default
    each file opened by its path); BadSnapshot (naming `where`, else the directory) at the first
    mismatch, in the given order."""
    root = Path(snapshot_dir)
    hash_range = hash_range or (lambda r: sha256_range(root, r))
    digests = run_parallel(hash_range, ranges, num_threads)
    for expected, got in zip(ranges, digests, strict=True):
        if got != expected.sha256:
            raise bad_snapshot(
                root if where is None else where,
                f"{expected.describe()} sha256 mismatch ({_mismatch(expected, got)})",
            )


def chunk_digests(manifest: dict[str, Any], relpath: str) -> tuple[int, list[str]]:
    """(chunk_bytes, per-chunk sha256) of `relpath`; a file without chunks is one chunk."""
    entry = manifest["files"].get(relpath)
    if entry is None:
        raise BadSnapshot(one_line(f"{relpath!r} is not listed in {MANIFEST}"))
    if "chunks" in entry:
        return entry["chunk_bytes"], list(entry["chunks"])
    return entry["size"], [entry["sha256"]]


def check_chunk(relpath: str, index: int, data: bytes | memoryview, expected_sha256: str) -> None:
    """Raise BadSnapshot unless sha256(`data`) is `expected_sha256` (chunk `index` of relpath)."""
    got = hashlib.sha256(data).hexdigest()
    if got != expected_sha256:
        raise BadSnapshot(
            one_line(
                f"{relpath!r} chunk {index} sha256 mismatch "
                f"(expected {expected_sha256[:16]}.., got {got[:16]}..)"
            )
        )


# ---------------------------------------------------------------- manifest shape and listing


def _check_manifest_shape(root: object, manifest: Any) -> None:
    if not isinstance(manifest, dict):
        raise bad_snapshot(root, f"{MANIFEST} is not a JSON object")
    if "format_version" not in manifest:
        raise bad_snapshot(root, f"{MANIFEST} lacks required key 'format_version'")
    version = manifest["format_version"]
    if isinstance(version, bool) or version != FORMAT_VERSION:
        raise IncompatibleSnapshot(
            one_line(
                f"snapshot {root}: format_version is {_r(version)}, this build reads {FORMAT_VERSION}"
            )
        )
    for key, kind in _REQUIRED_KEYS.items():
        if key not in manifest:
            raise bad_snapshot(root, f"{MANIFEST} lacks required key {key!r}")
        if not isinstance(manifest[key], kind):
            raise bad_snapshot(root, f"{MANIFEST} key {key!r} is not a JSON {kind.__name__}")
    for key, kind in (("tier", str), ("function", str)):
        if key in manifest and not isinstance(manifest[key], kind):
            raise bad_snapshot(root, f"{MANIFEST} key {key!r} is not a JSON {kind.__name__}")
    if manifest.get("tier", "portable") not in TIERS:
        raise bad_snapshot(root, f"{MANIFEST} tier {_r(manifest['tier'])} is not one of {TIERS}")
    for relpath, entry in manifest["files"].items():
        problem = relpath_problem(relpath) or entry_problem(entry)
        if problem:
            raise bad_snapshot(root, f"{MANIFEST} lists {_r(relpath)}: {problem}")


def relpath_problem(relpath: str) -> str | None:
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


def entry_problem(entry: Any) -> str | None:
    """Why a `files` entry is malformed, or None."""
    if not isinstance(entry, dict):
        return "entry is not a JSON object"
    size, sha256, chunks = entry.get("size"), entry.get("sha256"), entry.get("chunks")
    if not _is_count(size):
        return f"size {_r(size)} is not a byte count"
    if size > MAX_FILE_BYTES:
        return f"size {_r(size)} is more than the {MAX_FILE_BYTES} bytes a listed file may have"
    if chunks is None:
        return None if _is_hex64(sha256) else f"sha256 {_r(sha256)} is not 64 lowercase hex digits"
    chunk_bytes = entry.get("chunk_bytes")
    problem = digests_problem(chunk_bytes, chunks, sha256)
    if problem is None and len(chunks) != num_chunks(size, chunk_bytes):
        return f"{len(chunks)} chunk digests for {size} bytes in chunks of {chunk_bytes}"
    return problem


def digests_problem(chunk_bytes: Any, chunks: Any, file_sha256: Any) -> str | None:
    """Why chunk digests (and an optional whole-file sha256) are malformed, or None."""
    if not _is_count(chunk_bytes) or chunk_bytes == 0:
        return f"chunk_bytes {_r(chunk_bytes)} is not a positive byte count"
    if chunk_bytes > MAX_FILE_BYTES:
        return f"chunk_bytes {_r(chunk_bytes)} is more than the {MAX_FILE_BYTES} bytes allowed"
    if not isinstance(chunks, list) or not all(_is_hex64(c) for c in chunks):
        return "chunks is not a list of sha256 digests (64 lowercase hex digits)"
    if file_sha256 is not None and not _is_hex64(file_sha256):
        return f"sha256 {_r(file_sha256)} is not 64 lowercase hex digits"
    return None


def check_listing(root: Path, files: dict[str, Any]) -> None:
    """Every listed file exists with its recorded size; nothing unlisted is there."""
    on_disk = list_files(root)
    on_disk.pop(MANIFEST, None)
    on_disk.pop(SIGNATURE, None)  # the manifest's signature, which it cannot list
    for relpath in sorted(files):
        if relpath not in on_disk:
            raise bad_snapshot(root, f"{_r(relpath)} is listed in {MANIFEST} but missing")
        if on_disk[relpath] != files[relpath]["size"]:
            raise bad_snapshot(
                root,
                f"{_r(relpath)} has {on_disk[relpath]} bytes, {MANIFEST} says "
                f"{files[relpath]['size']} (truncated or overwritten)",
            )
    extra = sorted(set(on_disk) - set(files))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise bad_snapshot(root, f"{extra[0]!r} is not listed in {MANIFEST}{more}")


def list_files(root: Path) -> dict[str, int]:
    """relpath -> size of every regular file under `root`; refuses symlinks and special files."""
    files: dict[str, int] = {}
    pending = [(root, "")]
    while pending:
        directory, prefix = pending.pop()
        with os.scandir(directory) as entries:
            for entry in entries:
                relpath = prefix + entry.name
                if entry.is_symlink():
                    raise bad_snapshot(
                        root, f"{relpath!r} is a symlink (not allowed in a snapshot)"
                    )
                if entry.is_dir(follow_symlinks=False):
                    pending.append((Path(entry.path), relpath + "/"))
                elif entry.is_file(follow_symlinks=False):
                    files[relpath] = entry.stat(follow_symlinks=False).st_size
                else:
                    raise bad_snapshot(root, f"{relpath!r} is not a regular file or directory")
    return files


# ---------------------------------------------------------------- small helpers


def _r(value: Any, limit: int = 200) -> str:
    """repr(value), cut to `limit` characters: a refusal quotes a manifest's values, not pages."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}.."


def _mismatch(expected: DigestRange, got: str) -> str:
    return f"expected {expected.sha256[:16]}.., got {got[:16]}.."


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_hex64(value: Any) -> bool:
    return isinstance(value, str) and _HEX64.fullmatch(value) is not None
