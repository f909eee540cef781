"""The local snapshot cache: a snapshot in S3 is pulled once, then restored from local disk.

    config = SnapshotCacheConfig.from_env(os.environ)
    path = cached_snapshot("s3://bucket/snapshots/llama", config)   # pulls on a miss

    opened = open_snapshot(uri, config, streamed=("weights/rank0.bin",))
    restore(make_fn, opened.path, arriving=opened.pull)             # a miss: restored as it pulls

Settings: `root` from SNAPFN_SNAPSHOT_CACHE (default `$XDG_CACHE_HOME/snapfn/snapshots`, else
`~/.cache/snapfn/snapshots`); `max_bytes` from SNAPFN_SNAPSHOT_CACHE_MAX_BYTES (default 100 GiB;
`parse_byte_count` reads `20G`, `512MiB`, plain bytes); `overlap` from
SNAPFN_SNAPSHOT_CACHE_OVERLAP (`on`, the default, or `off`). Flags override them.

Overlapped restore (`open_snapshot`): on a miss, with `overlap` on, a portable snapshot that
lists the `streamed` files is pulled on a thread (store/overlap.py) and `opened.path` is the
pull's staging folder, which the restore reads as it fills; a hit, `overlap` off, a process
snapshot (its image is restored whole) or no streamed file listed: pulled whole first, as
`cached_snapshot` does, and `opened.pull` is None. The cache-wide flock is then held by the
pull's thread until the pull ends (published or failed), so the rules below hold as for a whole
pull; the entry's last use is marked when it ends. An overlapped restore that falls back does
not rewrite the entry: the pull publishes what S3 holds, verified, or leaves its resumable
staging dir and no snapshot.

A refused pull (`open_snapshot`; a bad object: missing, truncated, corrupt) is not raised:
`opened.refused` says why (one line, logged) and the restore falls back from what is left,
publishing nothing. A process snapshot of a one-rank restore (overlap on, a streamed file
listed) is then restored from its portable tier while that is pulled, on a thread as above:
`opened.pull` fetches every file but the process images into the same staging dir, through the
same journal, and publishes nothing (a restore of it that is refused too falls back to a cold
init). Any other (several ranks, overlap off, a user function): `opened.path` is a folder named
as the snapshot that holds only its manifest.json (and manifest.sig),
`ROOT/<key>/.refused-<16 hex>/<name>/`; the restore refuses it, and its cold init reads the model
the user named, else the source that manifest records, verified by its content hash. That
folder is never the entry's (the next resolution is a miss, which pulls again); it is flock'ed
while the process that made it lives, and a later refusal of the entry removes those no process
holds.

With a snapshot key configured (portable/signature.py), every resolution checks the remote
manifest's signature beside the manifest (one more small GET): an unsigned manifest, or one the
key did not sign, is refused before anything is pulled, so no fallback ever reads a source it
records.

Layout: `ROOT/<key>/<name>/` is one snapshot, `key` the first 32 hex digits of
sha256(uri + "\\n" + sha256(manifest.json)) and `name` the URI's last part (a served model keeps
its name). Every resolution fetches the remote manifest (one small GET), so a new push under the
same URI is a new entry, pulled afresh, and the old one ages out. An entry's mtime is its last
use. Before a pull, least recently used entries are removed until the new one fits in
`max_bytes`; a snapshot larger than the whole bound is still pulled, with a warning. A cache-wide
flock (`ROOT/.lock`) serialises resolutions, so two processes never pull the same snapshot at
once; an interrupted pull resumes from its staging dir inside the entry (pull_staging.py).

Eviction does not know which entries other processes are restoring from: a restore whose files
vanish under it fails a check and falls back to a cold init. A restore that falls back rewrites
its snapshot in place (runtime.py): the entry then holds the snapshot made on this machine, and
is used as such until it is evicted.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import secrets
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from snapfn.snapshot.errors import BadRequest, BadSnapshot, IncompatibleSnapshot, one_line
from snapfn.snapshot.portable.format import MANIFEST, PROCESS_IMAGES, parse_manifest
from snapfn.snapshot.portable.publish import write_durably
from snapfn.snapshot.portable.signature import SIGNATURE, configured
from snapfn.snapshot.portable.staging import remove_if_unlocked, remove_tree
from snapfn.snapshot.stages import Log, stderr_log
from snapfn.snapshot.store.s3 import S3Location, format_bytes, make_s3_client
from snapfn.snapshot.store.transfer import (
    DEFAULT_NUM_THREADS,
    fetch_manifest,
    fetch_signature,
    pull,
)

if TYPE_CHECKING:
    from snapfn.snapshot.store.overlap import OverlappedPull

__all__ = [
    "DEFAULT_MAX_BYTES",
    "OpenedSnapshot",
    "SnapshotCacheConfig",
    "cached_snapshot",
    "deferred_miss",
    "open_snapshot",
    "parse_byte_count",
]

DEFAULT_MAX_BYTES = 100 << 30
_LOCK = ".lock"
_REFUSED = ".refused-"  # ROOT/<key>/.refused-<16 hex>/<name>/: a refused snapshot's manifest
_BYTE_COUNT = re.compile(r"(\d+)\s*([kmgt]?)(?:i?b)?", re.IGNORECASE)


@dataclass(frozen=True)
class SnapshotCacheConfig:
    root: Path
    max_bytes: int = DEFAULT_MAX_BYTES
    overlap: bool = True  # a miss is restored while it is pulled (open_snapshot)

    def __post_init__(self) -> None:
        if self.max_bytes <= 0:
            raise BadRequest(f"the snapshot cache bound must be positive, not {self.max_bytes}")

    @classmethod
    def from_env(
        cls,
        environ: Mapping[str, str],
        *,
        root: str | os.PathLike[str] | None = None,
        max_bytes: str | int | None = None,
        overlap: bool | None = None,
    ) -> SnapshotCacheConfig:
        """Defaults, then SNAPFN_SNAPSHOT_CACHE(_MAX_BYTES, _OVERLAP), then the arguments (CLI
        flags)."""
        if root is None:
            root = environ.get("SNAPFN_SNAPSHOT_CACHE") or _default_root(environ)
        if max_bytes is None:
            max_bytes = environ.get("SNAPFN_SNAPSHOT_CACHE_MAX_BYTES", DEFAULT_MAX_BYTES)
        if overlap is None:
            overlap = _on_or_off(environ.get("SNAPFN_SNAPSHOT_CACHE_OVERLAP", "on"))
        return cls(Path(root), parse_byte_count(max_bytes), overlap)


def _on_or_off(value: str) -> bool:
    if value.strip().lower() not in ("on", "off"):
        raise BadRequest(f"SNAPFN_SNAPSHOT_CACHE_OVERLAP must be on or off, not {value!r}")
    return value.strip().lower() == "on"


def parse_byte_count(value: str | int) -> int:
    """`123`, `64K`, `512MiB`, `20G`, `1TB` → bytes (binary units); BadRequest otherwise."""
    if isinstance(value, int):
        return value
    match = _BYTE_COUNT.fullmatch(value.strip())
    if match is None:
        raise BadRequest(f"{value!r} is not a byte count (e.g. 20G, 512MiB, 1048576)")
    return int(match.group(1)) << (10 * " kmgt".index(match.group(2).lower() or " "))


@dataclass(frozen=True)
class OpenedSnapshot:
    """Where to restore an s3:// snapshot from: its cache entry's folder, published; or, on an
    overlapped miss, the folder `pull` is filling (pass `pull` as the restore's `arriving`).
    After a refused pull (`refused`: why, one line): the folder its portable tier's `pull` is
    filling, else a folder holding only its manifest (module docstring)."""

    path: Path
    pull: OverlappedPull | None = None
    refused: str | None = None


@dataclass(frozen=True)
class _Entry:
    where: S3Location
    raw: bytes  # the remote manifest.json
    signature: bytes | None  # its manifest.sig, checked (fetched only with a key configured)
    manifest: dict[str, Any]
    entry: Path  # ROOT/<key>
    dest: Path  # ROOT/<key>/<name>: the snapshot once published

    @property
    def need_bytes(self) -> int:
        return sum(f["size"] for f in self.manifest["files"].values()) + len(self.raw)


def cached_snapshot(
    uri: str,
    config: SnapshotCacheConfig,
    *,
    endpoint_url: str | None = None,
    client: Any = None,
    log: Log | None = stderr_log,
) -> Path:
    """The local folder of the snapshot at `uri`: from the cache, or pulled into it first."""
    client = client or make_s3_client(endpoint_url, DEFAULT_NUM_THREADS)
    found = _find_entry(uri, config, client)
    with _locked(config.root / _LOCK):
        _pull_or_hit(found, config, client, log)
        _mark_used(config.root, found.entry)
    return found.dest


def open_snapshot(
    uri: str,
    config: SnapshotCacheConfig,
    *,
    streamed: tuple[str, ...] = (),
    endpoint_url: str | None = None,
    client: Any = None,
    log: Log | None = stderr_log,
) -> OpenedSnapshot:
    """`cached_snapshot`, except that a miss is pulled on a thread while the caller restores
    from `OpenedSnapshot.path`, and that a refused pull is restored from what is left instead
    of raised (module docstring: when, and what it keeps true). A refused manifest raises."""
    client = client or make_s3_client(endpoint_url, DEFAULT_NUM_THREADS)
    found = _find_entry(uri, config, client)
    fd = _lock(config.root / _LOCK)
    opened = None
    try:
        opened = _open_locked(found, config, client, streamed, fd, log)
    finally:
        if opened is None or opened.pull is None:  # NOTE: else the pull's thread closes it
            os.close(fd)
    return opened


def _open_locked(
    found: _Entry,
    config: SnapshotCacheConfig,
    client: Any,
    streamed: tuple[str, ...],
    fd: int,
    log: Log | None,
) -> OpenedSnapshot:
    """`open_snapshot` once the cache's lock (`fd`) is held."""
    if _overlaps(found, config, streamed):
        _make_room(found, config, log)
        miss = f"snapshot cache miss: restoring {found.where} while it is pulled into {found.dest}"
        _say(log, miss)
        return _follow(found, config, client, streamed, fd, log)
    refused = _pull_whole(found, config, client, log)
    if refused is not None and _restorer_pulls(found, config, streamed):
        _say(log, f"{refused}; restoring its portable tier while that is pulled")
        return _follow(found, config, client, streamed, fd, log, refused)
    _mark_used(config.root, found.entry)
    if refused is None:
        return OpenedSnapshot(found.dest)
    _say(log, f"{refused}; restoring from its manifest alone, which falls back to a cold init")
    return OpenedSnapshot(_refused_copy(found), refused=refused)


def _follow(
    found: _Entry,
    config: SnapshotCacheConfig,
    client: Any,
    streamed: tuple[str, ...],
    fd: int,
    log: Log | None,
    refused: str | None = None,
) -> OpenedSnapshot:
    """An OpenedSnapshot whose pull runs on a thread, which closes `fd` when it ends: the whole
    snapshot, or after a refusal (`refused`) every file but the process images."""
    from snapfn.snapshot.store.overlap import OverlappedPull

    def on_exit() -> None:
        _mark_used(config.root, found.entry)
        os.close(fd)

    files = sorted(found.manifest["files"])
    part = None if refused is None else tuple(p for p in files if not p.startswith(PROCESS_IMAGES))
    pull = OverlappedPull(
        str(found.where),
        found.dest,
        found.raw,
        streamed=streamed,
        client=client,
        num_threads=DEFAULT_NUM_THREADS,
        log=log,
        on_exit=on_exit,
        part=part,
        refused=refused,
    )
    return OpenedSnapshot(pull.files, pull.start(), refused)


def deferred_miss(
    uri: str,
    config: SnapshotCacheConfig,
    *,
    streamed: tuple[str, ...],
    endpoint_url: str | None = None,
    client: Any = None,
) -> Path | None:
    """The folder `open_snapshot(uri, …)` would publish into if the process that restores
    pulls it: a miss with overlap on whose streamed file is listed (a portable snapshot
    restored as it is pulled; a process snapshot pulled whole, or on a refusal its portable
    tier restored as that is pulled), else None; fetches, pulls and locks nothing else. A front
    door that forks its workers asks this before the fork, so that the worker that restores is
    the process that pulls."""
    client = client or make_s3_client(endpoint_url, DEFAULT_NUM_THREADS)
    found = _find_entry(uri, config, client)
    return found.dest if _restorer_pulls(found, config, streamed) else None


def _find_entry(uri: str, config: SnapshotCacheConfig, client: Any) -> _Entry:
    """The cache entry of `uri`'s current manifest (one GET; with a snapshot key, two: its
    signature is checked before anything in it is trusted)."""
    where = S3Location.parse(uri)
    raw = fetch_manifest(client, where)
    key = configured()
    signature = None if key is None else fetch_signature(client, where, raw, key)
    manifest = parse_manifest(where, raw)
    digest = hashlib.sha256(f"{where}\n{hashlib.sha256(raw).hexdigest()}".encode()).hexdigest()
    entry = config.root / digest[:32]
    config.root.mkdir(parents=True, exist_ok=True)
    return _Entry(where, raw, signature, manifest, entry, entry / where.name)


def _restorer_pulls(found: _Entry, config: SnapshotCacheConfig, streamed: tuple[str, ...]) -> bool:
    """Whether the process that restores pulls a miss itself (`deferred_miss`): overlap on, a
    miss, a streamed file listed."""
    if not config.overlap or (found.dest / MANIFEST).is_file():
        return False
    return any(p in found.manifest["files"] for p in streamed)


def _overlaps(found: _Entry, config: SnapshotCacheConfig, streamed: tuple[str, ...]) -> bool:
    """Whether a restore should follow the pull: a miss, overlap on, a portable snapshot that
    lists a streamed file."""
    tier = found.manifest.get("tier", "portable")
    return _restorer_pulls(found, config, streamed) and tier != "process"


def _pull_whole(
    found: _Entry, config: SnapshotCacheConfig, client: Any, log: Log | None
) -> str | None:
    """`_pull_or_hit`; why its pull was refused (one line), or None (the lock is held)."""
    try:
        _pull_or_hit(found, config, client, log)
    except (BadSnapshot, IncompatibleSnapshot) as exc:
        return one_line(f"{type(exc).__name__}: {exc}")
    return None


def _refused_copy(found: _Entry) -> Path:
    """`ROOT/<key>/.refused-<16 hex>/<name>/`, holding only the refused snapshot's manifest.json
    and manifest.sig, for a restore to refuse and fall back from (the lock is held).

    NOTE: the folder's parent is flock'ed through an fd that is never closed, so the lock lasts
    as long as this process and its forks may restore from it; copies no process holds (older
    refusals of this entry) are removed first."""
    for older in found.entry.glob(f"{_REFUSED}*"):
        remove_if_unlocked(older)
    holder = found.entry / f"{_REFUSED}{secrets.token_hex(8)}"
    holder.mkdir()
    fcntl.flock(os.open(holder, os.O_RDONLY | os.O_DIRECTORY), fcntl.LOCK_EX)
    folder = holder / found.where.name
    folder.mkdir()
    if found.signature is not None:
        write_durably(folder / SIGNATURE, found.signature)
    write_durably(folder / MANIFEST, found.raw)
    return folder


def _say(log: Log | None, line: str) -> None:
    if log is not None:
        log(line)


def _pull_or_hit(found: _Entry, config: SnapshotCacheConfig, client: Any, log: Log | None):
    """A hit logs itself; a miss is pulled whole into the entry (the lock is held)."""
    if (found.dest / MANIFEST).is_file():
        if log is not None:
            log(f"snapshot cache hit: {found.where} is at {found.dest}")
        return
    _make_room(found, config, log)
    pull(str(found.where), found.dest, client=client, manifest_bytes=found.raw, log=log)


def _make_room(found: _Entry, config: SnapshotCacheConfig, log: Log | None) -> None:
    """Evict for the entry, make its folder (the lock is held)."""
    _evict(config, keep=found.entry, room_bytes=found.need_bytes, log=log)
    found.entry.mkdir(exist_ok=True)
    if log is not None and configured() is None:
        log(
            f"snapshot cache: {found.where} is trusted on its own digests only (its compile "
            "caches run as code): set SNAPFN_SNAPSHOT_KEY to require signed snapshots"
        )


def _mark_used(root: Path, entry: Path) -> None:
    """Make `entry` the most recently used: its mtime is its last use, the LRU order.

    NOTE: set past every other entry's mtime, in nanoseconds, because the clock a file's mtime
    is taken from ticks in milliseconds: two uses within one tick would otherwise tie.
    """
    newest = max(
        (p.stat().st_mtime_ns for p in root.iterdir() if p.is_dir() and p != entry), default=0
    )
    now = max(time.time_ns(), newest + 1)
    os.utime(entry, ns=(now, now))


def _evict(config: SnapshotCacheConfig, keep: Path, room_bytes: int, log: Log | None) -> None:
    """Remove least recently used entries (never `keep`) until `keep`'s `room_bytes` fit."""
    entries = sorted(
        (p for p in config.root.iterdir() if p.is_dir() and p != keep),  # .lock is a file
        key=lambda p: p.stat().st_mtime_ns,
    )
    sizes = {p: _tree_bytes(p) for p in entries}
    used = sum(sizes.values())
    for victim in entries:
        if used + room_bytes <= config.max_bytes:
            break
        remove_tree(victim)
        used -= sizes[victim]
        if log is not None:
            log(
                f"snapshot cache: evicted {victim} ({format_bytes(sizes[victim])}, least recently used)"
            )
    if used + room_bytes > config.max_bytes and log is not None:
        log(
            f"snapshot cache: {format_bytes(used + room_bytes)} needed, over its bound of "
            f"{format_bytes(config.max_bytes)} (the snapshot alone does not fit)"
        )


def _tree_bytes(root: Path) -> int:
    total = 0
    for directory, _subdirs, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(directory, name)).st_size
            except FileNotFoundError:
                continue
    return total


def _default_root(environ: Mapping[str, str]) -> Path:
    base = environ.get("XDG_CACHE_HOME") or str(Path(environ.get("HOME", "/tmp")) / ".cache")
    return Path(base) / "snapfn" / "snapshots"


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive flock on `path` (created if missing), waiting for it."""
    fd = _lock(path)
    try:
        yield
    finally:
        os.close(fd)


def _lock(path: Path) -> int:
    """An fd of `path` (created if missing) holding an exclusive flock; closing it unlocks."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except BaseException:
        os.close(fd)
        raise
    return fd
