"""The local snapshot cache: a snapshot in S3 is pulled once, then restored from local disk.

    config = SnapshotCacheConfig.from_env(os.environ)
    path = cached_snapshot("s3://bucket/snapshots/llama", config)   # pulls on a miss

Settings: `root` from SNAPFN_SNAPSHOT_CACHE (default `$XDG_CACHE_HOME/snapfn/snapshots`, else
`~/.cache/snapfn/snapshots`); `max_bytes` from SNAPFN_SNAPSHOT_CACHE_MAX_BYTES (default 100 GiB;
`parse_byte_count` reads `20G`, `512MiB`, plain bytes). Flags override both.

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
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from snapfn.snapshot.errors import BadRequest
from snapfn.snapshot.portable.format import MANIFEST, parse_manifest
from snapfn.snapshot.portable.signature import configured
from snapfn.snapshot.portable.staging import remove_tree
from snapfn.snapshot.stages import Log, stderr_log
from snapfn.snapshot.store.s3 import S3Location, format_bytes, make_s3_client
from snapfn.snapshot.store.transfer import DEFAULT_NUM_THREADS, fetch_manifest, pull

__all__ = ["DEFAULT_MAX_BYTES", "SnapshotCacheConfig", "cached_snapshot", "parse_byte_count"]

DEFAULT_MAX_BYTES = 100 << 30
_LOCK = ".lock"
_BYTE_COUNT = re.compile(r"(\d+)\s*([kmgt]?)(?:i?b)?", re.IGNORECASE)


@dataclass(frozen=True)
class SnapshotCacheConfig:
    root: Path
    max_bytes: int = DEFAULT_MAX_BYTES

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
    ) -> SnapshotCacheConfig:
        """Defaults, then SNAPFN_SNAPSHOT_CACHE(_MAX_BYTES), then the arguments (CLI flags)."""
        if root is None:
            root = environ.get("SNAPFN_SNAPSHOT_CACHE") or _default_root(environ)
        if max_bytes is None:
            max_bytes = environ.get("SNAPFN_SNAPSHOT_CACHE_MAX_BYTES", DEFAULT_MAX_BYTES)
        return cls(Path(root), parse_byte_count(max_bytes))


def parse_byte_count(value: str | int) -> int:
    """`123`, `64K`, `512MiB`, `20G`, `1TB` → bytes (binary units); BadRequest otherwise."""
    if isinstance(value, int):
        return value
    match = _BYTE_COUNT.fullmatch(value.strip())
    if match is None:
        raise BadRequest(f"{value!r} is not a byte count (e.g. 20G, 512MiB, 1048576)")
    return int(match.group(1)) << (10 * " kmgt".index(match.group(2).lower() or " "))


def cached_snapshot(
    uri: str,
    config: SnapshotCacheConfig,
    *,
    endpoint_url: str | None = None,
    client: Any = None,
    log: Log | None = stderr_log,
) -> Path:
    """The local folder of the snapshot at `uri`: from the cache, or pulled into it first."""
    where = S3Location.parse(uri)
    client = client or make_s3_client(endpoint_url, DEFAULT_NUM_THREADS)
    raw = fetch_manifest(client, where)
    manifest = parse_manifest(where, raw)
    key = hashlib.sha256(f"{where}\n{hashlib.sha256(raw).hexdigest()}".encode()).hexdigest()
    entry = config.root / key[:32]
    dest = entry / where.name
    config.root.mkdir(parents=True, exist_ok=True)
    with _locked(config.root / _LOCK):
        if not (dest / MANIFEST).is_file():
            need = sum(f["size"] for f in manifest["files"].values()) + len(raw)
            _evict(config, keep=entry, room_bytes=need, log=log)
            entry.mkdir(exist_ok=True)
            pull(uri, dest, client=client, manifest_bytes=raw, log=log)
            if log is not None and configured() is None:
                log(
                    f"snapshot cache: {where} is trusted on its own digests only (its compile "
                    "caches run as code): set SNAPFN_SNAPSHOT_KEY to require signed snapshots"
                )
        elif log is not None:
            log(f"snapshot cache hit: {where} is at {dest}")
        _mark_used(config.root, entry)
    return dest


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
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
