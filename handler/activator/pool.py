"""The instances behind the activator: routing, the hold queue, scaling up, idling out to zero.

Contract (`InstancePool`, on one asyncio event loop: no locks, and no `await` between a
routing decision and the count it changes):
- `acquire()` returns the UP instance with the fewest outstanding requests (ties: the oldest,
  so spare instances stay idle and time out), counting the request against it. With none UP,
  the request is held: at most `startup_queue_size` at once, each at most `startup_wait_s`.
  A request beyond the queue gets `Unavailable` 503 `queue_full`, one whose wait ran out 504
  `timeout`; both carry `retry_after_s`. `release(instance)` ends the request.
- Scaling up: demand = requests outstanding + requests held; the pool keeps
  ceil(demand / target_concurrency) instances starting or up, at most `max_instances` alive
  (stopping ones included: they still hold memory), each on a free GPU when there are GPUs.
- Scaling down: an UP instance with nothing outstanding for `idle_timeout_s` is stopped.
- An UP instance whose `/health` reports it failed since (checked on every idle check: e.g. a
  restored function worker died, and it would answer 503 `failed` from then on) is stopped as
  a crash; demand starts a replacement.
- An instance that exits while UP crashed: its group is killed (its in-flight requests fail
  at the proxy, 502) and demand starts a replacement. One that fails to start is replaced
  while requests wait for it; after `MAX_START_FAILURES` failures in a row the held requests
  get 503 `start_failed` naming the last reason, and no start is tried for `retry_after_s`.
- `close()` refuses held requests (503 `shutting_down`), stops every instance, waits for all.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from typing import Any

from snapfn.handler.activator.instance import Instance, InstanceFailed, InstanceState
from snapfn.handler.activator.metrics import ActivatorMetrics
from snapfn.handler.activator.plan import ActivatorPlan
from snapfn.handler.http.serve_config import ServeConfig
from snapfn.snapshot.errors import SnapfnError

log = logging.getLogger("snapfn.activator")
MAX_START_FAILURES = 3
Launch = Callable[[int, "str | None"], Instance]  # (instance id, GPU or None) → not started


class Unavailable(SnapfnError):
    """No instance can take this request now: 503 (or 504 for a wait that ran out)."""

    code = "unavailable"

    def __init__(self, message: str, reason: str, status: int, retry_after_s: int | None):
        super().__init__(message)
        self.reason, self.status, self.retry_after_s = reason, status, retry_after_s


class Hold:
    """One request waiting for an instance to come up."""

    def __init__(self) -> None:
        self.woken = asyncio.Event()
        self.failure: tuple[str, str, int | None] | None = None  # (reason, message, retry)


class InstancePool:
    """Routes requests to instances, holds them while none is up, starts and stops instances."""

    def __init__(
        self, plan: ActivatorPlan, config: ServeConfig, metrics: ActivatorMetrics, launch: Launch
    ) -> None:
        assert config.idle_timeout_s is not None, "the activator runs with an idle timeout"
        self._plan, self._config, self._metrics, self._launch = plan, config, metrics, launch
        self._instances: dict[int, Instance] = {}  # not exited yet: starting, up, stopping
        self._holds: list[Hold] = []
        self._tasks: set[asyncio.Task] = set()
        self._next_id = 1
        self._start_failures = 0
        self._no_start_until_s = 0.0
        self._closing = False
        self._ticker: asyncio.Task | None = None
        self._checking: set[int] = set()  # instances whose /health is being asked
        self._last_manifest: dict[str, Any] | None = None
        self.cold_starts = 0
        self.last_cold_start: dict[str, Any] | None = None
        self.last_start_failure: str | None = None

    @property
    def closing(self) -> bool:
        return self._closing

    def start(self) -> None:
        """Begin the periodic idle check (call on the running loop)."""
        self._ticker = asyncio.create_task(self._tick_forever())

    # ---- requests ------------------------------------------------------------------------
    async def acquire(self) -> Instance:
        """The instance to send this request to (waiting for one to come up if need be)."""
        if self._closing:
            raise self._refuse("the activator is shutting down", "shutting_down", 503, None)
        instance = self._pick()
        if instance is None:
            instance = await self._hold()
        instance.outstanding += 1
        self._scale_up()
        return instance

    def release(self, instance: Instance) -> None:
        instance.outstanding -= 1
        instance.last_active_s = time.monotonic()
        if not instance.answered and instance.spawned_s is not None:
            instance.answered = True
            took = instance.last_active_s - instance.spawned_s
            self._metrics.first_answer_seconds.labels(instance.launch).observe(took)

    def _pick(self) -> Instance | None:
        up = [i for i in self._instances.values() if i.routable]
        return min(up, key=lambda i: (i.outstanding, i.id), default=None)

    async def _hold(self) -> Instance:
        c = self._config
        if len(self._holds) >= c.startup_queue_size:
            message = f"no instance is up and {len(self._holds)} requests already wait for one"
            raise self._refuse(message, "queue_full", 503, c.retry_after_s)
        hold = Hold()
        self._holds.append(hold)
        self._metrics.held.inc()
        self._scale_up()
        waited_from = time.monotonic()
        try:
            async with asyncio.timeout(c.startup_wait_s):
                while (instance := self._pick()) is None:
                    if hold.failure is not None:
                        reason, message, retry = hold.failure
                        raise self._refuse(message, reason, 503, retry)
                    hold.woken.clear()
                    await hold.woken.wait()
            return instance
        except TimeoutError:
            message = f"no instance came up within {c.startup_wait_s:g} s"
            raise self._refuse(message, "timeout", 504, c.retry_after_s) from None
        finally:
            self._holds.remove(hold)
            self._metrics.held.dec()
            self._metrics.hold_seconds.observe(time.monotonic() - waited_from)

    def _refuse(self, message: str, reason: str, status: int, retry: int | None) -> Unavailable:
        self._metrics.rejections.labels(reason).inc()
        suffix = f"; retry in {retry} s" if retry else ""
        return Unavailable(message + suffix, reason, status, retry)

    # ---- scaling -------------------------------------------------------------------------
    def _scale_up(self, extra_demand: int = 0) -> None:
        if self._closing or time.monotonic() < self._no_start_until_s:
            return
        demand = extra_demand + sum(i.outstanding for i in self._instances.values())
        demand += sum(1 for h in self._holds if h.failure is None)
        wanted = min(self._plan.max_instances, math.ceil(demand / self._config.target_concurrency))
        live = [i for i in self._instances.values() if i.state is not InstanceState.STOPPING]
        for _ in range(wanted - len(live)):
            if len(self._instances) >= self._plan.max_instances:
                return
            self._start_instance()

    def _start_instance(self) -> None:
        taken = {i.gpu for i in self._instances.values()}
        free = [g for g in self._plan.gpu_ids if g not in taken]
        assert free or not self._plan.gpu_ids, "max_instances <= number of GPUs"
        instance = self._launch(self._next_id, free[0] if free else None)
        self._next_id += 1
        self._instances[instance.id] = instance
        self.cold_starts += 1
        self._metrics.cold_starts.inc()
        self._spawn(self._run(instance))

    async def _run(self, instance: Instance) -> None:
        """One instance's whole life: start, serve until it exits, leave."""
        try:
            await instance.start(self._config.instance_start_timeout_s)
        except Exception as exc:
            if not isinstance(exc, InstanceFailed):
                log.exception("instance %d: unexpected error while starting", instance.id)
            await instance.kill()
            if instance.stop_reason is None:  # (a stop while starting is no failure)
                self._start_failed(str(exc).splitlines()[0] if str(exc) else repr(exc))
            return self._leave(instance, instance.stop_reason or "failed_start")
        self._came_up(instance)
        code = await instance.run_until_exit()
        if instance.stop_reason is not None:
            return self._leave(instance, instance.stop_reason)
        log.warning("instance %d crashed (exit code %s), %d requests in flight",
                    instance.id, code, instance.outstanding)  # fmt: skip
        # its in-flight requests fail (502); their clients are likely to come back
        self._leave(instance, "crash", extra_demand=instance.outstanding)

    def _came_up(self, instance: Instance) -> None:
        self._start_failures = 0
        startup = instance.startup or {}
        kind, tier = str(startup.get("kind")), str(startup.get("tier"))
        self._metrics.cold_start_seconds.observe(instance.cold_start_s or 0.0)
        self._metrics.restore_seconds.labels(kind, tier).observe(float(startup.get("total_s", 0)))
        self._last_manifest = startup if {"kind", "tier", "total_s"} <= startup.keys() else None
        self.last_cold_start = {
            "instance": instance.id,
            "cold_start_s": instance.cold_start_s,
            "kind": kind,
            "tier": tier,
            "total_s": startup.get("total_s"),
            "ok": startup.get("ok"),
            "stages": [
                {"name": s.get("name"), "seconds": s.get("seconds")}
                for s in startup.get("stages", [])
            ],
            "fallbacks": startup.get("fallbacks", []),
        }
        log.info(
            "instance %d: up in %.2f s (%s, tier %s, %.2f s)",
            instance.id, instance.cold_start_s or 0.0, kind, tier, startup.get("total_s", 0.0),
        )  # fmt: skip
        for hold in self._holds:
            hold.woken.set()

    def _start_failed(self, reason: str) -> None:
        log.warning("%s", reason)
        self.last_start_failure = reason
        self._start_failures += 1
        if self._start_failures < MAX_START_FAILURES:
            return  # `_leave` starts a replacement while requests wait
        self._start_failures = 0
        self._no_start_until_s = time.monotonic() + self._config.retry_after_s
        message = f"{MAX_START_FAILURES} instance starts failed in a row, the last: {reason}"
        self._fail_holds("start_failed", message, self._config.retry_after_s)

    def _fail_holds(self, reason: str, message: str, retry_after_s: int | None) -> None:
        for hold in self._holds:
            hold.failure = (reason, message, retry_after_s)
            hold.woken.set()

    def _leave(self, instance: Instance, reason: str, extra_demand: int = 0) -> None:
        self._instances.pop(instance.id, None)
        self._metrics.exits.labels(reason).inc()
        self._scale_up(extra_demand)

    # ---- idling out ----------------------------------------------------------------------
    async def _tick_forever(self) -> None:
        idle_s = self._config.idle_timeout_s
        while True:
            await asyncio.sleep(min(1.0, max(0.05, idle_s / 4)))
            try:
                self.stop_idle(idle_s)
                self.check_up()
                self._scale_up()  # a start deferred after repeated failures
            except Exception:  # the ticker must outlive any one bad tick
                log.exception("the activator's idle check failed; checking again")

    def stop_idle(self, idle_s: float) -> None:
        now = time.monotonic()
        for instance in list(self._instances.values()):
            idle = instance.outstanding == 0 and now - instance.last_active_s >= idle_s
            if instance.state is InstanceState.UP and idle:
                instance.stop("idle", drain=False)

    def check_up(self) -> None:
        """Ask every UP instance's /health (one question at a time each) whether it failed."""
        for instance in list(self._instances.values()):
            if instance.state is InstanceState.UP and instance.id not in self._checking:
                self._checking.add(instance.id)
                self._spawn(self._stop_if_failed(instance))

    async def _stop_if_failed(self, instance: Instance) -> None:
        try:
            reason = await instance.failure()
        finally:
            self._checking.discard(instance.id)
        if reason is not None and instance.state is InstanceState.UP:
            log.warning("instance %d failed after it came up: %s", instance.id, reason)
            instance.stop("crash", drain=False)

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("an instance's task failed", exc_info=task.exception())

    async def close(self) -> None:
        """Refuse held requests, stop every instance, wait until all are gone."""
        self._closing = True
        if self._ticker is not None:
            self._ticker.cancel()
        self._fail_holds("shutting_down", "the activator is shutting down", None)
        for instance in list(self._instances.values()):
            instance.stop("shutdown", drain=True)
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    # ---- what /startup and /metrics show -------------------------------------------------
    def count_by_state(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for instance in self._instances.values():
            counts[instance.state.value] = counts.get(instance.state.value, 0) + 1
        return counts

    def last_startup_manifest(self) -> dict[str, Any] | None:
        return self._last_manifest

    def describe(self) -> dict[str, Any]:
        return {
            "cold_starts": self.cold_starts,
            "held_requests": len(self._holds),
            "instances": [
                i.describe() for i in sorted(self._instances.values(), key=lambda i: i.id)
            ],
            "last_cold_start": self.last_cold_start,
            "last_start_failure": self.last_start_failure,
        }
