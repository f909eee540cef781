"""Zygote: a pre-imported fork server, so a worker starts in milliseconds instead of seconds.

A zygote is a Python process that has imported torch and a function's modules (the 4–5 s
`import torch`) but has NOT initialised CUDA. It forks workers on request; each worker then
initialises CUDA itself and restores a snapshot (the tier-0 restore of DESIGN.md).

NOTE: CUDA must not be initialised in the zygote — a child forked after its parent initialised
CUDA cannot use CUDA. The zygote refuses to start if a preload module did, and refuses to fork
while a Python thread other than the main one runs (a lock another thread holds stays held
forever in the child). Native pools that shut themselves down at fork (OpenBLAS) are fine; a
worker calls `torch.set_num_threads` itself, after fork.

Wire protocol (every message is one UTF-8 JSON object):

  zygote stdout, once   {"ready": true, "pid": int, "preload_s": {module: seconds},
                         "num_native_threads": int} + "\\n". On failure the zygote exits
                         non-zero instead, its reason the last line of its log file.
  zygote stdin          the owner's lifeline: {"op": "close", "kill_workers": bool} + "\\n";
                        EOF without it (the owner died) acts as a close with kill_workers=true.
                        A close stops new forks; the zygote SIGKILLs its workers' process groups
                        (kill_workers) or waits for them to exit (drain), reaps them all, exits.
  request socket        AF_UNIX SOCK_SEQPACKET at <private 0700 temp dir>/zygote.sock, one
                        connection per worker, one JSON object per packet:
      -> {"op": "fork", "target": "pkg.module:function", "args": {...}, "env": {str: str}}
         with SCM_RIGHTS carrying 4 fds: the worker's stdin, stdout, stderr, control channel
      <- {"ok": true, "pid": int}  or  {"ok": false, "error": str} (then the zygote hangs up)
      -> {"op": "kill", "signal": int}   any number of times; signals the worker's process group
                                         (the zygote is its parent, so the pid cannot be reused)
      <- {"event": "exit", "pid": int, "returncode": int}   negative: killed by that signal;
                                                             then the zygote hangs up
  control channel       the 4th fd, one end of a stream socketpair: JSON lines both ways between
                        the requester's `Worker.channel` and the worker's `target(args, channel)`.

A worker closes the zygote's sockets, takes the passed fds as 0/1/2, resets signal handlers,
calls `os.setsid()`, reseeds `random` (and numpy's global state when loaded), applies `env`,
then runs the target. Exit code: 0 if it returned, 1 if it raised (traceback on its stderr),
n for `sys.exit(n)`. Targets should live in preloaded modules; any other module is imported in
the worker after fork (paying its import there, and never polluting the zygote).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import importlib
import json
import logging
import os
import random
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from snapfn.snapshot.errors import BadRequest, InitFailed, RestoreFailed

log = logging.getLogger(__name__)

NUM_PASSED_FDS = 4  # worker stdin, stdout, stderr, control channel
MAX_REQUEST_BYTES = 64 << 10  # one SEQPACKET packet; pass paths in args, not data
MAX_LINE_BYTES = 64 << 20  # one control-channel JSON line
LOG_TAIL_BYTES = 2048
REQUEST_RECV_TIMEOUT_S = 5.0  # the zygote never waits longer on a half-sent request
_SERVER_SIGNALS = (signal.SIGCHLD, signal.SIGTERM)

Target = Callable[[dict[str, Any], Any], object]


# ---------------------------------------------------------------- channels and targets


class Channel:
    """JSON-lines connection over a stream socket: `send(dict)`, `recv() -> dict | None`."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buffer = bytearray()

    def fileno(self) -> int:
        return self._sock.fileno()

    def send(self, message: Mapping[str, Any]) -> None:
        self._sock.settimeout(None)
        self._sock.sendall(json.dumps(message).encode() + b"\n")

    def recv(self, timeout_s: float | None = None) -> dict[str, Any] | None:
        """The next message; None once the peer has closed. Raises TimeoutError after timeout_s."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while (end := self._buffer.find(b"\n")) < 0:
            if len(self._buffer) > MAX_LINE_BYTES:
                raise BadRequest(f"control-channel line over {MAX_LINE_BYTES} bytes")
            remaining_s = None if deadline is None else deadline - time.monotonic()
            if remaining_s is not None and remaining_s <= 0:
                raise TimeoutError(f"no control-channel message within {timeout_s} s")
            self._sock.settimeout(remaining_s)
            chunk = self._sock.recv(1 << 16)
            if not chunk:
                return None
            self._buffer += chunk
        line = bytes(self._buffer[:end])
        del self._buffer[: end + 1]
        return json.loads(line)

    def close(self) -> None:
        self._sock.close()


class LocalChannel:
    """In-process channel end for `run_worker_inline`; recv() returns None once the inbox is empty."""

    def __init__(self, inbox: deque[dict[str, Any]], outbox: deque[dict[str, Any]]) -> None:
        self._inbox, self._outbox = inbox, outbox

    @classmethod
    def pair(cls) -> tuple[LocalChannel, LocalChannel]:
        a_to_b: deque[dict[str, Any]] = deque()
        b_to_a: deque[dict[str, Any]] = deque()
        return cls(b_to_a, a_to_b), cls(a_to_b, b_to_a)

    def send(self, message: Mapping[str, Any]) -> None:
        self._outbox.append(json.loads(json.dumps(message)))  # the same round trip as the wire

    def recv(self, timeout_s: float | None = None) -> dict[str, Any] | None:
        return self._inbox.popleft() if self._inbox else None

    def close(self) -> None:
        pass


def parse_target(target: str) -> tuple[str, str]:
    """Split "pkg.module:function"; BadRequest if it is not of that form."""
    module, sep, function = target.partition(":")
    if not (sep and module and function.isidentifier()):
        raise BadRequest(f"target {target!r} is not of the form 'pkg.module:function'")
    return module, function


def resolve_target(target: str) -> Target:
    module, function = parse_target(target)
    return getattr(importlib.import_module(module), function)


def run_target(target: str, args: dict[str, Any], channel: Any) -> int:
    """Call target(args, channel) as a worker does; return its exit code (traceback on stderr)."""
    try:
        resolve_target(target)(args, channel)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


@dataclass
class InlineWorker:
    """The result of `run_worker_inline`: the Worker surface, for a call that already ran."""

    pid: int
    channel: LocalChannel
    returncode: int

    def wait(self, timeout_s: float | None = None) -> int:
        return self.returncode

    def kill(self, sig: int = signal.SIGKILL) -> None:
        pass


def run_worker_inline(
    target: str, args: Mapping[str, Any], *, messages: Iterable[Mapping[str, Any]] = ()
) -> InlineWorker:
    """Run target(args, channel) in this process, no zygote: `messages` wait in its inbox, and
    what it sent is read back from the returned worker's channel, as from a forked worker's."""
    ours, theirs = LocalChannel.pair()
    for message in messages:
        ours.send(message)
    returncode = run_target(target, json.loads(json.dumps(dict(args))), theirs)
    return InlineWorker(pid=os.getpid(), channel=ours, returncode=returncode)


# ---------------------------------------------------------------- the requester's side


def _fileno(stream: int | IO[Any] | None, default: int) -> int:
    if stream is None:
        return default
    return stream if isinstance(stream, int) else stream.fileno()


def _log_tail(log_path: Path) -> str:
    with contextlib.suppress(OSError), open(log_path, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
        return f.read().decode(errors="replace").strip()
    return ""


class Worker:
    """A forked worker: `pid`, `channel` (JSON lines to its target), `wait()`, `kill()`."""

    def __init__(self, pid: int, channel: Channel, request: socket.socket, log_path: Path) -> None:
        self.pid = pid
        self.channel = channel
        self.returncode: int | None = None
        self._request = request
        self._log_path = log_path

    def wait(self, timeout_s: float | None = None) -> int:
        """The exit code (negative: killed by that signal); TimeoutError if still running."""
        if self.returncode is None:
            self._request.settimeout(timeout_s)
            try:
                packet = self._request.recv(MAX_REQUEST_BYTES)
            except TimeoutError:
                raise TimeoutError(f"worker {self.pid} still running after {timeout_s} s") from None
            if not packet:
                raise RestoreFailed(
                    f"zygote hung up before reporting worker {self.pid}'s exit;"
                    f" its log ends: {_log_tail(self._log_path)}"
                )
            self.returncode = int(json.loads(packet)["returncode"])
            self._request.close()
        return self.returncode

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the worker's process group through the zygote; a no-op once it has exited."""
        if self.returncode is None:
            with contextlib.suppress(OSError):
                self._request.send(json.dumps({"op": "kill", "signal": int(sig)}).encode())

    def close(self) -> None:
        """Close this end of the channel and the request connection; the worker runs on."""
        self.channel.close()
        self._request.close()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@dataclass
