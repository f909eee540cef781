"""How the activator reads requests off its connections: aiohttp's HTTP/1.1 server with two
changes, served by `ActivatorRunner` (in place of `web.AppRunner`):

- **Malformed requests are answered in JSON.** aiohttp's parser refuses a bad request line or
  header field, a line longer than `max_line_size` / `max_field_size` (8190 bytes), more than
  `max_headers` (128) fields, a malformed chunked body, TLS sent to this plain-HTTP port, …
  before any handler or middleware runs, and its `RequestHandler.handle_error` answers in plain
  text. `ActivatorConnection.handle_error` answers as the app and the instances' gunicorn
  workers do (`http/workers.py`): OpenAI's error shape, the status aiohttp picks (400), a code,
  a message saying what to fix followed by aiohttp's own words, `Connection: close`. (aiohttp 3
  offers no other hook for these answers; aiohttp 4 passes such requests through the middlewares
  with `request.pre_handler_error` set.)
- **A deadline on receiving each request.** Its request line, headers and body must all have
  arrived within `receive_timeout_s` of its first byte. A head still incomplete then is answered
  408 on the connection (nothing is sent when only blank lines came) and the connection closed;
  a body still incomplete fails the read waiting for it with `ReceiveTimeout` (the instances'
  own, `http/receive_deadline.py`), which the app answers 408 (`app.py`), and the connection is
  closed. The clock stops once the body is in, so a response that streams for minutes is never
  cut; a request that starts arriving while the one before it is still being answered is timed
  again from the end of that answer. Bytes that come in one read with a whole request before
  them are timed once more bytes follow: a client that sends none holds an idle connection, as
  between requests, which aiohttp's keep-alive timeout closes.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import (
    BadHttpMethod,
    BadStatusLine,
    HttpProcessingError,
    InvalidHeader,
    InvalidURLError,
    LineTooLong,
    PayloadEncodingError,
)
from aiohttp.streams import StreamReader

from snapfn.handler.http.openai.shapes import error_body
from snapfn.handler.http.receive_deadline import ReceiveTimeout
from snapfn.handler.http.workers import refusal_response

log = logging.getLogger("snapfn.activator")
MAX_DETAIL_CHARS = 200  # aiohttp's words may quote the request: a line runs to 8 KB
BLANK_LINES = b"\r\n"  # what a client may send between requests (ignored by the parser)


@dataclass(frozen=True)
class Malformed:
    """How one kind of aiohttp parser error is answered. `fix` is formatted with the
    connection's limits (`_limits`)."""

    errors: tuple[type[BaseException], ...]
    code: str
    fix: str


# aiohttp's parser errors → the answers; the first match wins (BadHttpMethod is a BadStatusLine)
MALFORMED = (
    Malformed(
        (LineTooLong,),
        "line_too_long",
        "request line longer than {line_bytes} bytes or header field longer than {field_bytes} "
        "bytes: shorten the URL and the header values, send large values in the body",
    ),
    Malformed(
        (BadStatusLine, InvalidURLError),
        "invalid_request_line",
        "malformed request line: send 'METHOD /path HTTP/1.1' ended by CRLF, in plain HTTP "
        "(not TLS) on this port",
    ),
    Malformed(
        (InvalidHeader,),
        "invalid_header",
        "malformed header field: send one 'Name: value' line per field, ended by CRLF",
    ),
    Malformed(
        (PayloadEncodingError,),
        "invalid_body",
        "malformed body: send well-formed chunks, or as many bytes as Content-Length says",
    ),
)
# what the parser refuses as a BadHttpMessage: repeated or conflicting Content-Length and
# Transfer-Encoding, too many header fields, a missing Host, a malformed chunk size, …
MALFORMED_OTHERWISE = Malformed(
    (),
    "invalid_request",
    "malformed request: send one 'Name: value' line per header field (at most {num_fields}), a "
    "Host header, one Content-Length or 'Transfer-Encoding: chunked' (not both) and "
    "well-formed chunks",
)


def malformed_for(exc: BaseException) -> Malformed:
    return next((m for m in MALFORMED if isinstance(exc, m.errors)), MALFORMED_OTHERWISE)


def malformed_message(malformed: Malformed, exc: HttpProcessingError, limits: dict) -> str:
    """What to fix, then aiohttp's own words on one line ("Invalid header token: b'A B: 1'")."""
    lines = (line.strip() for line in (exc.message or type(exc).__name__).splitlines())
    detail = " ".join(line for line in lines if line.strip("^"))
    if len(detail) > MAX_DETAIL_CHARS:
        detail = detail[:MAX_DETAIL_CHARS] + "…"
    return f"{malformed.fix.format(**limits)} (aiohttp: {detail})"


