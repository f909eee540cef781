"""gunicorn's workers for `snapfn serve`, answering gunicorn's own refusals as JSON.

gunicorn refuses some requests before the app sees them: a malformed request line (400), one
longer than `limit_request_line` (414), too many or too large header fields (431), an invalid
header or chunked body (400), an unsupported transfer coding (501), … Its `Worker.handle_error`
answers those with an HTML page (`gunicorn.util.write_error`). The workers here override
`handle_error` to answer as the app answers its own errors (`json_io`): OpenAI's
`{"error": {"message", "type", "param", "code"}}`, the status gunicorn picks (`REFUSALS`), a
message saying what to fix followed by gunicorn's own words, `Content-Type: application/json`
and `Connection: close`. They log the refusal and write its access-log line as gunicorn does.

The same two workers also bound how long a request takes to arrive (`receive_deadline.py`:
a JSON 408 once its headers and body took longer than `ServeConfig.receive_timeout_s`), and
carry an `UpMark` (`arbiter.py`), so that one that exits after it was up is replaced rather
than taken for a failed boot.

`json_error_worker(cfg)` is the class `snapfn serve` runs (`SnapfnServer.load_config`): the
JSON-answering subclass of the worker class the settings choose where gunicorn's sync or
gthread worker is chosen, else that class itself, whose refusals stay HTML (and which has
neither the receive deadline nor the mark).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from http import HTTPStatus
from ssl import SSLError
from typing import Any

from gunicorn import util
from gunicorn.http import errors as http_errors
from gunicorn.http.wsgi import Response, default_environ
from gunicorn.workers.gthread import ThreadWorker
from gunicorn.workers.sync import SyncWorker

from snapfn.handler.http import receive_deadline
from snapfn.handler.http.arbiter import UpMark
from snapfn.handler.http.openai.shapes import error_body
from snapfn.handler.http.receive_deadline import DeadlineListener, ReceiveTimeout

MAX_DETAIL_CHARS = 200  # gunicorn's words may quote the request: a request line runs to 8 KB
CLIENT_ERROR = "invalid_request_error"
SERVER_ERROR = "server_error"


@dataclass(frozen=True)
class Refusal:
    """How one kind of gunicorn error is answered. `fix` is formatted with `_limits`."""

    errors: tuple[type[BaseException], ...]
    status: int
    error_type: str
    code: str
    fix: str


def _errors(*names: str) -> tuple[type[BaseException], ...]:
    """gunicorn's error classes of these names that the installed gunicorn has (some came with
    later versions than the oldest this project accepts)."""
    return tuple(getattr(http_errors, name) for name in names if hasattr(http_errors, name))


# gunicorn's errors → the answers; the statuses are those gunicorn 27's `handle_error` picks
# (tests/test_gunicorn_errors.py compares them). NOTE: the first match wins: a response header
# the app sent wrong (a subclass of InvalidHeader) is the app's fault, a 500, as in gunicorn.
REFUSALS = (
    Refusal(
        _errors("InvalidResponseHeader", "InvalidResponseHeaderName"),
        500,
        SERVER_ERROR,
        "internal_error",
        "internal error (the app sent an invalid response header)",
    ),
    Refusal(
        _errors("LimitRequestLine"),
        414,
        CLIENT_ERROR,
        "request_line_too_long",
        "request line longer than {line_bytes}: shorten the URL, or send large values in the body",
    ),
    Refusal(
        _errors("LimitRequestHeaders"),
        431,
        CLIENT_ERROR,
        "header_fields_too_large",
        "too many or too large header fields: send at most {num_fields}, each at most "
        "{field_bytes}",
    ),
    Refusal(
        _errors("InvalidRequestLine", "InvalidRequestMethod", "InvalidHTTPVersion"),
        400,
        CLIENT_ERROR,
        "invalid_request_line",
        "malformed request line: send 'METHOD /path HTTP/1.1' ended by CRLF",
    ),
    Refusal(
        _errors("InvalidHeader", "InvalidHeaderName", "ObsoleteFolding", "InvalidSchemeHeaders"),
        400,
        CLIENT_ERROR,
        "invalid_header",
        "malformed header field: send one 'Name: value' line per field, ended by CRLF, and "
        "at most one Content-Length or Transfer-Encoding",
    ),
    Refusal(
        _errors("InvalidChunkSize", "ChunkMissingTerminator", "InvalidChunkExtension"),
        400,
        CLIENT_ERROR,
        "invalid_body",
        "malformed chunked body: send well-formed chunks, or a Content-Length",
    ),
    Refusal(
        _errors("UnsupportedTransferCoding"),
        501,
        CLIENT_ERROR,
        "unsupported_transfer_coding",
        "unsupported Transfer-Encoding: send the body chunked, or with a Content-Length",
    ),
    Refusal(
        _errors("ExpectationFailed"),
        417,
        CLIENT_ERROR,
        "expectation_failed",
        "unsupported Expect header: send none, or 'Expect: 100-continue'",
    ),
    Refusal(
        (*_errors("ForbiddenProxyRequest"), SSLError),
        403,
        CLIENT_ERROR,
        "forbidden",
        "request refused: not a PROXY-protocol peer this server trusts, or a failed TLS handshake",
    ),
    Refusal(
        _errors("InvalidProxyLine", "InvalidH2CPreface"),
        400,
        CLIENT_ERROR,
        "bad_request",
        "malformed PROXY-protocol line or HTTP/2 preface",
    ),
    Refusal(
        (ReceiveTimeout,),
        408,
        CLIENT_ERROR,
        ReceiveTimeout.code,
        "",  # the error's own words (`refusal_message`)
    ),
    Refusal(
        _errors("ConfigurationProblem"),
        500,
        SERVER_ERROR,
        "server_misconfigured",
        "the server's configuration cannot serve this request: tell its operator",
    ),
)
INTERNAL_ERROR = Refusal((), 500, SERVER_ERROR, "internal_error", "internal error")


def refusal_for(exc: BaseException) -> Refusal:
    """The answer to gunicorn's error `exc`; anything unknown is a 500, as in gunicorn."""
    return next((r for r in REFUSALS if isinstance(exc, r.errors)), INTERNAL_ERROR)


