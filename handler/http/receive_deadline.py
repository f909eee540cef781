"""The receive deadline: a request's headers and body must arrive within `receive_timeout_s`.

gunicorn bounds the wait for a connection's first byte (its gthread worker parks a connection
that sends nothing for 5 s on its poller, without a thread), but nothing after it: reading the
headers and the body blocks on the socket with no timeout. A client that sends a byte now and
then holds a gthread thread for as long as it likes, and a sync worker (one request at a time,
its heartbeat silent meanwhile) until gunicorn's `timeout` kills the whole worker, whose
runtime must then start again.

`snapfn serve`'s workers (`workers.py`) take their connections through `DeadlineListener`, so
that each is a `DeadlineSocket`, and arm its deadline as they start on a request: its clock
starts at the request's first read in a gthread worker (which reads a connection only once it
is readable: the request's first byte is there), at once in a sync worker (which reads the
connection it accepted at once). They disarm it once the app has answered. A blocking read past the deadline raises
`ReceiveTimeout`: while the headers are still arriving, the worker answers it (`workers.py`: a
JSON 408) and closes the connection; while the app reads the body, the app does (`json_io.py`:
a JSON 408) and the worker closes the connection after it. Only blocking reads are timed, those
of gunicorn's parser and of the app: a long streaming response is never cut, and gunicorn's
drains (an unread body, a connection it closes) keep the timeouts they set. A TLS connection (gunicorn's `certfile`) is read through gunicorn's own wrapper socket, and
an HTTP/2 one (`http2_cleartext`) lives on across requests: neither has a receive deadline.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any, TypeVar

from snapfn.snapshot.errors import SnapfnError

Read = TypeVar("Read")


class ReceiveTimeout(SnapfnError):
    """A request's headers and body did not arrive within the receive deadline (HTTP 408)."""

    code = "request_timeout"

    def __init__(self, timeout_s: float) -> None:
        super().__init__(
            f"the request's headers and body did not arrive within {timeout_s:g} s: send the "
            "whole request without pausing"
        )
        self.timeout_s = timeout_s


class DeadlineSocket(socket.socket):
    """An accepted connection whose blocking reads raise `ReceiveTimeout` once its armed
    deadline has passed. Writes are never timed, nor reads under a timeout of their own (gunicorn
    bounds its drains of an unread body, and of a connection it closes, that way)."""

    deadline: float | None = None  # a time.monotonic() value; None: no deadline
    timeout_s: float = 0.0
    starts_at_first_read = False  # armed, its clock not started yet
    expired = False

    @classmethod
    def adopt(cls, sock: socket.socket) -> DeadlineSocket:
        """The same connection (`sock` is detached from it) as a `DeadlineSocket`."""
        timeout = sock.gettimeout()
        adopted = cls(sock.family, sock.type, sock.proto, fileno=sock.detach())
        adopted.settimeout(timeout)
        return adopted

    def arm(self, timeout_s: float, at_first_read: bool = False) -> None:
        """Give one request `timeout_s` to arrive, from now or from its first read."""
        self.timeout_s, self.starts_at_first_read, self.expired = timeout_s, at_first_read, False
        self.deadline = None if at_first_read else time.monotonic() + timeout_s

    def disarm(self) -> bool:
        """Stop the clock; whether the deadline had passed (then the rest of the request is
        unread: the connection must close)."""
        self.deadline, self.starts_at_first_read = None, False
        return self.expired

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        return self._within_deadline(lambda: super(DeadlineSocket, self).recv(bufsize, flags))

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        return self._within_deadline(
            lambda: super(DeadlineSocket, self).recv_into(buffer, nbytes, flags)
        )

    def _within_deadline(self, read: Callable[[], Read]) -> Read:
        if self.gettimeout() is not None:
            return read()
        if self.starts_at_first_read:
            self.deadline, self.starts_at_first_read = time.monotonic() + self.timeout_s, False
        if self.deadline is None:
            return read()
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise self._expire()
        self.settimeout(remaining)
        try:
            return read()
        except TimeoutError:
            raise self._expire() from None
        finally:
            self.settimeout(None)

    def _expire(self) -> ReceiveTimeout:
        self.expired = True
        return ReceiveTimeout(self.timeout_s)


class DeadlineListener:
    """A gunicorn listener whose accepted connections are `DeadlineSocket`s; everything else
    is the listener's own."""

    def __init__(self, listener: Any) -> None:
        self._listener = listener

    def accept(self) -> tuple[DeadlineSocket, Any]:
        sock, address = self._listener.accept()
        return DeadlineSocket.adopt(sock), address

    def __getattr__(self, name: str) -> Any:
        return getattr(self._listener, name)

    def __str__(self) -> str:
        return str(self._listener)


def arm(sock: Any, timeout_s: float, at_first_read: bool = False) -> None:
    """Arm `sock`'s receive deadline, if it has one (see the module doc for those without)."""
    if isinstance(sock, DeadlineSocket):
        sock.arm(timeout_s, at_first_read)


def disarm(sock: Any) -> bool:
    """Disarm `sock`'s receive deadline; whether it had passed."""
    return sock.disarm() if isinstance(sock, DeadlineSocket) else False
