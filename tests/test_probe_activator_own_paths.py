"""The activator's own paths (/health, /startup, /metrics) with another method than GET: a 405
answered by the activator, never relayed. Relayed, `POST /health` (open without the API key,
as `/health` is) started an instance for a request that can only fail."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp.test_utils import TestClient, TestServer
from test_activator_pool import Harness

from snapfn.handler.activator.app import _instance_session, create_activator_app
from snapfn.handler.activator.plan import ActivatorPlan


@pytest.mark.parametrize(
    "method, path", [("POST", "/health"), ("PUT", "/startup"), ("DELETE", "/metrics")]
)
def test_another_method_on_an_own_path_is_a_405_and_starts_nothing(method, path):
    async def run():
        h = Harness(api_key="sekret")
        plan = ActivatorPlan((), 1, (), (), "sekret")
        async with _instance_session() as session:
            app = create_activator_app(h.pool, plan, h.config, h.metrics, session)
            async with TestClient(TestServer(app)) as client:
                auth = {"Authorization": "Bearer sekret"} if path != "/health" else {}
                r = await client.request(method, path, headers=auth)
                assert r.status == 405
                assert (await r.json())["error"]["code"] == "method_not_allowed"
                assert h.launched == [] and h.pool.describe()["held_requests"] == 0

    asyncio.run(asyncio.wait_for(run(), 10))
