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
from collections.abc import Mapping
from typing import Any

from snapfn.snapshot.zygote.channel import JsonLines


class PipeChannel(JsonLines):
    """`send(dict)` writes one line to `write_fd`; `recv()` reads one from `read_fd`."""

    def __init__(self, read_fd: int, write_fd: int) -> None:
        super().__init__()
        self.read_fd, self.write_fd = read_fd, write_fd
        self._send_lock = threading.Lock()
        self._closed = False

    def send(self, message: Mapping[str, Any]) -> None:
        data = memoryview(json.dumps(message, separators=(",", ":")).encode() + b"\n")
        with self._send_lock:
            while data:
                data = data[os.write(self.write_fd, data) :]

    def _read(self, timeout_s: float | None) -> bytes:
        if timeout_s is not None and not select.select([self.read_fd], [], [], timeout_s)[0]:
            raise TimeoutError(f"no message on the channel within {timeout_s:.3g} s")
        return os.read(self.read_fd, 1 << 16)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            for fd in (self.read_fd, self.write_fd):
                with contextlib.suppress(OSError):
                    os.close(fd)