class Zygote:
    """A running zygote process; build it with `Zygote.start`, stop it with `close()`."""

    process: subprocess.Popen[bytes]
    socket_path: Path
    log_path: Path
    preload_seconds_by_module: dict[str, float]
    num_native_threads: int
    _private_dir: Path = field(repr=False)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def preload_seconds(self) -> float:
        """Seconds the zygote spent importing its preload modules, measured inside it."""
        return sum(self.preload_seconds_by_module.values())

    @classmethod
    def start(
        cls,
        preload: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        python: str = sys.executable,
        start_timeout_s: float = 120.0,
        socket_dir: str | os.PathLike[str] | None = None,
    ) -> Zygote:
        """Launch a zygote importing `preload`; return once it is ready to fork.

        Its socket and log live in a fresh 0700 temp dir under `socket_dir` (default: the
        system temp dir). InitFailed, with the zygote's log tail, if it fails or times out."""
        private_dir = Path(tempfile.mkdtemp(prefix="snapfn-zygote-", dir=socket_dir))
        socket_path, log_path = private_dir / "zygote.sock", private_dir / "zygote.log"
        command = [python, "-m", "snapfn.snapshot.zygote", "--socket", str(socket_path)]
        command += ["--preload", ",".join(preload)]
        with open(log_path, "wb") as log_file:
            process = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log_file,
                env=None if env is None else dict(env),
                start_new_session=True,
            )
        try:
            ready = _wait_ready(process, start_timeout_s)
        except InitFailed as exc:
            _kill_session(process)
            tail = _log_tail(log_path)
            shutil.rmtree(private_dir, ignore_errors=True)
            raise InitFailed(f"{exc}; its log ends:\n{tail}") from None
        preload_s = {str(k): float(v) for k, v in ready["preload_s"].items()}
        threads = int(ready["num_native_threads"])
        return cls(process, socket_path, log_path, preload_s, threads, private_dir)

    def fork(
        self,
        target: str,
        args: Mapping[str, Any] | None = None,
        *,
        env: Mapping[str, str] | None = None,
        stdin: int | IO[Any] | None = None,
        stdout: int | IO[Any] | None = None,
        stderr: int | IO[Any] | None = None,
        timeout_s: float = 10.0,
    ) -> Worker:
        """Fork a worker running target(args, channel); stdio default to this process's 0/1/2.

        BadRequest for a malformed target or oversized args; InitFailed if the zygote refuses."""
        parse_target(target)
        request = {"op": "fork", "target": target, "args": dict(args or {}), "env": dict(env or {})}
        try:
            packet = json.dumps(request).encode()
        except TypeError as exc:
            raise BadRequest(f"worker args must be JSON: {exc}") from None
        if len(packet) > MAX_REQUEST_BYTES:
            raise BadRequest(f"fork request is {len(packet)} bytes, over {MAX_REQUEST_BYTES}")
        fds = [_fileno(stdin, 0), _fileno(stdout, 1), _fileno(stderr, 2)]
        ours, theirs = socket.socketpair()
        try:
            conn, pid = self._send_fork(packet, [*fds, theirs.fileno()], timeout_s)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return Worker(pid, Channel(ours), conn, self.log_path)

    def _send_fork(
        self, packet: bytes, fds: list[int], timeout_s: float
    ) -> tuple[socket.socket, int]:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.settimeout(timeout_s)
            conn.connect(str(self.socket_path))
            socket.send_fds(conn, [packet], fds)
            reply = json.loads(conn.recv(MAX_REQUEST_BYTES) or b"{}")
        except (OSError, ValueError) as exc:
            conn.close()
            raise InitFailed(f"fork through zygote {self.pid} failed: {exc}") from None
        if not reply.get("ok"):
            conn.close()
            reason = reply.get("error", "it hung up")
            raise InitFailed(f"zygote {self.pid} refused to fork: {reason}")
        return conn, int(reply["pid"])

    def close(self, *, kill_workers: bool = True, timeout_s: float = 10.0) -> None:
        """Stop the zygote: SIGKILL its workers (or, with kill_workers=False, wait for them to exit
        on their own), then wait for it to reap them and exit. Past timeout_s the zygote is
        killed; a worker still running then runs on, re-parented to init."""
        if self.process.poll() is None:
            with contextlib.suppress(OSError):
                op = {"op": "close", "kill_workers": kill_workers}
                self.process.stdin.write(json.dumps(op).encode() + b"\n")
                self.process.stdin.close()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("zygote %d did not close within %s s; killing it", self.pid, timeout_s)
                _kill_session(self.process)
        with contextlib.suppress(OSError):
            self.process.stdin.close()
        shutil.rmtree(self._private_dir, ignore_errors=True)

    def __enter__(self) -> Zygote:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _wait_ready(process: subprocess.Popen[bytes], timeout_s: float) -> dict[str, Any]:
    stdout = process.stdout
    assert stdout is not None
    selector = selectors.DefaultSelector()
    selector.register(stdout, selectors.EVENT_READ)
    try:
        if not selector.select(timeout_s):
            raise InitFailed(f"zygote {process.pid} not ready within {timeout_s} s")
        line = stdout.readline()
    finally:
        selector.close()
        stdout.close()
    if not line:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(1.0)
        raise InitFailed(f"zygote {process.pid} failed to start (exit status {process.poll()})")
    try:
        ready = json.loads(line)
    except ValueError:
        raise InitFailed(f"zygote {process.pid} sent a bad ready line: {line[:200]!r}") from None
    if not ready.get("ready"):
        raise InitFailed(f"zygote {process.pid} sent a bad ready line: {line[:200]!r}")
    return ready


