"""Request headers a client repeats reach the instance as sent, every value in order (the
relay kept only the last of each name), and `X-Forwarded-For` extends every hop given."""

from __future__ import annotations

import test_activator_proxy
from aiohttp import web
from test_activator_proxy import scenario


async def seen_headers(request: web.Request) -> web.Response:
    return web.json_response(
        {name: request.headers.getall(name, []) for name in ("X-Tag", "X-Forwarded-For")}
    )


def test_repeated_request_headers_are_all_relayed(monkeypatch):
    make_fake = test_activator_proxy.FakeInstance.__init__

    def with_seen_route(fake) -> None:
        make_fake(fake)
        fake.app.router.add_get("/seen", seen_headers)

    monkeypatch.setattr(test_activator_proxy.FakeInstance, "__init__", with_seen_route)

    async def test(client, fake, pool):
        headers = [("X-Tag", "a"), ("X-Tag", "b")]
        headers += [("X-Forwarded-For", "10.0.0.1"), ("X-Forwarded-For", "10.0.0.2")]
        seen = await (await client.get("/seen", headers=headers)).json()
        assert seen["X-Tag"] == ["a", "b"]
        [forwarded] = seen["X-Forwarded-For"]
        assert forwarded.startswith("10.0.0.1, 10.0.0.2, ")

    scenario(test)
