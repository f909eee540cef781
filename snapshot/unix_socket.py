"""Unix sockets with only this user (or root) at the other end: the private directory the
keeper's and the zygote's sockets live in, and the peer check every connection passes.

    default_dir(environ)          $XDG_RUNTIME_DIR, else /tmp, + /snapfn-UID: where the keeper's
                                  socket goes unless told otherwise
    ensure_private_dir(path)      a server's: made 0700 when missing; else it must be a directory
                                  (not a link) of this user with no access for group or others
    private_dir_problem(path)     a client's check of the same before it connects (a directory
                                  of root's is trusted too)
    peer_problem(sock)            SO_PEERCRED: the process at the other end must run as this
                                  user or as root

Why: a socket at a guessable path in a shared directory lets another local user listen there
first (a fake keeper answering a restore with invented GPU fields) or connect to ours. A private
directory keeps others from placing or reaching a socket; the peer check still refuses one that
got there (a directory opened up, a path configured into a shared directory). Each check returns
a one-line reason, or None when the socket can be trusted; the caller raises it in its own words
(a keeper refused is `KeeperUnavailable`: the restorer does the work itself). Nothing here
imports torch.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from snapfn.snapshot.errors import one_line

PRIVATE_MODE = 0o700
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclass(frozen=True)
class PeerCredentials:
    """Who is at the other end of a unix socket, as the kernel recorded it at connect/listen."""

    pid: int
    uid: int
    gid: int


def default_dir(environ: Mapping[str, str]) -> Path:
    """This user's private socket directory: `$XDG_RUNTIME_DIR` (else /tmp) + /snapfn-UID."""
    return Path(environ.get("XDG_RUNTIME_DIR") or "/tmp") / f"snapfn-{os.geteuid()}"


def trusted_uids() -> frozenset[int]:
    """The users whose sockets and peers are trusted: this one, and root."""
    return frozenset({os.geteuid(), 0})


def peer_credentials(sock: socket.socket) -> PeerCredentials:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    return PeerCredentials(*_UCRED.unpack(raw))


def peer_problem(sock: socket.socket) -> str | None:
    """Why the peer of connected unix socket `sock` is not trusted, or None (this user or root)."""
    try:
        peer = peer_credentials(sock)
    except OSError as exc:
        return one_line(f"its peer's credentials cannot be read: {exc}")
    if peer.uid in trusted_uids():
        return None
    return f"its peer (pid {peer.pid}) runs as uid {peer.uid}, {_not_us()}"


def private_dir_problem(
    path: str | os.PathLike[str], owners: frozenset[int] | None = None
) -> str | None:
    """Why directory `path` is not private, or None: it must be a directory (not a symbolic
    link) owned by one of `owners` (default: this user or root), mode 0700 or tighter."""
    owners = trusted_uids() if owners is None else owners
    try:
        st = os.lstat(path)
    except OSError as exc:
        return one_line(f"{path}: {exc.strerror or exc}")
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symbolic link, not a private directory"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if st.st_uid not in owners:
        return f"{path} is owned by uid {st.st_uid}, {_not_us(root=0 in owners)}"
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        return f"{path} is mode {mode:04o}, not 0700: other users could reach or place its sockets"
    return None


def ensure_private_dir(path: str | os.PathLike[str]) -> str | None:
    """Make `path` (mode 0700) unless it exists; then why it is not private to this user, or
    None. An existing directory is never changed: one with the wrong owner or mode is refused."""
    try:
        os.mkdir(path, PRIVATE_MODE)
    except FileExistsError:
        pass
    except OSError as exc:
        return one_line(f"cannot make the socket directory {path}: {exc.strerror or exc}")
    return private_dir_problem(path, owners=frozenset({os.geteuid()}))


def _not_us(root: bool = True) -> str:
    me = f"uid {os.geteuid()}"
    return (
        f"neither this user ({me}) nor root"
        if root and os.geteuid() != 0
        else f"not this user ({me})"
    )
