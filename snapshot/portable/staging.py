"""Staging directories: where a snapshot writer works before it publishes, and their cleanup.

A writer of `dest` fills a hidden temp sibling, `.<name>.tmp-<pid>-<16 hex>`, created by
`make_locked_temp_dir` and flock'ed (LOCK_EX on the directory) from creation until publish or
exit. A temp dir is stale when the pid in its name is not alive on this host and its lock can be
taken; `remove_stale_temp_dirs` removes those (the next writer of the same `dest` calls it), and
leaves alone anything whose pid lives, whose lock is held (a writer in another pid namespace), or
whose name does not match exactly. Removal tolerates entries vanishing under it (two cleaners).
`remove_if_unlocked` is also how a pull from the S3 store clears an abandoned staging dir.
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import shutil
import sys
from pathlib import Path

__all__ = [
    "make_locked_temp_dir",
    "remove_if_unlocked",
    "remove_stale_temp_dirs",
    "remove_tree",
    "temp_sibling",
]

_TEMP_SUFFIX = re.compile(r"(\d+)-[0-9a-f]{16}")


def temp_sibling(dest: Path) -> Path:
    """A fresh hidden name beside `dest` carrying this process's pid (nothing is created)."""
    return dest.with_name(f".{dest.name}.tmp-{os.getpid()}-{secrets.token_hex(8)}")


def make_locked_temp_dir(dest: Path) -> tuple[Path, int]:
    """mkdir a temp sibling of `dest` and flock it for as long as we write into it."""
    temp = temp_sibling(dest)
    temp.mkdir()
    fd = os.open(temp, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        remove_tree(temp)
        raise
    return temp, fd


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
        if match and not pid_alive(int(match.group(1))) and remove_if_unlocked(candidate):
            removed.append(candidate)
    return removed


def remove_tree(path: Path) -> None:
    """rmtree that tolerates entries vanishing under it (another cleaner got there first)."""

    def tolerate_missing(exc: BaseException) -> None:
        if not isinstance(exc, FileNotFoundError):
            raise exc

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=lambda _fn, _path, exc: tolerate_missing(exc))
    else:
        shutil.rmtree(path, onerror=lambda _fn, _path, info: tolerate_missing(info[1]))


def remove_if_unlocked(path: Path) -> bool:
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
        remove_tree(path)
        return True
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    """Whether `pid` may still be a process (True for a pid no process can have, and for one
    another user's process holds)."""
    if pid <= 0:
        return True  # not a pid a writer could have: leave the directory alone
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
