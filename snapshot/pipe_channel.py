"""JSON lines over a pair of pipes: the channel between a process-snapshot worker and its owner.

Pipes, not a socket: criu cannot dump one end of a unix stream connection whose peer is outside
the dumped tree, but it dumps a pipe end and, at restore, `--inherit-fd fd[N]:pipe:[inode]`
joins it to a fresh pipe of the restorer. So one image serves any number of restores, each with
its own channel. `send` may be called from many threads; `recv` from one.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import threading
import time
from collections.abc import Mapping
from typing import Any

from snapfn.snapshot.errors import BadRequest

MAX_LINE_BYTES = 64 << 20


class PipeChannel:
    """`send(dict)` writes one line to `write_fd`; `recv()` reads one from `read_fd`."""

    def __init__(self, read_fd: int, write_fd: int) -> None:
        self.read_fd, self.write_fd = read_fd, write_fd
        self._buffer = bytearray()
        self._send_lock = threading.Lock()
        self._closed = False

    def send(self, message: Mapping[str, Any]) -> None:
        data = memoryview(json.dumps(message, separators=(",", ":")).encode() + b"\n")
        with self._send_lock:
            while data:
                data = data[os.write(self.write_fd, data) :]

    def recv(self, timeout_s: float | None = None) -> dict[str, Any] | None:
        """The next message; None once the writer is gone. TimeoutError after `timeout_s`."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while (end := self._buffer.find(b"\n")) < 0:
            if len(self._buffer) > MAX_LINE_BYTES:
                raise BadRequest(f"channel line over {MAX_LINE_BYTES} bytes")
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([self.read_fd], [], [], left)[0]:
                    raise TimeoutError(f"no message on the channel within {timeout_s} s")
            chunk = os.read(self.read_fd, 1 << 16)
            if not chunk:
                return None
            self._buffer += chunk
        line = bytes(self._buffer[:end])
        del self._buffer[: end + 1]
        return json.loads(line)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            for fd in (self.read_fd, self.write_fd):
                with contextlib.suppress(OSError):
                    os.close(fd)
