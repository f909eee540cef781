"""`activator/pool.py` with fake instances: routing, the hold queue, scaling, idling, failures.

Each test runs one asyncio scenario; a `FakeInstance` comes up when the test says so (or fails
to), and exits when stopped or "crashed", so every decision of the pool is staged exactly.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from snapfn.handler.activator.instance import InstanceFailed, InstanceState
from snapfn.handler.activator.metrics import ActivatorMetrics
from snapfn.handler.activator.plan import ActivatorPlan
from snapfn.handler.activator.pool import MAX_START_FAILURES, InstancePool, Unavailable
from snapfn.handler.http.serve_config import ServeConfig

MANIFEST = {"kind": "restore", "tier": "portable", "total_s": 0.25, "ok": True, "stages": []}


class FakeInstance:
    """Comes up when `up()` is called, fails when `fail()` is, exits on `stop()` or `crash()`."""

    def __init__(self, instance_id: int, gpu: str | None) -> None:
        self.id, self.gpu = instance_id, gpu
        self.state, self.stop_reason = InstanceState.STARTING, None
        self.outstanding, self.last_active_s = 0, time.monotonic()
        self.startup, self.cold_start_s, self.pid = None, None, None
        self.spawned_s, self.answered, self.launch = time.monotonic(), False, "exec"
        self._started, self._exited = asyncio.Event(), asyncio.Event()
        self._failure: str | None = None

    @property
    def routable(self) -> bool:
        return self.state is InstanceState.UP and not self._exited.is_set()

    def up(self) -> None:
        self._started.set()

    def fail(self, reason: str = "boom") -> None:
        self._failure = reason
        self._started.set()

    def crash(self) -> None:
        self._exited.set()

    async def start(self, timeout_s: float) -> None:
        await self._started.wait()
        if self._failure is not None:
            raise InstanceFailed(self._failure)
        self.state, self.startup, self.cold_start_s = InstanceState.UP, MANIFEST, 0.5
        self.last_active_s = time.monotonic()

    def stop(self, reason: str, drain: bool) -> None:
        self.state, self.stop_reason = InstanceState.STOPPING, reason
        self._started.set()
        self._exited.set()

    async def run_until_exit(self) -> int:
        await self._exited.wait()
        self.state = InstanceState.EXITED
        return 0

    async def kill(self) -> None:
        self.state = InstanceState.EXITED

    def describe(self) -> dict:
        return {"id": self.id, "state": self.state.value, "outstanding": self.outstanding}


class Harness:
    def __init__(self, gpus=(), max_instances=2, **config) -> None:
        config = {"idle_timeout_s": 60.0, "retry_after_s": 3, **config}
        self.config = ServeConfig(**config)
        plan = ActivatorPlan(tuple(gpus), max_instances, (), (), None)
        self.metrics = ActivatorMetrics()
        self.launched: list[FakeInstance] = []
        self.pool = InstancePool(plan, self.config, self.metrics, self.launch)
        self.metrics.watch(self.pool)

    def launch(self, instance_id: int, gpu: str | None) -> FakeInstance:
        self.launched.append(FakeInstance(instance_id, gpu))
        return self.launched[-1]

    def sample(self, name: str, **labels) -> float:
        return self.metrics.registry.get_sample_value(name, labels or None) or 0.0


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def scenario(coroutine) -> None:
    asyncio.run(asyncio.wait_for(coroutine, 10))


def test_a_request_at_zero_is_held_until_the_instance_is_up():
    async def run():
        h = Harness()
        request = asyncio.create_task(h.pool.acquire())
        await settle()
        assert len(h.launched) == 1 and not request.done()
        h.launched[0].up()
        assert await request is h.launched[0] and h.launched[0].outstanding == 1
        assert h.sample("snapfn_activator_hold_seconds_count") == 1
        assert h.sample("snapfn_activator_restore_seconds_count", kind="restore", tier="portable")
        assert h.pool.describe()["last_cold_start"]["tier"] == "portable"

    scenario(run())


def test_a_full_hold_queue_is_a_503_and_a_wait_that_runs_out_a_504():
    async def run():
        h = Harness(startup_queue_size=1, startup_wait_s=0.05)
        held = asyncio.create_task(h.pool.acquire())
        await settle()
        with pytest.raises(Unavailable) as full:
            await h.pool.acquire()
        assert (full.value.status, full.value.reason, full.value.retry_after_s) == (
            503,
            "queue_full",
            3,
        )
        with pytest.raises(Unavailable) as late:
            await held
        assert (late.value.status, late.value.reason) == (504, "timeout")
        assert "within 0.05 s" in str(late.value) and "retry in 3 s" in str(late.value)

    scenario(run())


def test_least_outstanding_routing_scales_up_to_the_cap_one_gpu_each():
    async def run():
        h = Harness(gpus=("0", "1"), target_concurrency=2)
        first = asyncio.create_task(h.pool.acquire())
        await settle()
        h.launched[0].up()
        a = await first
        await h.pool.acquire()  # demand 2: one instance is enough
        assert len(h.launched) == 1
        await h.pool.acquire()  # demand 3: a second one starts
        assert [i.gpu for i in h.launched] == ["0", "1"]
        for _ in range(5):
            await h.pool.acquire()  # demand 8, still 2 instances: the cap
        assert len(h.launched) == 2 and a.outstanding == 8
        h.launched[1].up()
        await settle()
        b = await h.pool.acquire()
        assert b is h.launched[1]  # the fewest outstanding
        h.pool.release(b)
        assert (await h.pool.acquire()) is b
        h.pool.release(b)  # its second answer: the first-answer time is observed once
        assert h.sample("snapfn_activator_first_answer_seconds_count", launch="exec") == 1

    scenario(run())


def test_idle_instances_stop_down_to_zero_and_the_next_request_starts_one_again():
    async def run():
        h = Harness()
        task = asyncio.create_task(h.pool.acquire())
        await settle()
        h.launched[0].up()
        h.pool.release(await task)
        h.pool.stop_idle(idle_s=0.0)
        await settle()
        assert h.pool.count_by_state() == {}
        assert h.sample("snapfn_activator_instance_exits_total", reason="idle") == 1
        again = asyncio.create_task(h.pool.acquire())
        await settle()
        h.launched[1].up()
        assert (await again).id == 2 and h.pool.cold_starts == 2

    scenario(run())


def test_a_crashed_instance_with_requests_in_flight_is_replaced_at_once():
    async def run():
        h = Harness()
        task = asyncio.create_task(h.pool.acquire())
        await settle()
        h.launched[0].up()
        await task
        late = asyncio.create_task(h.pool.acquire())  # runs before the pool hears of …
        h.launched[0].crash()  # … this crash: the dead instance must not be picked
        await settle()
        assert len(h.launched) == 2 and h.pool.count_by_state() == {"starting": 1}
        assert h.sample("snapfn_activator_instance_exits_total", reason="crash") == 1
        h.launched[1].up()
        assert (await late).id == 2  # held for the replacement, never sent to the dead one

    scenario(run())


def test_failed_starts_are_retried_for_held_requests_then_refused():
    async def run():
        h = Harness(max_instances=1)
        held = asyncio.create_task(h.pool.acquire())
        await settle()
        h.launched[0].fail("exited (code 1) while starting")
        await settle()
        h.launched[1].up()  # the replacement serves the held request
        assert (await held).id == 2
        h.launched[1].crash()
        await settle()
        held = asyncio.create_task(h.pool.acquire())
        for n in range(MAX_START_FAILURES):
            await settle()
            h.launched[-1].fail(f"failure {n}")
        with pytest.raises(Unavailable) as refused:
            await held
        assert refused.value.reason == "start_failed" and "failure 2" in str(refused.value)
        assert len(h.launched) == 2 + MAX_START_FAILURES  # no fourth try during the back-off

    scenario(run())


def test_close_refuses_held_requests_and_stops_every_instance():
    async def run():
        h = Harness()
        held = asyncio.create_task(h.pool.acquire())
        await settle()
        await h.pool.close()
        with pytest.raises(Unavailable) as refused:
            await held
        assert refused.value.reason == "shutting_down" and h.pool.count_by_state() == {}
        with pytest.raises(Unavailable):
            await h.pool.acquire()

    scenario(run())
