"""The per-machine keeper: a long-lived process that does for each tier-1 restore on this machine
what the restore would otherwise start from cold.

    snapfn keeper [--snapshot DIR]      serve; with DIR also keep its weight files pinned
    snapfn pin --snapshot DIR           the same, DIR required

Why: a CUDA tier-1 restore needs the driver initialised twice before its worker can run — in
the restorer, for the CUDA checkpoint calls and the compat key, and in the prefetch helper it
spawns, for the worker's regions — and each `cuInit` + context took 0.14–0.36 s of the
critical path on the H200 (commit cb83675: the "gate" and the helper's `context_s`). The keeper
has done both once, when it started: a restore that finds it asks it for the compat key's GPU
fields, for the regions (made and filled here, in its context, straight from the pinned copies
when it holds them) and for the CUDA restore and unlock of the restored worker's pid. A restore
that does not find it, or whose request fails, does that work itself as before.

Protocol (SOCK_SEQPACKET, one JSON request per connection, "op" names it). The keeper serves
its own user's restores only: its socket (0600) is in a private directory (0700, its user's;
made when missing, refused when another user owns it or it is open to others), and every
connection whose peer runs as neither its user nor root (SO_PEERCRED) is answered
{"ok": false, "reason": "not trusted: …"} and closed unread (snapshot/unix_socket.py):

    file          {dev, ino, size, mtime_ns}   → a pinned copy's fd (`request`)
    device        {index}                      → {"fields"}: the compat key's GPU fields
    cuda_restore  {pid}                        → {"restore_s", "unlock_s"}
    verified      {files: {path: {stamp, entry}}} → {"verified": [path, …]}: the process
                                                 image files it hashed and holds unchanged
                                                 (verified_images.py), which a restore need
                                                 not hash again
    prefetch      {doc}                        → {"ok"} once a RegionPrefetch of `doc` (the
                                                 helper's argument, region_fill.main) listens at
                                                 doc["address"]; the connection stays open as the
                                                 lease: closing it cancels a hand-over that has
                                                 not happened (its GPU memory is let go)

Every answer is {"ok": true, …} or {"ok": false, "reason"}; each connection has a thread of its
own, so a restore's long requests never hold up another's. Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from snapfn.snapshot.errors import RestoreFailed, one_line
from snapfn.snapshot.keeper.client import CALL_TIMEOUT_S, answers
from snapfn.snapshot.keeper.pinned_cache import (
    MAX_MESSAGE,
    FileIdentity,
    PinnedCache,
    default_socket,
    files_to_pin,
)
from snapfn.snapshot.keeper.verified_images import VerifiedImages
from snapfn.snapshot.portable.format import load_json
from snapfn.snapshot.unix_socket import ensure_private_dir, peer_problem

if TYPE_CHECKING:
    from snapfn.snapshot.keeper.region_fill import RegionPrefetch

log = logging.getLogger(__name__)


class Keeper:
    """The keeper's side: answers ops on a unix socket (`serve`) until stopped."""

    def __init__(
        self,
        cache: PinnedCache,
        cuda: bool = True,
        device: int = 0,
        images: VerifiedImages | None = None,
    ) -> None:
        self.cache, self.cuda, self.device = cache, cuda, device
        self.images = images
        self._ops: dict[str, Callable[[socket.socket, dict[str, Any]], dict[str, Any] | None]]
        self._ops = {
            "file": self._file,
            "device": self._device_fields,
            "cuda_restore": self._cuda_restore,
            "prefetch": self._prefetch,
            "verified": self._verified,
        }

    def warm(self) -> None:
        """The driver initialised and the device's primary context made, now, not in a restore."""
        if self.cuda:
            from snapfn.snapshot.cuda.driver import driver, use_primary_context

            use_primary_context(driver(), self.device)  # held for the keeper's life

    def serve(self, address: str, stop: threading.Event | None = None) -> None:
        """Answer requests on `address` until `stop` is set (or forever). RestoreFailed when its
        directory is not private to this user, or a keeper already answers there (a stale
        socket file is replaced)."""
        untrusted = ensure_private_dir(os.path.dirname(os.path.abspath(address)))
        if untrusted is not None:
            raise RestoreFailed(f"the keeper does not serve on {address}: {untrusted}")
        if answers(address):
            raise RestoreFailed(f"another keeper already serves on {address}")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(address)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(address)
        os.chmod(address, 0o600)
        listener.listen(16)
        listener.settimeout(0.2)
        try:
            while stop is None or not stop.is_set():
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    continue
                threading.Thread(target=self._answer, args=(conn,), daemon=True).start()
        finally:
            listener.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(address)

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            untrusted = peer_problem(conn)
            if untrusted is not None:
                log.warning("snapfn keeper: refused a connection: %s", untrusted)
                _send(conn, {"ok": False, "reason": f"not trusted: {untrusted}"})
                _discard_request(conn)
                return
            conn.settimeout(CALL_TIMEOUT_S)
            try:
                request = load_json(conn.recv(MAX_MESSAGE))  # nesting bounded: no RecursionError
                if not isinstance(request, dict):
                    raise ValueError("not a JSON object")
                op = request.pop("op", "file")
                if not isinstance(op, str) or op not in self._ops:
                    raise ValueError(f"unknown op {op!r:.64} (one of {', '.join(self._ops)})")
            except (OSError, ValueError) as exc:
                _send(conn, {"ok": False, "reason": f"bad request: {exc}"})
                return
            try:
                reply = self._ops[op](conn, request)
            except Exception as exc:  # noqa: BLE001 - the client is told; the keeper serves on
                reply = {"ok": False, "reason": one_line(f"{type(exc).__name__}: {exc}")}
            if reply is not None:
                _send(conn, reply)

    def _file(self, conn: socket.socket, request: dict[str, Any]) -> None:
        try:
            asked = FileIdentity(**request)
        except TypeError as exc:
            _send(conn, {"ok": False, "reason": f"bad request: {exc}"})
            return
        found = self.cache.lease(asked)
        if isinstance(found, str):
            _send(conn, {"ok": False, "reason": found})
            return
        fd, reply = found
        with contextlib.suppress(OSError):
            socket.send_fds(conn, [json.dumps({"ok": True, **reply}).encode()], [fd])

    def _device_fields(self, conn: socket.socket, request: dict[str, Any]) -> dict[str, Any]:
        from snapfn.snapshot.portable.compat import driver_api_fields

        self._need_cuda()
        return {"ok": True, "fields": driver_api_fields(int(request.get("index", self.device)))}

    def _cuda_restore(self, conn: socket.socket, request: dict[str, Any]) -> dict[str, Any]:
        from snapfn.snapshot.cuda import checkpoint as cuda_checkpoint

        self._need_cuda()
        pid = int(request["pid"])
        restore_s = cuda_checkpoint.restore(pid)
        return {"ok": True, "restore_s": restore_s, "unlock_s": cuda_checkpoint.unlock(pid)}

    def _verified(self, conn: socket.socket, request: dict[str, Any]) -> dict[str, Any]:
        files = request.get("files")
        if not isinstance(files, dict):
            raise ValueError("files is not an object of paths")
        return {"ok": True, "verified": self.images.verified(files) if self.images else []}

    def _prefetch(self, conn: socket.socket, request: dict[str, Any]) -> None:
        self._need_cuda()
        prefetch = self._make_prefetch(request["doc"])
        running = threading.Thread(target=prefetch.run, daemon=True)
        running.start()
        _send(conn, {"ok": True})
        conn.settimeout(None)
        with contextlib.suppress(OSError):
            conn.recv(16)  # returns when the restorer closes its lease (or goes away)
        prefetch.cancel()  # NOTE: a no-op once the worker has taken the regions
        running.join()

    def _make_prefetch(self, doc: dict[str, Any]) -> RegionPrefetch:
        from snapfn.snapshot.keeper.region_fill import prefetch_from_doc

        return prefetch_from_doc(doc, local=self.cache)

    def _need_cuda(self) -> None:
        if not self.cuda:
            raise RestoreFailed("this keeper has no GPU (backend memfd)")


