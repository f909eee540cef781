"""The activator's edges, on a real socket served through `activator_runner`:

- requests an instance would refuse, or a document it would serve without the API key, start
  nothing: `/openapi.json` is answered by the activator (it was relayed, cold-starting an
  instance for any anonymous client), a repeated `Authorization` header is refused as the
  instance's gunicorn joins and refuses it, and a header named with `_` (`SCRIPT_NAME`, which
  the instance takes from its loopback forwarder to cut the path) is not relayed;
- requests aiohttp's parser refuses are answered in JSON in the app's error shape, saying what
  to fix (they were aiohttp's plain-text 400s);
- a request whose head or body trickles in is answered 408 and its connection closed once the
  receive deadline passes (it held its connection for as long as the client liked), while an
  idle keep-alive connection and a response that streams for longer are left alone.

The pool is `test_activator_pool`'s (fake instances that never come up: a request that reaches
it stays held) or `test_activator_proxy`'s fake instance; the slow test runs a real activator
with a function instance (`activator_client.Activator`).
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import socket
import time

import pytest
import requests
from aiohttp import ClientSession, web
from aiohttp.test_utils import TestServer
from test_activator_pool import Harness, scenario
from test_activator_proxy import FakeInstance, OneInstancePool

from snapfn.handler.activator.app import _instance_session, activator_runner, create_activator_app
from snapfn.handler.activator.metrics import ActivatorMetrics
from snapfn.handler.activator.plan import ActivatorPlan, served_model_name
from snapfn.handler.cli import build_parser
from snapfn.handler.http.openapi import openapi_document
from snapfn.handler.http.serve_config import ServeConfig

from activator_client import Activator

KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
AUTH_LINE = f"Authorization: Bearer {KEY}\r\n".encode()
DEADLINE_S = 0.3  # the receive deadline of the in-process activators
ECHO_FUNCTION = "def handler(event, context):\n    return {'echo': event}\n"


@contextlib.asynccontextmanager
async def served(pool, config: ServeConfig, plan: ActivatorPlan, receive_timeout_s=DEADLINE_S):
    """The activator's app on a free localhost port, as `snapfn serve --idle-timeout` runs it."""
    async with _instance_session() as session:
        app = create_activator_app(pool, plan, config, ActivatorMetrics(), session)
        runner = activator_runner(app, receive_timeout_s)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        try:
            yield f"http://127.0.0.1:{runner.addresses[0][1]}", runner.addresses[0][1]
        finally:
            await runner.cleanup()


def held_harness() -> Harness:
    """A pool whose instances never come up: a request that reaches it is a 504 after 0.2 s."""
    return Harness(api_key=KEY, startup_wait_s=0.2)


def keyed_plan(model_name: str | None = "m") -> ActivatorPlan:
    return ActivatorPlan((), 1, (), (), KEY, model_name=model_name)


async def read_all(reader: asyncio.StreamReader, timeout_s: float = 5.0) -> bytes:
    """Everything until the activator closes the connection."""
    return await asyncio.wait_for(reader.read(), timeout_s)


def split_response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


def json_error(raw: bytes) -> tuple[int, dict]:
    status, headers, body = split_response(raw)
    assert headers["content-type"].startswith("application/json"), raw
    assert headers["connection"] == "close", raw
    return status, json.loads(body[: int(headers["content-length"])])["error"]


# ---- requests an instance would refuse, or answer without the key, start nothing -------------
def test_openapi_is_answered_here_without_the_key_and_starts_nothing():
    async def run():
        h = held_harness()
        async with served(h.pool, h.config, keyed_plan("m")) as (url, _), ClientSession() as c:
            async with c.get(f"{url}/openapi.json") as r:
                assert r.status == 200 and r.content_type == "application/json"
                assert await r.json() == json.loads(json.dumps(openapi_document("m")))
            async with c.head(f"{url}/openapi.json") as r:
                assert r.status == 200
            async with c.post(f"{url}/openapi.json", headers=AUTH) as r:  # the instance's 405
                assert r.status == 405 and (await r.json())["error"]["code"] == "method_not_allowed"
        assert h.launched == [] and h.sample("snapfn_activator_hold_seconds_count") == 0

    scenario(run())


def test_openapi_is_relayed_where_only_an_instance_knows_the_model_name():
    async def run():
        h = held_harness()
        async with (
            served(h.pool, h.config, keyed_plan(None)) as (url, _),
            ClientSession() as c,
            c.get(f"{url}/openapi.json") as r,
        ):
            assert r.status == 504  # held for an instance (that never comes up here)
        assert len(h.launched) == 1

    scenario(run())


def test_a_repeated_authorization_header_is_refused_and_starts_nothing():
    async def run():
        h = held_harness()
        twice = [("Authorization", f"Bearer {KEY}"), ("Authorization", "Bearer other")]
        async with served(h.pool, h.config, keyed_plan()) as (url, _), ClientSession() as c:
            async with c.post(f"{url}/invoke", data=b"{}", headers=twice) as r:
                assert r.status == 401 and r.headers["WWW-Authenticate"] == "Bearer"
                assert (await r.json())["error"]["code"] == "invalid_api_key"
            async with c.post(f"{url}/startup", headers=twice[::-1]) as r:
                assert r.status == 401
        assert h.launched == []

    scenario(run())


