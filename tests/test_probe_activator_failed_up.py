"""An instance that fails after it came up: its runtime turned FAILED (a tier-1 function whose
restored worker died answers every request 503 `failed` from then on, and gunicorn keeps its
worker). The activator's periodic check reads each UP instance's /health, stops one that
reports `failed` as crashed, and the next request gets a replacement instead of the 503."""

from __future__ import annotations

import asyncio
import functools
import os
import subprocess
import sys

import pytest
import requests
from aiohttp import web
from aiohttp.test_utils import TestServer
from test_activator_pool import FakeInstance, Harness, scenario, settle

from snapfn.handler.activator.app import _instance_session
from snapfn.handler.activator.instance import Instance, InstanceState

from activator_client import Activator


class FailingInstance(FakeInstance):
    """Up, then its /health says `failed` once `break_down()` is called."""

    reason: str | None = None

    def break_down(self) -> None:
        self.reason = "worker process exited: worker pid 7 exited"

    async def failure(self) -> str | None:
        return self.reason


def test_an_up_instance_whose_health_turned_failed_is_stopped_and_replaced():
    async def run():
        h = Harness(max_instances=1)
        h.launch = lambda i, gpu: h.launched.append(FailingInstance(i, gpu)) or h.launched[-1]
        h.pool._launch = h.launch
        first = asyncio.create_task(h.pool.acquire())
        await settle()
        h.launched[0].up()
        h.pool.release(await first)
        h.pool.check_up()
        await settle()
        assert h.launched[0].state is InstanceState.UP  # healthy: left alone
        h.launched[0].break_down()
        h.pool.check_up()
        await settle()
        assert h.launched[0].stop_reason == "crash" and h.pool.count_by_state() == {}
        assert h.sample("snapfn_activator_instance_exits_total", reason="crash") == 1
        again = asyncio.create_task(h.pool.acquire())
        await settle()
        h.launched[1].up()
        assert (await again) is h.launched[1]

    scenario(run())


def test_instance_failure_reads_a_failed_health_and_nothing_else():
    answers = {
        "/ok/health": (200, {"status": "up", "reason": None}),
        "/failed/health": (503, {"status": "failed", "reason": "worker process exited"}),
        "/busy/health": (503, {"status": "starting"}),
        "/junk/health": (503, ["not", "an", "object"]),
    }

    async def health(request: web.Request) -> web.Response:
        status, body = answers[request.path]
        return web.json_response(body, status=status)

    async def run():
        app = web.Application()
        app.router.add_get("/{name}/health", health)
        async with TestServer(app) as server, _instance_session() as session:
            base = str(server.make_url("")).rstrip("/")
            argv = [sys.executable, "-c", "pass"]
            instance = Instance(1, None, argv, dict(os.environ), session, grace_s=1.0)
            found = {}
            for name in ("ok", "failed", "busy", "junk", "gone"):
                instance.url = f"{base}/{name}" if name != "gone" else "http://127.0.0.1:9"
                found[name] = await instance.failure()
            assert found == {
                "ok": None,
                "failed": "worker process exited",
                "busy": None,
                "junk": None,
                "gone": None,
            }

    asyncio.run(asyncio.wait_for(run(), 20))


EXITING = """
import os


def handler(event, context):
    if event.get("exit"):
        os._exit(5)
    return {"ok": True}
"""


@pytest.mark.slow
def test_a_tier1_instance_whose_restored_worker_died_is_replaced(criu_config, tmp_path):
    (tmp_path / "exiting_fn.py").write_text(EXITING)
    function = ["--function", "exiting_fn:handler", "--function-dir", str(tmp_path)]
    snapshot = ["--snapshot", str(tmp_path / "snap")]
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    init = [sys.executable, "-m", "snapfn.handler.cli", "init", *function, *snapshot]
    done = subprocess.run(init, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    a = Activator([*function, *snapshot, "--idle-timeout", "30"], tmp_path)
    try:
        invoke = functools.partial(requests.post, f"{a.url}/invoke", timeout=60)
        assert invoke(json={}).status_code == 200
        assert a.startup()["last_cold_start"]["tier"] == "process"
        assert invoke(json={"exit": True}).status_code == 500  # its worker is gone
        a.wait_for_instances(0)  # stopped as crashed; the next request starts another
        r = invoke(json={})
        assert (r.status_code, r.headers["X-Snapfn-Instance"]) == (200, "2"), r.text
        assert a.metrics()[("snapfn_activator_instance_exits_total", (("reason", "crash"),))] == 1
    finally:
        a.stop()
