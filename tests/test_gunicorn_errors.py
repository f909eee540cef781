"""gunicorn's own refusals (`handler/http/workers.py`) are JSON, in OpenAI's error shape.

A real `snapfn serve` (one function server for the module) is sent raw requests gunicorn refuses
before the app sees them: each answer has gunicorn's status, `Content-Type: application/json`,
`Connection: close` and `{"error": {"message", "type", "param", "code"}}` saying what to fix.
Without a server: every error gunicorn's `handle_error` knows gets the status gunicorn itself
gives it, and the worker class the settings choose is the JSON-answering one.
"""

from __future__ import annotations

import http.client
import inspect
import json
import socket
import ssl
from types import SimpleNamespace
from unittest import mock
from urllib.parse import urlsplit

import pytest
from gunicorn.config import Config
from gunicorn.http import errors
from gunicorn.workers.base import Worker

from snapfn.handler.http.serve import SnapfnServer
from snapfn.handler.http.serve_config import ServeConfig
from snapfn.handler.http.workers import JsonErrors

from test_serve_e2e import Server

FUNCTION = "def handler(event, context):\n    return event\n"
MANY_FIELDS = b"".join(b"X-Field-%d: v\r\n" % i for i in range(101))  # gunicorn's limit: 100


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("gunicorn-errors")
    (workdir / "echo_fn.py").write_text(FUNCTION)
    server = Server(["--function", "echo_fn:handler", "--function-dir", str(workdir)], workdir)
    yield server
    server.stop()


def exchange(url: str, request: bytes) -> http.client.HTTPResponse:
    """Send `request` as raw bytes; the server's answer, read whole."""
    address = urlsplit(url)
    with socket.create_connection((address.hostname, address.port), timeout=10) as sock:
        sock.sendall(request)
        response = http.client.HTTPResponse(sock)
        response.begin()
        response.body = response.read()
    return response


@pytest.mark.parametrize(
    "request_bytes, status, code, says",
    [
        pytest.param(
            b"GET /" + b"a" * 5000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
            414,
            "request_line_too_long",
            "request line longer than 4094 bytes",
            id="request-line-too-long",
        ),
        pytest.param(
            b"GET /health HTTP/1.1\r\nHost: x\r\n" + MANY_FIELDS + b"\r\n",
            431,
            "header_fields_too_large",
            "send at most 100 fields, each at most 8190 bytes",
            id="too-many-header-fields",
        ),
        pytest.param(
            b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"v" * 8200 + b"\r\n\r\n",
            431,
            "header_fields_too_large",
            "send at most 100 fields, each at most 8190 bytes",
            id="header-field-too-long",
        ),
        pytest.param(
            b"GARBAGE\r\n\r\n",
            400,
            "invalid_request_line",
            "send 'METHOD /path HTTP/1.1'",
            id="garbage-request-line",
        ),
        pytest.param(
            b"GET /health HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n",
            400,
            "invalid_header",
            "'Name: value'",
            id="header-without-colon",
        ),
        pytest.param(
            b"POST /invoke HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: br, chunked\r\n\r\n",
            501,
            "unsupported_transfer_coding",
            "send the body chunked, or with a Content-Length",
            id="unsupported-transfer-coding",
        ),
    ],
)
def test_a_request_gunicorn_refuses_is_answered_in_json(server, request_bytes, status, code, says):
    response = exchange(server.url, request_bytes)
    assert response.status == status, response.body
    assert response.getheader("Content-Type") == "application/json"
    assert response.getheader("Connection") == "close"
    assert int(response.getheader("Content-Length")) == len(response.body)
    error = json.loads(response.body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] is None
    assert error["code"] == code
    assert says in error["message"] and "(gunicorn: " in error["message"]


# ---- without a server -----------------------------------------------------------------------
def gunicorn_errors() -> list[BaseException]:
    """An instance of every error gunicorn's parser raises, TLS's, and one nobody expects."""
    found = [
        cls
        for _, cls in inspect.getmembers(errors, inspect.isclass)
        if issubclass(cls, errors.ParseException) and cls is not errors.ParseException
    ]
    made = []
    for cls in found:
        try:
            made.append(cls("x"))
        except TypeError:
            made.append(cls())
    return [*made, ssl.SSLError(1, "bad handshake"), RuntimeError("a bug")]


def answer(handle_error, exc: BaseException) -> tuple[int, bytes, bytes]:
    """(status, head, body) a worker's `handle_error` writes for `exc` (no request parsed)."""
    worker = SimpleNamespace(cfg=Config(), log=mock.Mock())
    ours, theirs = socket.socketpair()
    with ours, theirs:
        handle_error(worker, None, ours, ("127.0.0.1", 5), exc)
        ours.shutdown(socket.SHUT_WR)
        reply = b"".join(iter(lambda: theirs.recv(1 << 16), b""))
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), head, body


@pytest.mark.parametrize("exc", gunicorn_errors(), ids=lambda e: type(e).__name__)
def test_every_gunicorn_error_keeps_the_status_gunicorn_gives_it(exc):
    status, head, body = answer(JsonErrors.handle_error, exc)
    assert status == answer(Worker.handle_error, exc)[0]
    assert b"Content-Type: application/json" in head.split(b"\r\n")
    error = json.loads(body)["error"]
    assert error["type"] == ("server_error" if status == 500 else "invalid_request_error")
    if status == 500:
        assert "a bug" not in error["message"]  # the server's own words stay in its log


@pytest.mark.parametrize(
    "settings, chosen",
    [
        ({}, "JsonErrorThreadWorker"),
        ({"GUNICORN_CMD_ARGS": "--worker-class sync"}, "JsonErrorSyncWorker"),
        ({"GUNICORN_CMD_ARGS": "--worker-class sync --threads 4"}, "JsonErrorThreadWorker"),
    ],
)
def test_the_chosen_worker_class_answers_in_json(settings, chosen):
    app = SnapfnServer(target=None, config=ServeConfig(threads=1), environ=settings)
    assert app.cfg.worker_class.__name__ == chosen