def _kill_session(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    with contextlib.suppress(OSError):
        process.stdin.close()


# ---------------------------------------------------------------- the zygote's side


def fork_safety_problem() -> str | None:
    """Why forking this process now would give broken workers, or None if it is safe."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return (
            "CUDA is initialised in the zygote (a preload module touched it); a forked worker"
            " could not use CUDA. Move CUDA work into the worker's target."
        )
    if threading.active_count() > 1:
        names = ", ".join(t.name for t in threading.enumerate() if t is not threading.main_thread())
        return f"Python threads are running in the zygote ({names}); their locks would stay held"
    return None


def preload_modules(modules: Sequence[str]) -> dict[str, float]:
    """Import each module in order; seconds per module."""
    seconds: dict[str, float] = {}
    for name in modules:
        start = time.perf_counter()
        importlib.import_module(name)
        seconds[name] = time.perf_counter() - start
    return seconds


def _count_native_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


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


def _recv_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    packet, fds, flags, _ = socket.recv_fds(conn, MAX_REQUEST_BYTES, NUM_PASSED_FDS)
    try:
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or len(fds) != NUM_PASSED_FDS:
            raise ValueError(f"want one packet of <= {MAX_REQUEST_BYTES} bytes and 4 fds")
        request = json.loads(packet)
        if request.get("op") != "fork" or not isinstance(request.get("args"), dict):
            raise ValueError("want {'op': 'fork', 'target': ..., 'args': {...}}")
        parse_target(request.get("target", ""))
        return request, fds
    except (ValueError, BadRequest):
        for fd in fds:
            os.close(fd)
        raise


def _adopt_stdio(fds: Sequence[int]) -> None:
    for target_fd, fd in enumerate(fds):
        os.dup2(fd, target_fd)
    for fd in set(fds):
        os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=stream.isatty())


def _reset_signals() -> None:
    signal.set_wakeup_fd(-1)
    for sig in _SERVER_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, ())


def _reseed() -> None:
    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _signal_worker(pid: int, sig: int) -> None:
    """Signal the worker's process group (itself and its children); before the worker's setsid
    there is no such group yet, so signal the worker alone."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


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
        conn.settimeout(REQUEST_RECV_TIMEOUT_S)
        try:
            request, fds = _recv_request(conn)
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
        _reset_signals()
        for worker_conn in self.workers.values():
            if worker_conn is not None:
                worker_conn.close()
        self.selector.close()
        self.listener.close()
        conn.close()
        os.close(self.wakeup_r)
        os.close(self.wakeup_w)
        _adopt_stdio(fds[:3])
        os.setsid()
        _reseed()
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
    gc.collect()
    gc.freeze()  # keep the preloaded heap out of the collector: fewer copy-on-write pages
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(socket_path))
    listener.listen(64)
    ready = {"ready": True, "pid": os.getpid(), "preload_s": preload_s}
    ready["num_native_threads"] = _count_native_threads()
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
    # Run the importable module's main, so workers see one `snapfn.snapshot.zygote`, not two.
    from snapfn.snapshot.zygote import main as _main

    sys.exit(_main())
