"""The zygote's wire protocol, the JSON-lines `Channel` to a worker, and the target contract.

Three parties: the owner (`zygote.Zygote`, which starts the zygote process), the zygote
(server.py), and its forked workers, each talking to the requester that forked it
(`zygote.Worker`). Every message is one UTF-8 JSON object:

  zygote stdout, once   {"ready": true, "pid": int, "preload_s": {module: seconds},
                         "num_native_threads": int} + "\\n". On failure the zygote exits
                         non-zero instead, its reason the last line of its log file.
  zygote stdin          the owner's lifeline: {"op": "close", "kill_workers": bool} + "\\n";
                        EOF without it (the owner died) acts as a close with kill_workers=true.
                        A close stops new forks; the zygote SIGKILLs its workers' process groups
                        (kill_workers) or waits for them to exit (drain), reaps them all, exits.
  request socket        AF_UNIX SOCK_SEQPACKET at <private 0700 temp dir>/zygote.sock, one
                        connection per worker, one JSON object per packet; both ends refuse a
                        peer that runs as neither their user nor root (SO_PEERCRED):
      -> {"op": "fork", "target": "pkg.module:function", "args": {...}, "env": {str: str}}
         with SCM_RIGHTS carrying 4 fds: the worker's stdin, stdout, stderr, control channel
      <- {"ok": true, "pid": int}  or  {"ok": false, "error": str} (then the zygote hangs up)
      -> {"op": "kill", "signal": int}   any number of times; signals the worker's process group
                                         (the zygote is its parent, so the pid cannot be reused)
      <- {"event": "exit", "pid": int, "returncode": int}   negative: killed by that signal;
                                                             then the zygote hangs up
  control channel       the 4th fd, one end of a stream socketpair: JSON lines both ways between
                        the requester's `Worker.channel` and the worker's `target(args, channel)`
                        (a `Channel` at both ends; a line is at most MAX_LINE_BYTES).

A target is "pkg.module:function", called as `function(args, channel)` (`run_target`). Exit code:
0 if it returned, 1 if it raised (traceback on its stderr), n for `sys.exit(n)`. Targets should
live in preloaded modules; any other module is imported in the worker after fork (paying its
import there, and never polluting the zygote). `LocalChannel` is the in-process stand-in that
`zygote.run_worker_inline` hands a target, with the same JSON round trip and no socket.
`recv_fork_request` is the zygote's check of a fork request: the packet, its 4 fds, the target.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import sys
import time
import traceback
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from snapfn.snapshot.errors import BadRequest

NUM_PASSED_FDS = 4  # worker stdin, stdout, stderr, control channel
MAX_REQUEST_BYTES = 64 << 10  # one SEQPACKET packet; pass paths in args, not data
MAX_LINE_BYTES = 64 << 20  # one control-channel JSON line

Target = Callable[[dict[str, Any], Any], object]


# ---------------------------------------------------------------- channels


class JsonLines:
    """The receiving half of a JSON-lines channel: `recv() -> dict | None`, one message a line.

    Subclasses provide `_read(timeout_s) -> bytes` (b"" once the peer has closed; a
    TimeoutError when nothing came within `timeout_s`, None meaning no limit)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def _read(self, timeout_s: float | None) -> bytes:
        raise NotImplementedError

    def recv(self, timeout_s: float | None = None) -> dict[str, Any] | None:
        """The next message; None once the peer has closed. Raises TimeoutError after timeout_s."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while (end := self._buffer.find(b"\n")) < 0:
            if len(self._buffer) > MAX_LINE_BYTES:
                raise BadRequest(f"channel line over {MAX_LINE_BYTES} bytes")
            remaining_s = None if deadline is None else deadline - time.monotonic()
            if remaining_s is not None and remaining_s <= 0:
                raise TimeoutError(f"no channel message within {timeout_s} s")
            chunk = self._read(remaining_s)
            if not chunk:
                return None
            self._buffer += chunk
        line = bytes(self._buffer[:end])
        del self._buffer[: end + 1]
        return json.loads(line)


class Channel(JsonLines):
    """JSON-lines connection over a stream socket: `send(dict)`, `recv() -> dict | None`."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__()
        self._sock = sock

    def fileno(self) -> int:
        return self._sock.fileno()

    def send(self, message: Mapping[str, Any]) -> None:
        self._sock.settimeout(None)
        self._sock.sendall(json.dumps(message).encode() + b"\n")

    def _read(self, timeout_s: float | None) -> bytes:
        self._sock.settimeout(timeout_s)
        return self._sock.recv(1 << 16)

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


# ---------------------------------------------------------------- targets


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


# ---------------------------------------------------------------- requests


def recv_fork_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """The zygote's side: one fork request packet and its 4 fds, checked; ValueError/BadRequest
    (every received fd closed) if it is not a well-formed request."""
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
