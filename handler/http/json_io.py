"""JSON in and out of the HTTP front door, errors included.

Contract:
- `read_json_body()` is the request's body as strict JSON (no `NaN`/`Infinity`, no integer of
  more than `MAX_INT_DIGITS` digits); an empty or malformed body is an `ApiError` 400
  (`invalid_json`), a string that is not valid Unicode (a
  lone surrogate such as `"\\ud800"`, bytes that are not UTF-8) a 400 `invalid_unicode` naming
  where it is. A body over the app's `MAX_CONTENT_LENGTH` is a 413, with a `Content-Length`
  or sent chunked (read up to one byte past the limit, never cut and parsed). Before the 413
  goes out, the rest of the body is read and dropped, up to `LINGER_FACTOR` × the limit, so
  that a client still sending it reads the answer instead of a reset; a body longer still has
  its connection closed after the 413. A chunked body the server cannot read (a malformed chunk
  size, a chunk without its terminator, a connection that ends mid-body) is a 400
  (`invalid_body`). A body that has not all arrived within the receive deadline
  (`receive_deadline.py`) is a 408 (`request_timeout`), its connection closed after it.
- `json_response(body, status, headers)` sends a JSON response; `json_safe(value)` turns the
  non-finite floats of a value (a manifest, a function's result) into null first.
- `install_error_handlers(app, retry_after_s)` makes every error a JSON response in OpenAI's
  shape (`openai/shapes.error_body`): `ApiError` → its status, other `BadRequest` → 400
  (with its `param` where it names a field),
  not ready or starting → 503 with `Retry-After`, failed start or stopped runtime → 503,
  a body past the receive deadline → 408, HTTP errors → their code
  (a 405 keeps its `Allow`), anything else → a logged 500, never a dead worker.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Mapping
from typing import Any

from flask import Flask, Response, jsonify, request
from gunicorn.http.errors import ParseException
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from snapfn.handler.function.target import NotReady
from snapfn.handler.http.openai.request import ApiError
from snapfn.handler.http.openai.shapes import error_body
from snapfn.handler.http.receive_deadline import ReceiveTimeout
from snapfn.handler.http.startup_gate import ServiceUnavailable
from snapfn.snapshot.errors import BadRequest, InitFailed

log = logging.getLogger("snapfn.http")
SURROGATE = re.compile("[\ud800-\udfff]")  # what no valid Unicode string holds
READ_CHUNK_BYTES = 1 << 16
MAX_INT_DIGITS = 4300  # a JSON integer longer is refused (Python's own bound on int("…"))
LINGER_FACTOR = 4  # a refused body's rest is read and dropped up to this many limits
# what a server's body stream raises for a body it cannot read: gunicorn's framing errors, its
# NoMoreData (an OSError) for a body cut short, werkzeug's dev server's OSError / ValueError
BODY_READ_ERRORS = (ParseException, OSError, ValueError)


def install_error_handlers(app: Flask, retry_after_s: int) -> None:
    @app.errorhandler(ApiError)
    def api_error(exc: ApiError) -> Response:
        kind = "invalid_request_error"
        return json_response(error_body(str(exc), kind, exc.param, exc.api_code), exc.status)

    @app.errorhandler(BadRequest)
    def bad_request(exc: BadRequest) -> Response:
        param = getattr(exc, "param", None)  # a structured-output field (`InvalidGuide`)
        body = error_body(str(exc), "invalid_request_error", param, code=exc.code)
        return json_response(body, 400)

    @app.errorhandler(ServiceUnavailable)
    def unavailable(exc: ServiceUnavailable) -> Response:
        headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s else {}
        body = error_body(str(exc), "service_unavailable", code=exc.reason)
        return json_response(body, 503, headers)

    @app.errorhandler(NotReady)
    def not_ready(exc: NotReady) -> Response:
        headers = {"Retry-After": str(retry_after_s)}
        body = error_body(str(exc), "service_unavailable", code=exc.code)
        return json_response(body, 503, headers)

    @app.errorhandler(InitFailed)
    def init_failed(exc: InitFailed) -> Response:
        return json_response(error_body(str(exc), "service_unavailable", code=exc.code), 503)

    @app.errorhandler(ReceiveTimeout)
    def receive_timeout(exc: ReceiveTimeout) -> Response:
        log.warning("%s %s from %s: %s", request.method, request.path, request.remote_addr, exc)
        body = error_body(str(exc), "invalid_request_error", code=exc.code)
        return json_response(body, 408, {"Connection": "close"})

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException) -> Response:
        code = (exc.name or "error").lower().replace(" ", "_")
        body = error_body(exc.description or exc.name, "invalid_request_error", code=code)
        headers = {}
        allow = exc.get_response().headers.get("Allow")  # a 405 must say what is allowed
        if allow:
            headers["Allow"] = allow
        if isinstance(exc, RequestEntityTooLarge) and not _drop_the_rest():
            headers["Connection"] = "close"
        return json_response(body, exc.code, headers)

    @app.errorhandler(Exception)
    def internal_error(exc: Exception) -> Response:
        log.exception("unhandled error serving %s %s", request.method, request.path)
        message = f"internal error ({type(exc).__name__}); the worker is still serving"
        return json_response(error_body(message, "server_error", code="internal_error"), 500)


def json_response(
    body: Any, status: int = 200, headers: Mapping[str, str] | None = None
) -> Response:
    response = jsonify(body)
    response.status_code = status
    response.headers.update(headers or {})
    return response


def read_json_body() -> Any:
    """The request's body, parsed as strict JSON, every string in it valid Unicode."""
    data = _read_body()
    if not data.strip():
        raise ApiError("the request body is empty: send a JSON object", code="invalid_json")
    try:
        value = json.loads(data, parse_constant=_reject_constant, parse_int=_bounded_int)
    except UnicodeDecodeError as exc:
        raise ApiError(
            f"the body is not UTF-8 ({exc.reason} at byte {exc.start})", code="invalid_unicode"
        ) from None
    except (ValueError, RecursionError) as exc:
        raise ApiError(f"the body is not valid JSON ({exc})", code="invalid_json") from None
    place = _invalid_unicode_place(value)
    if place is not None:
        where = place[:120] or "the body"
        raise ApiError(
            f"'{where}' holds a lone surrogate (such as \\ud800), which is not valid "
            "Unicode: send text, or pair the surrogates",
            param=re.split(r"[.\[]", place, maxsplit=1)[0] or None,
            code="invalid_unicode",
        )
    return value


