"""JSON bodies in (`handler/http/json_io.py`): the size limit with and without a
Content-Length, a chunked body the server cannot read, invalid Unicode, strict JSON; on a bare
Flask app with the error handlers."""

from __future__ import annotations

import io

import pytest
from flask import Flask
from gunicorn.http.body import Body, ChunkedReader
from gunicorn.http.unreader import IterUnreader

from snapfn.handler.http.json_io import install_error_handlers, json_response, read_json_body

LIMIT = 1000


@pytest.fixture(scope="module")
def client():
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = LIMIT
    install_error_handlers(app, retry_after_s=1)

    @app.post("/echo")
    def echo():
        return json_response({"body": read_json_body()})

    return app.test_client()


def chunked(client, data: bytes):
    """A POST whose body has no Content-Length, as a server that ends chunked bodies hands it."""
    return client.post(
        "/echo",
        input_stream=io.BytesIO(data),
        content_type="application/json",
        headers={"Transfer-Encoding": "chunked"},
        environ_overrides={"wsgi.input_terminated": True},
    )


def body_of(size: int) -> bytes:
    text = b'{"x": "' + b"a" * (size - 9) + b'"}'
    assert len(text) == size
    return text


@pytest.mark.parametrize("size", [LIMIT - 1, LIMIT])
def test_a_chunked_body_within_the_limit_is_read_whole(client, size):
    r = chunked(client, body_of(size))
    assert r.status_code == 200 and len(r.json["body"]["x"]) == size - 9


@pytest.mark.parametrize(("size", "closed"), [(LIMIT + 1, False), (50 * LIMIT, True)])
def test_a_chunked_body_over_the_limit_is_413_not_cut(client, size, closed):
    r = chunked(client, body_of(size))
    assert r.status_code == 413 and r.json["error"]["code"] == "request_entity_too_large"
    # its rest is read and dropped up to LINGER_FACTOR limits; a longer one closes
    assert (r.headers.get("Connection") == "close") is closed


@pytest.mark.parametrize(("size", "closed"), [(LIMIT + 1, False), (50 * LIMIT, True)])
def test_a_declared_length_over_the_limit_is_413(client, size, closed):
    r = client.post("/echo", data=body_of(size), content_type="application/json")
    assert r.status_code == 413
    assert (r.headers.get("Connection") == "close") is closed


@pytest.mark.parametrize(
    ("data", "where"),
    [
        (b'{"x": "\\ud800"}', "'x'"),
        (b'{"x": ["ok", {"y": "a\\udc00"}]}', "'x[1].y'"),
        (b'{"\\ud800": 1}', "'the body'"),
        (b'"\\udfff"', "'the body'"),
    ],
)
def test_lone_surrogates_are_invalid_unicode(client, data, where):
    r = client.post("/echo", data=data, content_type="application/json")
    assert r.status_code == 400 and r.json["error"]["code"] == "invalid_unicode"
    assert where in r.json["error"]["message"]


def test_bytes_that_are_not_utf8_are_invalid_unicode(client):
    r = client.post("/echo", data=b'{"x": "\xc3\x28"}', content_type="application/json")
    assert r.status_code == 400 and r.json["error"]["code"] == "invalid_unicode"


def test_deep_nesting_is_a_400_not_a_crash(client):
    app = Flask(__name__)
    install_error_handlers(app, retry_after_s=1)
    app.post("/echo")(lambda: json_response({"body": read_json_body()}))
    deep = b"[" * 900 + b'"\\ud800"' + b"]" * 900  # the walker is iterative
    r = app.test_client().post("/echo", data=deep, content_type="application/json")
    assert r.status_code == 400 and r.json["error"]["code"] in ("invalid_unicode", "invalid_json")


@pytest.mark.parametrize("framing", [b"zz\r\nabc\r\n0\r\n\r\n", b"3\r\nabcXX0\r\n\r\n", b"5\r\nab"])
def test_a_chunked_body_the_server_cannot_read_is_a_400(client, framing):
    stream = Body(ChunkedReader(None, IterUnreader([framing])))  # what gunicorn hands the app
    r = client.post(
        "/echo",
        content_type="application/json",
        headers={"Transfer-Encoding": "chunked"},
        environ_overrides={"wsgi.input_terminated": True, "wsgi.input": stream},
    )
    assert r.status_code == 400 and r.json["error"]["code"] == "invalid_body"
    assert "could not be read" in r.json["error"]["message"]