def refusal_message(refusal: Refusal, exc: BaseException, cfg: Any) -> str:
    """What to fix, then gunicorn's own words ("gunicorn: Invalid HTTP request line: 'GET'");
    for the server's own fault, the error's type only (its words are the server's business);
    snapfn's own receive deadline, its words alone."""
    if isinstance(exc, ReceiveTimeout):
        return str(exc)
    detail = "" if refusal.error_type == SERVER_ERROR else str(exc)
    detail = detail or type(exc).__name__
    if len(detail) > MAX_DETAIL_CHARS:
        detail = detail[:MAX_DETAIL_CHARS] + "…"
    return f"{refusal.fix.format(**_limits(exc, cfg))} (gunicorn: {detail})"


def _limits(exc: BaseException, cfg: Any) -> dict[str, str]:
    """gunicorn's request limits as the messages state them; a limit set to 0 (gunicorn then
    applies its own cap) is "this server's limit"."""
    line_bytes = getattr(exc, "max_size", None) or cfg.limit_request_line  # max_size: applied
    num_fields, field_bytes = cfg.limit_request_fields, cfg.limit_request_field_size
    limit = "this server's limit"
    return {
        "line_bytes": f"{line_bytes} bytes" if line_bytes > 0 else limit,
        "num_fields": f"{num_fields} fields" if num_fields > 0 else f"{limit} of fields",
        "field_bytes": f"{field_bytes} bytes" if field_bytes > 0 else limit,
    }


def refusal_body(refusal: Refusal, message: str) -> bytes:
    return json.dumps(error_body(message, refusal.error_type, code=refusal.code)).encode()


def refusal_response(status: int, body: bytes) -> bytes:
    """The whole HTTP response: status line, headers, the JSON error body."""
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body


