"""The restorer's end of the keeper (daemon.py has the protocol): one request per connection,
each failure a `KeeperUnavailable` (nobody answered, or nobody to trust: do the work yourself)
or a `RestoreFailed` with the keeper's reason. A keeper is trusted only when its socket's
directory is private (0700, this user's or root's) and the process listening runs as this user
or as root (SO_PEERCRED, snapshot/unix_socket.py); anything else is refused with the reason
before a byte is sent. Nothing here imports torch."""

from __future__ import annotations

import json
import os
import shutil
import socket
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from snapfn.snapshot.errors import RestoreFailed, one_line
from snapfn.snapshot.keeper.pinned_cache import LOCATIONS, MAX_MESSAGE, FileIdentity, Lease, Miss
from snapfn.snapshot.unix_socket import peer_problem, private_dir_problem

CALL_TIMEOUT_S = 5.0  # the quick requests (device, prefetch's start)
RESTORE_TIMEOUT_S = 60.0  # the CUDA restore of a worker (0.24–0.55 s for an 8B on the H200)


class KeeperUnavailable(RestoreFailed):
    """No keeper answered: the caller does the work itself."""


def answers(address: str) -> bool:
    """Whether something accepts connections on the unix socket `address`."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(1.0)
        try:
            sock.connect(address)
        except OSError:
            return False
    return True


class KeeperNotTrusted(KeeperUnavailable):
    """Something listens where the keeper should, but not as this user or root (or its
    directory is not private): refused, and the caller does the work itself."""


def probe(address: str) -> None:
    """Connect to the keeper at `address` and hang up, asking nothing; KeeperUnavailable
    (KeeperNotTrusted: someone else's socket) when a restore would not use it."""
    _connect(address, 1.0).close()


def _connect(address: str, timeout_s: float) -> socket.socket:
    """A connection to the keeper at `address`, its directory and its peer checked."""
    if not address or not os.path.exists(address):
        raise KeeperUnavailable(f"no keeper at {address or '(none configured)'}")
    untrusted = private_dir_problem(os.path.dirname(os.path.abspath(address)))
    if untrusted is not None:
        raise KeeperNotTrusted(f"keeper at {address} not trusted: {untrusted}")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(timeout_s)
    try:
        sock.connect(address)
    except OSError as exc:
        sock.close()
        raise KeeperUnavailable(one_line(f"keeper at {address}: {exc}")) from None
    untrusted = peer_problem(sock)
    if untrusted is not None:
        sock.close()
        raise KeeperNotTrusted(f"keeper at {address} not trusted: {untrusted}")
    return sock


def _exchange(
    sock: socket.socket,
    address: str,
    message: Mapping[str, Any],
    sent: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Send `message`, return the answer; KeeperUnavailable when the keeper does not answer,
    RestoreFailed with its reason when it refuses. `sent()` runs between the two."""
    try:
        sock.send(json.dumps(message).encode())
        if sent is not None:
            sent()
        reply = json.loads(sock.recv(MAX_MESSAGE) or b"null")
    except (OSError, ValueError) as exc:
        raise KeeperUnavailable(one_line(f"keeper at {address}: {exc}")) from None
    if not isinstance(reply, dict):
        raise KeeperUnavailable(f"keeper at {address} closed without answering")
    if not reply.get("ok"):
        raise RestoreFailed(f"keeper at {address}: {reply.get('reason', 'refused')}")
    return reply


def request(address: str, path: Path | str, timeout_s: float = 2.0) -> Lease | Miss:
    """Ask the keeper at `address` for `path`'s pinned copy (the "file" op, for a helper
    process); never raises: a Miss says why not. The lease is checked against what was asked:
    the same file identity, its size, an allocation that holds it, a known location (the bytes
    themselves are checked by the worker, chunk by chunk, once they are in its regions)."""
    try:
        asked = FileIdentity.of(path)
        with _connect(address, timeout_s) as sock:
            sock.send(json.dumps(asked.to_json()).encode())
            data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 1)
    except KeeperUnavailable as exc:
        return Miss(str(exc))
    except (OSError, ValueError) as exc:
        return Miss(one_line(f"keeper at {address}: {exc}"))
    try:
        reply = json.loads(data)
        if not isinstance(reply, dict):
            raise ValueError("not a JSON object")
        if not reply.get("ok"):
            return Miss(one_line(str(reply.get("reason", "refused"))))
        if len(fds) != 1:
            raise ValueError(f"{len(fds)} fds with the reply")
        lease = Lease(fds[0], int(reply["size"]), int(reply["alloc_bytes"]), str(reply["location"]))
        _check_lease(lease, asked, reply.get("identity"))
        fds.clear()  # the caller's now
        return lease
    except (ValueError, KeyError, TypeError, OSError) as exc:
        return Miss(one_line(f"keeper at {address} answered badly: {exc}"))
    finally:
        for fd in fds:
            os.close(fd)


def _check_lease(lease: Lease, asked: FileIdentity, identity: Any) -> None:
    """ValueError unless `lease` is a copy of the file `asked` for, whole."""
    if identity != asked.to_json():
        raise ValueError(f"a copy of {identity}, not of the file asked for ({asked.to_json()})")
    if lease.size != asked.size:
        raise ValueError(f"a copy of {lease.size} bytes of a file of {asked.size}")
    if lease.alloc_bytes < lease.size:
        raise ValueError(f"an allocation of {lease.alloc_bytes} bytes for {lease.size}")
    if lease.location not in LOCATIONS:
        raise ValueError(f"a copy in {lease.location!r} (one of {', '.join(LOCATIONS)} expected)")
    if lease.location == "memfd" and os.fstat(lease.fd).st_size < lease.size:
        raise ValueError(f"a memfd of {os.fstat(lease.fd).st_size} bytes for {lease.size}")


def call(
    address: str,
    message: Mapping[str, Any],
    timeout_s: float = CALL_TIMEOUT_S,
    sent: Callable[[], None] | None = None,
) -> dict:
    with _connect(address, timeout_s) as sock:
        return _exchange(sock, address, message, sent)


def verified_images(address: str, asked: Mapping[str, Any]) -> set[str]:
    """Which files of `asked` (verified_images.ask) the keeper hashed and holds unchanged;
    never raises: none when no keeper answers, or it answers badly."""
    try:
        found = call(address, {"op": "verified", "files": dict(asked)})["verified"]
    except (RestoreFailed, KeyError):
        return set()
    if not isinstance(found, list):
        return set()
    return {p for p in found if isinstance(p, str) and p in asked}


def device_fields(address: str, index: int) -> dict[str, Any]:
    """The compat key's GPU fields, from the keeper's driver (compat.driver_api_fields)."""
    fields = call(address, {"op": "device", "index": index})["fields"]
    if not isinstance(fields, dict):
        raise KeeperUnavailable(f"keeper at {address} answered device fields badly")
    return fields


def cuda_restore(
    address: str, pid: int, sent: Callable[[], None] | None = None
) -> dict[str, float]:
    """The CUDA restore and unlock of `pid`, done by the keeper: their seconds. `sent()` runs
    once the request is sent, while the keeper works."""
    reply = call(address, {"op": "cuda_restore", "pid": pid}, RESTORE_TIMEOUT_S, sent)
    return {"restore_s": float(reply["restore_s"]), "unlock_s": float(reply["unlock_s"])}


class KeeperPrefetch:
    """A RegionPrefetch run by the keeper for one restore: PrefetchHelper's interface
    (`address`, `close`), the helper process replaced by a request that stays open."""

    def __init__(self, address: str, doc: Mapping[str, Any]) -> None:
        self.address = str(doc["address"])
        self._sock = _connect(address, CALL_TIMEOUT_S)
        try:
            _exchange(self._sock, address, {"op": "prefetch", "doc": dict(doc)})
        except BaseException:
            self._sock.close()
            raise

    def close(self) -> None:
        """End the lease: the keeper cancels the hand-over if the worker has not taken it."""
        self._sock.close()
        shutil.rmtree(os.path.dirname(self.address), ignore_errors=True)
