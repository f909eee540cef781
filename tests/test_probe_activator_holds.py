"""Held requests whose clients went away, against the activator's app on a real socket.

The pool is `test_activator_pool`'s, with fake instances that never come up, so requests stay
held; the app is served through `activator_runner`, as `snapfn serve --idle-timeout` does."""

from __future__ import annotations

import asyncio

from aiohttp import web
from test_activator_pool import Harness, scenario, settle

from snapfn.handler.activator.app import _instance_session, activator_runner, create_activator_app
from snapfn.handler.activator.plan import ActivatorPlan

REQUEST = b"POST /invoke HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"


async def held_then_gone(port: int) -> None:
    """A client whose request is held, then closes its connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(REQUEST)
    await writer.drain()
    await asyncio.sleep(0.2)
    writer.close()
    await writer.wait_closed()


def test_a_client_that_goes_away_while_held_leaves_the_hold_queue():
    async def run():
        h = Harness(max_instances=1, startup_queue_size=2, startup_wait_s=30)
        plan = ActivatorPlan((), 1, (), (), None)
        async with _instance_session() as session:
            app = create_activator_app(h.pool, plan, h.config, h.metrics, session)
            runner = activator_runner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = runner.addresses[0][1]
            try:
                await asyncio.gather(held_then_gone(port), held_then_gone(port))
                for _ in range(100):
                    if h.pool.describe()["held_requests"] == 0:
                        break
                    await asyncio.sleep(0.02)
                assert h.pool.describe()["held_requests"] == 0
                assert h.sample("snapfn_activator_held_requests") == 0
                waiting = asyncio.create_task(h.pool.acquire())  # a place in the queue again
                await settle()
                assert not waiting.done()
                h.launched[0].up()
                assert (await waiting) is h.launched[0]
                assert h.launched[0].outstanding == 1  # the gone clients were never routed
            finally:
                await runner.cleanup()

    scenario(run())