def _read_body() -> bytes:
    """The body's bytes. A declared length over the limit was refused by werkzeug (413); a
    chunked body, whose end only the server knows, is read up to one byte past the limit."""
    limit = request.max_content_length
    if request.content_length is not None or limit is None:
        return request.get_data()
    if "wsgi.input_terminated" not in request.environ:
        return request.get_data()  # werkzeug reads nothing it cannot bound
    stream, chunks, size = request.environ["wsgi.input"], [], 0
    while size <= limit:
        try:
            chunk = stream.read(min(READ_CHUNK_BYTES, limit + 1 - size))
        except BODY_READ_ERRORS as exc:
            raise ApiError(
                f"the request body could not be read ({type(exc).__name__}): send a "
                "well-formed chunked body, or a Content-Length",
                code="invalid_body",
            ) from None
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    if size > limit:
        raise RequestEntityTooLarge()
    return b"".join(chunks)


def _drop_the_rest() -> bool:
    """Read and drop what is left of a refused body, up to `LINGER_FACTOR` limits; whether it
    ended there (else the connection must close: its rest is still unread)."""
    stream = request.environ.get("wsgi.input")
    declared = request.content_length
    if stream is None or ("wsgi.input_terminated" not in request.environ and declared is None):
        return declared is None  # nothing a server lets us read
    budget = LINGER_FACTOR * (request.max_content_length or 0)
    if declared is not None:
        if declared > budget:
            return False
        budget = declared
    while budget > 0:
        try:
            chunk = stream.read(min(READ_CHUNK_BYTES, budget))
        except (*BODY_READ_ERRORS, ReceiveTimeout):
            return False  # where its rest ends is unknown
        if not chunk:
            return True
        budget -= len(chunk)
    return declared is not None  # a declared length read whole; a chunked one may go on


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def _bounded_int(text: str) -> int:
    """A JSON integer; one of more than `MAX_INT_DIGITS` digits, far past any field's range,
    is refused in the client's terms (Python's own error names an interpreter setting)."""
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(
            f"an integer of {len(text.lstrip('-'))} digits, more than the {MAX_INT_DIGITS} "
            "any field accepts"
        )
    return int(text)


def _invalid_unicode_place(value: Any) -> str | None:
    """Where in a decoded JSON value a string (a key or a value) holds a lone surrogate
    (`messages[0].content`; "" for the body itself), or None. Iterative: a body may nest as
    deep as the JSON decoder allows."""
    pending: list[tuple[Any, str]] = [(value, "")]
    while pending:
        item, place = pending.pop()
        if isinstance(item, str):
            if SURROGATE.search(item):
                return place
        elif isinstance(item, dict):
            for key, inner in item.items():
                if SURROGATE.search(key):
                    return place  # NOTE: the key itself never goes into a message
                pending.append((inner, f"{place}.{key}" if place else key))
        elif isinstance(item, list):
            pending.extend((inner, f"{place}[{i}]") for i, inner in enumerate(item))
    return None


def json_safe(value: Any) -> Any:
    """`value` with NaN/inf floats as null, so the output is strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value
