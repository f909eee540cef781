"""`activator/proxy.py` and the activator's app (`activator/app.py`) against a fake instance.

The instance is a small aiohttp server whose handlers the test steers (an event stream that
waits for the test between events, bodies cut short, a closed port), so streaming without
buffering, the 502 and break-off paths, header filtering, client disconnects, auth and the
JSON errors are each checked exactly, in-process and without torch.
"""

from __future__ import annotations

import asyncio
import json
import socket
from types import SimpleNamespace

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from snapfn.handler.activator.app import _instance_session, create_activator_app
from snapfn.handler.activator.metrics import ActivatorMetrics
from snapfn.handler.activator.plan import ActivatorPlan
from snapfn.handler.activator.pool import Unavailable
from snapfn.handler.http.serve_config import ServeConfig


class OneInstancePool:
    """Every request goes to one instance at `url` (or is refused with `refusal`)."""

    def __init__(self, url: str) -> None:
        self.instance = SimpleNamespace(id=7, url=url, outstanding=0)
        self.closing, self.refusal = False, None

    async def acquire(self):
        if self.refusal is not None:
            raise self.refusal
        self.instance.outstanding += 1
        return self.instance

    def release(self, instance) -> None:
        instance.outstanding -= 1

    def count_by_state(self) -> dict:
        return {"up": 1}

    def describe(self) -> dict:
        return {"instances": [], "cold_starts": 0}

    def last_startup_manifest(self) -> None:
        return None


class FakeInstance:
    """The instance's side: handlers steered through events."""

    def __init__(self) -> None:
        self.next_event = asyncio.Event()
        self.client_went = asyncio.Event()
        self.app = web.Application()
        self.app.router.add_get("/sse", self.sse)
        self.app.router.add_post("/echo", self.echo)
        self.app.router.add_get("/cut", self.cut)
        self.app.router.add_get("/sse-cut", self.sse_cut)
        self.app.router.add_get("/endless", self.endless)

    async def sse(self, request: web.Request) -> web.StreamResponse:
        r = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await r.prepare(request)
        await r.write(b"data: 1\n\n")
        await self.next_event.wait()  # the test reads event 1 through the proxy first
        await r.write(b"data: 2\n\n")
        return r

    async def echo(self, request: web.Request) -> web.Response:
        body = {"headers": dict(request.headers), "body": (await request.read()).decode()}
        return web.json_response(body, headers={"Set-Cookie": "k=v", "Keep-Alive": "x"})

    async def cut(self, request: web.Request) -> web.StreamResponse:
        r = web.StreamResponse(headers={"Content-Length": "100"})
        await r.prepare(request)
        await r.write(b"x" * 10)
        request.transport.close()
        return r

    async def sse_cut(self, request: web.Request) -> web.StreamResponse:
        r = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await r.prepare(request)
        await r.write(b"data: 1\n\n")
        request.transport.close()
        return r

    async def endless(self, request: web.Request) -> web.StreamResponse:
        r = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await r.prepare(request)
        try:
            while True:
                await r.write(b"data: more\n\n")
                await asyncio.sleep(0.01)
        except (ConnectionError, asyncio.CancelledError):  # a write fails, or aiohttp cancels
            self.client_went.set()
            raise


def scenario(test, api_key: str | None = None) -> None:
    async def run():
        fake = FakeInstance()
        async with TestServer(fake.app) as upstream, _instance_session() as session:
            pool = OneInstancePool(str(upstream.make_url("")).rstrip("/"))
            config = ServeConfig(idle_timeout_s=1.0, api_key=api_key, max_body_bytes=1000)
            plan = ActivatorPlan((), 1, (), (), api_key)
            app = create_activator_app(pool, plan, config, ActivatorMetrics(), session)
            async with TestClient(TestServer(app)) as client:
                await test(client, fake, pool)

    asyncio.run(asyncio.wait_for(run(), 20))


def test_an_event_stream_is_relayed_event_by_event():
    async def test(client, fake, pool):
        r = await client.get("/sse")
        assert r.status == 200 and r.headers["X-Snapfn-Instance"] == "7"
        assert await r.content.readuntil(b"\n\n") == b"data: 1\n\n"  # before event 2 exists
        fake.next_event.set()
        assert await r.content.read() == b"data: 2\n\n"
        assert pool.instance.outstanding == 0

    scenario(test)


def test_body_query_and_end_to_end_headers_go_through_hop_by_hop_ones_do_not():
    async def test(client, fake, pool):
        r = await client.post("/echo?q=1", data=b'{"a": 1}', headers={"X-Trace": "t"})
        seen = await r.json()
        assert seen["body"] == '{"a": 1}' and seen["headers"]["X-Trace"] == "t"
        assert "X-Forwarded-For" in seen["headers"]
        assert r.headers["Set-Cookie"] == "k=v" and "Keep-Alive" not in r.headers
        client.session.cookie_jar.clear()  # the test's client keeps cookies: drop them
        again = await (await client.post("/echo", data=b"{}")).json()
        assert "Cookie" not in again["headers"]  # nothing kept between clients

    scenario(test)


def test_an_instance_that_is_gone_is_a_502_and_a_cut_body_stays_cut():
    async def test(client, fake, pool):
        r = await client.get("/cut")
        try:
            await r.read()
            complete = True
        except Exception:
            complete = False
        assert not complete  # a cut body never looks whole
        r = await client.get("/sse-cut")
        events = (await r.read()).decode().split("\n\n")
        assert events[0] == "data: 1"
        assert json.loads(events[1][6:])["error"]["code"] == "instance_failed"
        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            pool.instance.url = f"http://127.0.0.1:{s.getsockname()[1]}"
        r = await client.get("/anything")
        assert r.status == 502 and (await r.json())["error"]["code"] == "instance_failed"

    scenario(test)


def test_a_client_that_goes_away_closes_the_instance_connection():
    async def test(client, fake, pool):
        r = await client.get("/endless")
        await r.content.readuntil(b"\n\n")
        r.close()
        await asyncio.wait_for(fake.client_went.wait(), 10)

    scenario(test)


def test_refusals_auth_health_and_large_bodies_are_json():
    async def test(client, fake, pool):
        assert (await client.get("/health")).status == 200  # open without the key
        r = await client.get("/startup")
        assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
        auth = {"Authorization": "Bearer k"}
        assert (await client.get("/startup", headers=auth)).status == 200
        pool.refusal = Unavailable("no instance came up", "timeout", 504, 5)
        r = await client.post("/echo", data=b"{}", headers=auth)
        assert r.status == 504 and r.headers["Retry-After"] == "5"
        assert (await r.json())["error"]["code"] == "timeout"
        r = await client.post("/echo", data=b"x" * 2000, headers=auth)
        assert r.status == 413 and "error" in await r.json()

    scenario(test, api_key="k")