def _send(conn: socket.socket, reply: Mapping[str, Any]) -> None:
    with contextlib.suppress(OSError):
        conn.send(json.dumps(reply).encode())


def _discard_request(conn: socket.socket, timeout_s: float = 0.5) -> None:
    """Take the request a refused peer sent, unread, so that closing does not reset the
    connection before it reads the refusal (unix sockets reset a peer whose data is unread)."""
    conn.settimeout(timeout_s)
    with contextlib.suppress(OSError):
        conn.recv(MAX_MESSAGE)


# ---- snapfn keeper / snapfn pin ------------------------------------------------------------------
def add_keeper_arguments(parser) -> None:
    _add_arguments(parser, snapshot_required=False, hold="page-cache")


def add_pin_arguments(parser) -> None:
    _add_arguments(parser, snapshot_required=True, hold="copy")


def _add_arguments(parser, snapshot_required: bool, hold: str) -> None:
    import argparse

    parser.add_argument(
        "--snapshot",
        type=Path,
        required=snapshot_required,
        default=None,
        help="a process snapshot (tier 1) whose weight files to keep pinned in host memory, and"
        " whose image files to hash once and hold unchanged (restores then need not hash them)"
        + ("" if snapshot_required else " (default: none; the keeper still serves restores)"),
    )
    parser.add_argument(
        "--socket",
        default=None,
        help="where to serve, in a directory private to this user (made 0700 when missing;"
        " default: $SNAPFN_PINNED_SOCKET, else $XDG_RUNTIME_DIR or /tmp, /snapfn-UID/keeper.sock);"
        " restores look there too",
    )
    parser.add_argument(
        "--device",
        type=int,
        default=0,
        help="the CUDA device (its host NUMA node holds the copies)",
    )
    parser.add_argument(
        "--hold",
        choices=("copy", "page-cache"),
        default=hold,
        help="page-cache: the files' page-cache pages pinned in place (no second copy in RAM;"
        " the keeper's own restores only); copy: the weights copied into pinned CUDA host"
        " memory (RAM for a second copy; prefetch helpers can use it too). Both copy to the"
        f" GPU at the PCIe rate (default: {hold})",
    )
    parser.add_argument(
        "--backend",
        choices=("cuda", "memfd"),
        default="cuda",
        help=argparse.SUPPRESS,  # memfd: the protocol without a GPU
    )


