"""Zygote: a pre-imported fork server, so a worker starts in milliseconds instead of seconds.

A zygote is a Python process that has imported torch and a function's modules (the 4–5 s
`import torch`) but has NOT initialised CUDA. It forks workers on request; each worker then
initialises CUDA itself and restores a snapshot (the tier-0 restore of DESIGN.md).

This is the owner's side. `Zygote.start(preload)` runs `python -m snapfn.snapshot.zygote.server`
and returns once it is ready; `fork(target, args)` gives a `Worker` (pid, `channel`, `wait()`,
`kill()`); `close()` kills or drains the workers and stops it. `run_worker_inline` runs a target
in this process instead, behind the same surface. The protocol is in channel.py.

NOTE: CUDA must not be initialised in the zygote (fork_safety.py): a child forked after its
parent initialised CUDA cannot use CUDA. `start` fails with InitFailed if a preload module did.

The zygote's socket lives in a fresh private directory (mkdtemp: 0700, this user's). Each fork
checks, before it sends anything, that the directory is still private and that the process
listening runs as this user or as root (SO_PEERCRED, snapshot/unix_socket.py); anything else is
an InitFailed with the reason, and the zygote itself refuses peers of other users the same way.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from snapfn.snapshot.errors import BadRequest, InitFailed, RestoreFailed
from snapfn.snapshot.unix_socket import peer_problem, private_dir_problem
from snapfn.snapshot.zygote.channel import (
    MAX_REQUEST_BYTES,
    Channel,
    LocalChannel,
    parse_target,
    run_target,
)

log = logging.getLogger(__name__)

LOG_TAIL_BYTES = 2048


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


# ---------------------------------------------------------------- forked by a zygote


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
        command = [python, "-m", "snapfn.snapshot.zygote.server", "--socket", str(socket_path)]
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
        untrusted = private_dir_problem(self.socket_path.parent)
        if untrusted is not None:
            raise InitFailed(f"zygote {self.pid}'s socket is not trusted: {untrusted}")
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.settimeout(timeout_s)
            conn.connect(str(self.socket_path))
            untrusted = peer_problem(conn)
            if untrusted is not None:
                conn.close()
                raise InitFailed(f"zygote {self.pid}'s socket is not trusted: {untrusted}")
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


def _fileno(stream: int | IO[Any] | None, default: int) -> int:
    if stream is None:
        return default
    return stream if isinstance(stream, int) else stream.fileno()


def _log_tail(log_path: Path) -> str:
    with contextlib.suppress(OSError), open(log_path, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
        return f.read().decode(errors="replace").strip()
    return ""