def test_header_names_with_an_underscore_are_not_relayed():
    async def seen(request: web.Request) -> web.Response:
        return web.json_response(sorted(request.headers.keys()))

    async def run():
        fake = FakeInstance()
        fake.app.router.add_get("/seen", seen)
        config = ServeConfig(idle_timeout_s=1.0)
        async with TestServer(fake.app) as upstream:
            pool = OneInstancePool(str(upstream.make_url("")).rstrip("/"))
            headers = {"SCRIPT_NAME": "/x", "X_Tag": "a", "X-Tag": "b"}
            async with (
                served(pool, config, ActivatorPlan((), 1, (), (), None)) as (url, _),
                ClientSession() as c,
                c.get(f"{url}/seen", headers=headers) as r,
            ):
                names = await r.json()
        assert "X-Tag" in names and not [n for n in names if "_" in n]

    scenario(run())


@pytest.mark.parametrize(
    "argv, name",
    [
        (["--function", "echo_fn:handler"], "echo_fn:handler"),
        (["--snapshot", "/snaps/llama-8b/"], "llama-8b"),
        (["--model", "/models/qwen", "--snapshot", "s3://b/snap"], "qwen"),
        (["--snapshot", "s3://b/snap", "--model-name", "named"], "named"),
        (["--snapshot", "s3://b/snap"], None),  # the cache folder's name: the instance's to tell
    ],
)
def test_the_plan_knows_the_model_name_instances_serve(argv, name):
    args = build_parser().parse_args(["serve", "--idle-timeout", "5", *argv])
    config = ServeConfig.from_env({}, idle_timeout_s=5.0, model_name=args.model_name)
    assert served_model_name(args, config) == name


# ---- malformed requests: JSON, saying what to fix ---------------------------------------------
HEAD_END = b"Host: x\r\n\r\n"
MALFORMED = {
    "request line": (b"GARBAGE\r\n\r\n", "invalid_request_line", "METHOD /path HTTP/1.1"),
    "TLS": (b"\x16\x03\x01\x00\xa5\x01\x00\x00", "invalid_request_line", "not TLS"),
    "version": (b"GET / HTTP/9.x\r\n" + HEAD_END, "invalid_request_line", "METHOD /path"),
    "long URL": (
        b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n" + HEAD_END,
        "line_too_long",
        "request line longer than 8190 bytes",
    ),
    "long header": (
        b"GET / HTTP/1.1\r\nX-A: " + b"a" * 9000 + b"\r\n" + HEAD_END,
        "line_too_long",
        "header field longer than 8190 bytes",
    ),
    "header name": (b"GET / HTTP/1.1\r\nBad Name: 1\r\n" + HEAD_END, "invalid_request", "Name:"),
    "header value": (b"GET / HTTP/1.1\r\nX-A: a\x01b\r\n" + HEAD_END, "invalid_request", "Name"),
    "many headers": (
        b"GET / HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(200)) + HEAD_END,
        "invalid_request",
        "at most 128",
    ),
    "two lengths": (
        b"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n" + HEAD_END + b"ab",
        "invalid_request",
        "one Content-Length",
    ),
    "chunk size": (
        b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n" + HEAD_END + b"zz\r\nab\r\n0\r\n\r\n",
        "invalid_request",
        "well-formed chunks",
    ),
}