class JsonErrors:
    """Mixed in before a gunicorn worker class: its `handle_error` answers in JSON."""

    cfg: Any
    log: Any

    def handle_error(self, req: Any, client: Any, addr: Any, exc: BaseException) -> None:
        started = datetime.now()
        addr = addr or ("", -1)  # a unix socket's peer
        refusal = refusal_for(exc)
        if refusal.error_type == SERVER_ERROR:
            self.log.exception("Error handling request %s", getattr(req, "uri", "(no URI read)"))
        else:
            self.log.warning("Invalid request from ip=%s: %s", addr[0], exc)
        if req is None and isinstance(exc, http_errors.InvalidHeader):
            req = exc.req  # the request it was found in, if parsed that far: for the access log
        body = refusal_body(refusal, refusal_message(refusal, exc, self.cfg))
        if req is not None:
            self._log_access(req, client, addr, refusal.status, len(body), started)
        try:
            util.write_nonblock(client, refusal_response(refusal.status, body))
        except OSError as exc_write:  # the client is gone, or not reading
            self.log.debug("Failed to send the error response: %s", exc_write)

    def _log_access(
        self, req: Any, client: Any, addr: Any, status: int, length: int, started: datetime
    ) -> None:
        environ = default_environ(req, client, self.cfg)
        environ["REMOTE_ADDR"], environ["REMOTE_PORT"] = addr[0], str(addr[1])
        resp = Response(req, client, self.cfg)
        resp.status = f"{status} {HTTPStatus(status).phrase}"
        resp.response_length = resp.sent = length
        self.log.access(resp, req, environ, datetime.now() - started)


class ServeWorker:
    """Mixed in before a gunicorn worker class: an `UpMark`, made where gunicorn builds the
    worker (in the arbiter, before the fork), and connections accepted as
    `receive_deadline.DeadlineSocket`s. The app is `serve.SnapfnServer`."""

    app: Any
    cfg: Any
    sockets: list[Any]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.up_mark = UpMark()

    def init_process(self) -> None:
        self.sockets = [DeadlineListener(s) for s in self.sockets]
        super().init_process()

    def arm_receive_deadline(self, sock: Any, at_first_read: bool = False) -> None:
        """Arm `sock`'s receive deadline for the request about to be read. NOTE: not on a
        server that may speak HTTP/2 in cleartext: one such connection serves many requests."""
        if getattr(self.cfg, "http2_cleartext", "off") == "off":
            receive_deadline.arm(sock, self.app.config.receive_timeout_s, at_first_read)


class JsonErrorSyncWorker(JsonErrors, ServeWorker, SyncWorker):
    """gunicorn's sync worker, its refusals in JSON, a deadline on each request's arrival."""

    def handle(self, listener: Any, client: Any, addr: Any) -> None:
        self.arm_receive_deadline(client)  # one request per connection, closed after it
        super().handle(listener, client, addr)


class JsonErrorThreadWorker(JsonErrors, ServeWorker, ThreadWorker):
    """gunicorn's gthread worker, its refusals in JSON, a deadline on each request's arrival."""

    def handle(self, conn: Any) -> Any:
        # NOTE: from the first read: gunicorn waits (up to 5 s) for a new connection's first
        # byte before it reads, and parks one that sends nothing
        self.arm_receive_deadline(conn.sock, at_first_read=True)
        return super().handle(conn)

    def handle_request(self, req: Any, conn: Any) -> bool:
        """gunicorn's, but a request whose deadline passed never keeps its connection: the
        rest of its body is unread."""
        try:
            keepalive = super().handle_request(req, conn)
        finally:
            expired = receive_deadline.disarm(conn.sock)
        return keepalive and not expired


# gunicorn's worker class → the one answering its refusals in JSON
JSON_ERROR_WORKERS: dict[type, type] = {
    SyncWorker: JsonErrorSyncWorker,
    ThreadWorker: JsonErrorThreadWorker,
}


def json_error_worker(cfg: Any) -> type:
    """The worker class to run for gunicorn settings `cfg`: the one they choose (gunicorn's own
    choice: `sync` with threads > 1 is gthread), answering in JSON where this module has it."""
    chosen = cfg.worker_class
    return JSON_ERROR_WORKERS.get(chosen, chosen)