class ActivatorConnection(web.RequestHandler):
    """One client connection: aiohttp's, answering malformed requests in JSON and timing how long
    each request takes to arrive (the module docstring)."""

    def __init__(self, manager: web.Server, *, receive_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.receive_timeout_s = receive_timeout_s
        self._clock: asyncio.TimerHandle | None = None  # runs while a request is arriving
        self._head_seen = False  # more than blank lines came since the clock started
        self._body: StreamReader | None = None  # that of the request last handed to the app
        self._answering = False  # the app is still answering that request
        self._body_late = False  # its body missed the deadline: close once it is answered

    # ---- a request handed to the app, answered ----
    def hand_over(self, body: StreamReader) -> None:
        """The app takes a request whose head is in; `body` is its body (at EOF when in)."""
        self._body, self._answering, self._body_late = body, True, False
        if body.is_eof():
            self._stop_clock()
        else:
            body.on_eof(self._stop_clock)

    async def finish_response(
        self, request: web.BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            self._answering = False
            if self._body_late:
                self.force_close()  # NOTE: the answer is written: aiohttp drains no late body
            elif self._clock is not None and self._body_in():
                self._start_clock()  # a pipelined request: timed from the end of this answer

    # ---- bytes arriving ----
    def data_received(self, data: bytes) -> None:
        # NOTE: asked before parsing: these bytes may complete the body
        starts_request = self._body_in()
        super().data_received(data)
        if not starts_request:
            return
        if self._clock is None:
            self._head_seen = False
            self._start_clock()
        self._head_seen = self._head_seen or bool(data.strip(BLANK_LINES))

    def connection_lost(self, exc: BaseException | None) -> None:
        self._stop_clock()
        super().connection_lost(exc)

    def _body_in(self) -> bool:
        return self._body is None or self._body.is_eof()

    def _start_clock(self) -> None:
        self._stop_clock()
        loop = asyncio.get_running_loop()
        self._clock = loop.call_later(self.receive_timeout_s, self._expire)

    def _stop_clock(self) -> None:
        if self._clock is not None:
            self._clock.cancel()
            self._clock = None

    def _expire(self) -> None:
        self._clock = None
        late = ReceiveTimeout(self.receive_timeout_s)
        if not self._body_in():  # the body is late
            if self._answering:
                self._body_late = True
                self._body.set_exception(late)  # the read waiting for it fails: the app's 408
            else:
                self.force_close()  # aiohttp drains a body the app left unread: no more
            return
        if self._answering:  # pipelined behind an answer still under way: timed once it ends
            self._start_clock()
            return
        log.info("closing a connection whose request head is late (%g s)", self.receive_timeout_s)
        if self._head_seen and self.transport is not None:
            body = error_body(str(late), "invalid_request_error", code=late.code)
            self.transport.write(refusal_response(408, json.dumps(body).encode()))
        self.force_close()

    # ---- malformed requests ----
    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:  # a response is under way: aiohttp's (it raises)
            return super().handle_error(request, status, exc, message)
        if isinstance(exc, HttpProcessingError):
            malformed = malformed_for(exc)
            text = malformed_message(malformed, exc, self._limits())
            level = logging.DEBUG if isinstance(exc, BadHttpMethod) else logging.WARNING
            log.log(level, "malformed request from %s: %s", request.remote, text)
            body = error_body(text, "invalid_request_error", code=malformed.code)
        else:
            self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
            name = type(exc).__name__ if exc is not None else "no response"
            text = f"internal error in the activator ({name})"
            body = error_body(text, "server_error", code="internal_error")
        # NOTE: said outright: aiohttp answers HTTP/1.0 here, where closing goes unsaid
        response = web.json_response(body, status=status, headers={"Connection": "close"})
        response.force_close()
        return response

    def _limits(self) -> dict[str, int]:
        return {
            "line_bytes": self.max_line_size,
            "field_bytes": self.max_field_size,
            "num_fields": self.max_headers,
        }


class _ActivatorServer(web.Server):
    """aiohttp's protocol factory for the app, making `ActivatorConnection`s and telling each
    the requests it hands to the app."""

    def __init__(self, made: web.Server, receive_timeout_s: float) -> None:
        self._make_app_request = made.request_factory
        self.receive_timeout_s = receive_timeout_s
        super().__init__(
            made.request_handler,
            request_factory=self._hand_over,
            handler_cancellation=made.handler_cancellation,
        )

    def __call__(self) -> ActivatorConnection:
        loop = asyncio.get_running_loop()
        return ActivatorConnection(
            self, loop=loop, access_log=None, receive_timeout_s=self.receive_timeout_s
        )

    def _hand_over(
        self, message: Any, payload: StreamReader, protocol: ActivatorConnection, *rest: Any
    ) -> web.BaseRequest:
        protocol.hand_over(payload)
        return self._make_app_request(message, payload, protocol, *rest)


class ActivatorRunner(web.AppRunner):
    """`web.AppRunner` whose connections are `ActivatorConnection`s. NOTE: a handler is cancelled
    when its client goes away, so a held request leaves the hold queue at once (it would take a
    place there, and count as demand, until an instance came up or its wait ran out) and a
    relayed one closes its instance connection."""

    def __init__(self, app: web.Application, receive_timeout_s: float) -> None:
        super().__init__(app, handle_signals=False, handler_cancellation=True)
        self.receive_timeout_s = receive_timeout_s

    async def _make_server(self) -> web.Server:
        """aiohttp's server for the app (which this starts and freezes), with our connections."""
        return _ActivatorServer(await super()._make_server(), self.receive_timeout_s)