@pytest.mark.parametrize("name", MALFORMED)
def test_a_malformed_request_is_answered_in_json_saying_what_to_fix(name):
    raw, code, fix = MALFORMED[name]

    async def run():
        h = held_harness()
        async with served(h.pool, h.config, keyed_plan()) as (_, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(raw)
            status, error = json_error(await read_all(reader))
            writer.close()
        assert (status, error["type"], error["code"]) == (400, "invalid_request_error", code)
        assert fix in error["message"] and "(aiohttp: " in error["message"], error["message"]
        assert h.launched == []

    scenario(run())


# ---- the receive deadline -------------------------------------------------------------------
async def trickle(writer: asyncio.StreamWriter, data: bytes, every_s: float = 0.05) -> None:
    """`data` a byte at a time, for as long as the connection takes it."""
    with contextlib.suppress(ConnectionError):
        for byte in data:
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(every_s)


@pytest.mark.parametrize(
    "start, trickled",
    [
        (b"", b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: 1\r\n" * 100),  # the head
        (
            b"POST /invoke HTTP/1.1\r\nHost: x\r\n" + AUTH_LINE + b"Content-Length: 200\r\n\r\n",
            b"{" * 200,
        ),  # body
    ],
)
def test_a_trickling_request_is_a_408_at_the_deadline_and_its_connection_closed(start, trickled):
    async def run():
        h = held_harness()
        async with served(h.pool, h.config, keyed_plan()) as (_, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(start)
            began = time.monotonic()
            sending = asyncio.create_task(trickle(writer, trickled))
            status, error = json_error(await read_all(reader))  # read_all: then it closed
            waited_s = time.monotonic() - began
            sending.cancel()
            writer.close()
        assert (status, error["code"]) == (408, "request_timeout"), error
        assert f"within {DEADLINE_S:g} s" in error["message"]
        assert DEADLINE_S * 0.9 <= waited_s < DEADLINE_S + 1.5
        assert h.launched == [] and h.pool.describe()["held_requests"] == 0

    scenario(run())


def test_a_connection_with_only_blank_lines_is_closed_without_an_answer():
    async def run():
        h = held_harness()
        async with served(h.pool, h.config, keyed_plan()) as (_, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"\r\n")
            assert await read_all(reader) == b""
            writer.close()

    scenario(run())


def test_the_deadline_times_receiving_only_not_idle_connections_or_streamed_answers():
    async def run():
        fake = FakeInstance()
        config = ServeConfig(idle_timeout_s=1.0)
        async with TestServer(fake.app) as upstream:
            pool = OneInstancePool(str(upstream.make_url("")).rstrip("/"))
            async with served(pool, config, ActivatorPlan((), 1, (), (), None)) as (_, port):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                status, headers, _ = split_response(await reader.readuntil(b"\r\n\r\n"))
                await reader.readexactly(int(headers["content-length"]))
                assert status == 200
                await asyncio.sleep(DEADLINE_S * 3)  # idle keep-alive: not timed
                # an event stream longer than the deadline, the start of a request behind it
                writer.write(b"GET /sse HTTP/1.1\r\nHost: x\r\n\r\n")
                assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
                assert (await reader.readuntil(b"data: 1\n\n")).endswith(b"data: 1\n\n")
                writer.write(b"GET /health HTTP/1.1\r\n")
                await asyncio.sleep(DEADLINE_S * 3)
                fake.next_event.set()
                ended = time.monotonic()
                rest = await read_all(reader)
                waited_s = time.monotonic() - ended
                writer.close()
        stream, _, after = rest.partition(b"0\r\n\r\n")  # the chunked stream's end
        assert stream.strip() == b"9\r\ndata: 2"  # the second event, nothing cut, nothing else
        # the pipelined request's head, never finished, is timed from the end of the stream
        status, error = json_error(after)
        assert (status, error["code"]) == (408, "request_timeout")
        assert DEADLINE_S * 0.9 <= waited_s < DEADLINE_S + 1.5

    scenario(run())


# ---- a real activator and instance -----------------------------------------------------------
def raw_request(url: str, method: str, path: str, headers: list, body: bytes = b""):
    host, port = url.removeprefix("http://").split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=60)
    c.putrequest(method, path, skip_accept_encoding=True)
    for name, value in [*headers, ("Content-Length", str(len(body)))]:
        c.putheader(name, value)
    c.endheaders(body)
    r = c.getresponse()
    return r.status, r.read()


@pytest.mark.slow
def test_a_real_activator_starts_no_instance_for_what_an_instance_would_refuse(tmp_path):
    (tmp_path / "echo_fn.py").write_text(ECHO_FUNCTION)
    args = ["--function", "echo_fn:handler", "--function-dir", str(tmp_path)]
    args += ["--idle-timeout", "30", "--receive-timeout-s", "0.5"]
    a = Activator(args, tmp_path, env={"SNAPFN_API_KEY": KEY})
    a.headers = AUTH
    try:
        document = requests.get(f"{a.url}/openapi.json", timeout=10).json()
        twice = [("Authorization", f"Bearer {KEY}"), ("Authorization", "Bearer other")]
        assert raw_request(a.url, "POST", "/invoke", twice, b"{}")[0] == 401
        assert a.startup()["cold_starts"] == 0
        host, port = a.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(
                b"POST /invoke HTTP/1.1\r\nHost: x\r\n" + AUTH_LINE + b"Content-Length: 9\r\n\r\n{"
            )
            answer = s.recv(65536)
        assert split_response(answer)[0] == 408 and b"request_timeout" in answer
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(b"GARBAGE\r\n\r\n")
            assert b"invalid_request_line" in s.recv(65536)
        assert a.startup()["cold_starts"] == 0 and a.instances() == []
        # with the key: an instance starts; its own document is the one the activator gave
        assert requests.post(f"{a.url}/invoke", json={}, headers=AUTH, timeout=60).ok
        [instance] = a.instances("up")
        own = requests.get(f"{instance['url']}/openapi.json", timeout=10).json()
        assert own == document and own["components"]["schemas"]
        # SCRIPT_NAME does not reach it: it routes the path the activator saw
        headers = [*AUTH.items(), ("SCRIPT_NAME", "/x")]
        assert raw_request(a.url, "POST", "/x/invoke", headers, b"{}")[0] == 404
    finally:
        a.stop()