def run(args) -> int:
    """Warm the driver, pin the snapshot's weight files and hold its image files (if given),
    then serve until SIGTERM or Ctrl-C."""
    import signal
    import sys
    import time

    address = args.socket or os.environ.get("SNAPFN_PINNED_SOCKET") or default_socket(os.environ)
    files = files_to_pin(Path(args.snapshot)) if args.snapshot is not None else []
    cuda = args.backend == "cuda"
    if cuda:
        _check_gpu_here()
    backend = {"copy": "cuda", "page-cache": "page-cache"}[args.hold] if cuda else args.backend
    cache = PinnedCache(backend, args.device)
    images = VerifiedImages.install()
    keeper = Keeper(cache, cuda=cuda, device=args.device, images=images)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    start = time.perf_counter()
    try:
        keeper.warm()
        for path in files:
            cache.add(path)
            gb = path.stat().st_size / 1e9
            print(f"snapfn keeper: {path} pinned ({gb:.2f} GB)", file=sys.stderr)
        if args.snapshot is not None:
            _hold_images(images, Path(args.snapshot))
        seconds = time.perf_counter() - start
        print(
            f"snapfn keeper: {len(files)} files, {cache.pinned_bytes / 1e9:.2f} GB pinned in"
            f" {seconds:.2f} s; serving on {address} until stopped",
            file=sys.stderr,
            flush=True,
        )
        keeper.serve(address, stop)
    finally:
        cache.close()
    return 0


def _check_gpu_here() -> None:
    """BadRequest when this machine has no NVIDIA GPU to keep warm (no NVIDIA driver loaded,
    as `snapfn doctor` finds it), before anything CUDA is imported."""
    from snapfn.snapshot.errors import BadRequest
    from snapfn.snapshot.process.doctor import nvidia_driver_version

    if nvidia_driver_version() is None:
        raise BadRequest(
            "no NVIDIA GPU here (no NVIDIA driver loaded, as `snapfn doctor` says): the keeper"
            " keeps a GPU's driver warm for tier-1 restores; without a GPU none is needed"
        )


def _hold_images(images: VerifiedImages, snapshot_dir: Path) -> None:
    """Hash and hold the snapshot's process image files, saying so, or why not (restores then
    hash them themselves)."""
    import sys
    import time

    from snapfn.snapshot.errors import SnapfnError

    start = time.perf_counter()
    try:
        count, size = images.hold(snapshot_dir)
    except (SnapfnError, OSError) as exc:
        print(f"snapfn keeper: process images not held, restores hash them: {exc}", file=sys.stderr)
        return
    seconds = time.perf_counter() - start
    print(
        f"snapfn keeper: {count} process image files ({size / 1e9:.2f} GB) hashed and held"
        f" unchanged in {seconds:.2f} s",
        file=sys.stderr,
    )
