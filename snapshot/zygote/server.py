"""The zygote process: preload, check fork safety, announce ready, then serve fork requests.

    python -m snapfn.snapshot.zygote.server --socket PATH --preload mod_a,mod_b

Started by `zygote.Zygote.start`, never imported by the owner. It imports the preload modules
(with its stdout pointed at its log, so only the ready line reaches the owner), refuses to serve
if that left it unsafe to fork (fork_safety.py), freezes the preloaded heap out of the garbage
collector (fewer copy-on-write pages), then runs one single-threaded select loop over the request
socket, the owner's lifeline on stdin and a signal wakeup pipe (SIGCHLD to reap, SIGTERM to close
killing workers). The protocol is in channel.py. A connection whose peer runs as neither this
user nor root (SO_PEERCRED) is answered {"ok": false, "error": "not trusted: …"} and closed
before anything is read from it. Exit status: 0 after a close, 2 when a preload failed, 3 when
preloading left it unsafe to fork, 4 when its socket's directory is not private to this user
(snapshot/unix_socket.py); its workers are killed and reaped on any exit.

A worker closes the zygote's sockets, takes the passed fds as 0/1/2, resets signal handlers,
calls `os.setsid()`, reseeds `random` (and numpy's global state when loaded), applies `env`,
then runs the target (`channel.run_target`) and exits with its exit code.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import selectors
import signal
import socket
import sys
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from snapfn.snapshot.errors import BadRequest, InitFailed
from snapfn.snapshot.unix_socket import ensure_private_dir, peer_problem
from snapfn.snapshot.zygote.channel import MAX_REQUEST_BYTES, Channel, recv_fork_request, run_target
from snapfn.snapshot.zygote.fork_safety import (
    adopt_stdio,
    count_native_threads,
    fork_safety_problem,
    preload_modules,
    reseed,
    reset_signals,
)

REQUEST_RECV_TIMEOUT_S = 5.0  # the zygote never waits longer on a half-sent request
_SERVER_SIGNALS = (signal.SIGCHLD, signal.SIGTERM)


# ---------------------------------------------------------------- messages


def _send_json(conn: socket.socket, message: Mapping[str, Any]) -> None:
    with contextlib.suppress(OSError):  # the requester may be gone; nothing else to tell
        conn.send(json.dumps(message).encode())


def _parse_message(data: bytes) -> dict[str, Any]:
    """A JSON object from a requester or the owner; {} (and a log line) for anything else."""
    try:
        message = json.loads(data)
    except ValueError:
        message = None
    if not isinstance(message, dict):
        print(f"zygote: ignoring a malformed message: {data[:200]!r}", file=sys.stderr)
        return {}
    return message


def _signal_worker(pid: int, sig: int) -> None:
    """Signal the worker's process group (itself and its children); before the worker's setsid
    there is no such group yet, so signal the worker alone."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


# ---------------------------------------------------------------- the loop


class _Server:
    """The zygote's single-threaded loop: accept fork requests, reap, report, close."""

    def __init__(self, listener: socket.socket, socket_path: Path) -> None:
        self.listener = listener
        self.socket_path = socket_path
        self.workers: dict[int, socket.socket | None] = {}  # pid -> its request connection
        self.close_request: bool | None = None  # kill_workers, once a close was asked
        self.closing = False
        self.lifeline = bytearray()
        self.selector = selectors.DefaultSelector()
        self.wakeup_r, self.wakeup_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def run(self) -> None:
        signal.set_wakeup_fd(self.wakeup_w, warn_on_full_buffer=False)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake the select
        signal.signal(signal.SIGTERM, self._on_sigterm)
        self.selector.register(self.listener, selectors.EVENT_READ, self._accept)
        self.selector.register(0, selectors.EVENT_READ, self._read_lifeline)
        self.selector.register(self.wakeup_r, selectors.EVENT_READ, self._drain_wakeup)
        while not (self.closing and not self.workers):
            for key, _ in self.selector.select():
                key.data(key.fileobj)
            if self.close_request is not None and not self.closing:
                self._begin_close(kill_workers=self.close_request)
            self._reap()

    def _on_sigterm(self, *_: object) -> None:
        self.close_request = True

    def _drain_wakeup(self, fd: int) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(fd, 4096)

    def _read_lifeline(self, fd: int) -> None:
        data = os.read(fd, 4096)
        self.lifeline += data
        while (end := self.lifeline.find(b"\n")) >= 0:
            message = _parse_message(bytes(self.lifeline[:end]))
            del self.lifeline[: end + 1]
            if message.get("op") == "close" and self.close_request is None:
                self.close_request = bool(message.get("kill_workers", True))
        if not data:
            self.selector.unregister(fd)
            if self.close_request is None:
                print("zygote: owner hung up without a close; killing workers", file=sys.stderr)
                self.close_request = True

    def _begin_close(self, kill_workers: bool) -> None:
        self.closing = True
        self.selector.unregister(self.listener)
        self.listener.close()
        self.socket_path.unlink(missing_ok=True)
        if kill_workers:
            for pid in self.workers:
                _signal_worker(pid, signal.SIGKILL)

    def _accept(self, listener: socket.socket) -> None:
        conn, _ = listener.accept()
        untrusted = peer_problem(conn)
        if untrusted is not None:
            print(f"zygote: refused a connection: {untrusted}", file=sys.stderr)
            _send_json(conn, {"ok": False, "error": f"not trusted: {untrusted}"})
            conn.close()
            return
        conn.settimeout(REQUEST_RECV_TIMEOUT_S)
        try:
            request, fds = recv_fork_request(conn)
        except (OSError, ValueError, BadRequest) as exc:
            _send_json(conn, {"ok": False, "error": f"bad fork request: {exc}"})
            conn.close()
            return
        try:
            pid = self._fork(conn, request, fds)
        except (OSError, InitFailed) as exc:
            _send_json(conn, {"ok": False, "error": str(exc)})
            conn.close()
            return
        finally:
            for fd in fds:
                os.close(fd)
        self.workers[pid] = conn
        self.selector.register(conn, selectors.EVENT_READ, functools.partial(self._on_request, pid))
        _send_json(conn, {"ok": True, "pid": pid})

    def _fork(self, conn: socket.socket, request: dict[str, Any], fds: list[int]) -> int:
        problem = fork_safety_problem()
        if problem is not None:
            raise InitFailed(problem)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the worker; it never returns into the zygote's loop
            code = 1
            try:
                channel = self._become_worker(conn, request, fds)
                code = run_target(request["target"], request["args"], channel)
            except BaseException:
                traceback.print_exc()
            finally:
                with contextlib.suppress(BaseException):
                    sys.stdout.flush()
                    sys.stderr.flush()
                os._exit(code)
        return pid

    def _become_worker(
        self, conn: socket.socket, request: dict[str, Any], fds: list[int]
    ) -> Channel:
        """In the child: drop the zygote's fds and signals, take the requester's; a fresh session."""
        reset_signals(_SERVER_SIGNALS)
        for worker_conn in self.workers.values():
            if worker_conn is not None:
                worker_conn.close()
        self.selector.close()
        self.listener.close()
        conn.close()
        os.close(self.wakeup_r)
        os.close(self.wakeup_w)
        adopt_stdio(fds[:3])
        os.setsid()
        reseed()
        os.environ.update({str(k): str(v) for k, v in request.get("env", {}).items()})
        return Channel(socket.socket(fileno=fds[3]))

    def _on_request(self, pid: int, conn: socket.socket) -> None:
        try:
            packet = conn.recv(MAX_REQUEST_BYTES)
        except OSError:
            packet = b""
        if not packet:  # the requester hung up; its worker runs on, unreported
            self.selector.unregister(conn)
            conn.close()
            self.workers[pid] = None
            return
        message = _parse_message(packet)
        if message.get("op") == "kill":
            _signal_worker(pid, int(message.get("signal", signal.SIGKILL)))

    def kill_and_reap(self) -> None:
        """Blocking: SIGKILL every live worker and reap it (when the loop ends abnormally)."""
        for pid in self.workers:
            _signal_worker(pid, signal.SIGKILL)
        while self.workers:
            pid = next(iter(self.workers))
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
            self.workers.pop(pid)

    def _reap(self) -> None:
        while self.workers:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.workers.pop(pid, None)
            if conn is not None:
                returncode = os.waitstatus_to_exitcode(status)
                _send_json(conn, {"event": "exit", "pid": pid, "returncode": returncode})
                self.selector.unregister(conn)
                conn.close()


def serve(socket_path: Path, preload: Sequence[str]) -> int:
    """The zygote's main: preload, check fork safety, announce ready on stdout, serve."""
    ready_fd = os.dup(1)
    os.dup2(2, 1)  # NOTE: whatever a preload module prints goes to the log, not the ready line
    try:
        preload_s = preload_modules(preload)
    except Exception as exc:
        traceback.print_exc()
        print(f"zygote: preload failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    problem = fork_safety_problem()
    if problem is not None:
        print(f"zygote: refusing to serve: {problem}", file=sys.stderr)
        return 3
    untrusted = ensure_private_dir(socket_path.parent)
    if untrusted is not None:
        print(f"zygote: refusing to serve: {untrusted}", file=sys.stderr)
        return 4
    gc.collect()
    gc.freeze()  # keep the preloaded heap out of the collector: fewer copy-on-write pages
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(socket_path))
    os.chmod(socket_path, 0o600)
    listener.listen(64)
    ready = {"ready": True, "pid": os.getpid(), "preload_s": preload_s}
    ready["num_native_threads"] = count_native_threads()
    os.write(ready_fd, json.dumps(ready).encode() + b"\n")
    os.close(ready_fd)
    server = _Server(listener, socket_path)
    try:
        server.run()
    finally:
        server.kill_and_reap()  # no orphans, even if the loop failed; a no-op after a close
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="snapfn zygote: a pre-imported fork server")
    parser.add_argument("--socket", required=True, type=Path, help="Unix socket path to serve")
    parser.add_argument("--preload", default="", help="comma-separated modules to import")
    ns = parser.parse_args(argv)
    return serve(ns.socket, [name for name in ns.preload.split(",") if name])


if __name__ == "__main__":
    # Run the importable module's main, so workers see one `snapfn.snapshot.zygote.server`,
    # not a second copy of it as `__main__`.
    from snapfn.snapshot.zygote.server import main as _main

    sys.exit(_main())
