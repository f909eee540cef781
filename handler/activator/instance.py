"""One instance behind the activator: `snapfn serve` on a loopback port, a fork of the instances'
zygote (instance_zygote.py) or, without one, a fresh subprocess.

Contract (`Instance`, driven by `pool.InstancePool` on the event loop's thread):
- `start(timeout_s)` spawns the instance as the leader of a new session (its pid = its process
  group: the gunicorn master and its workers), reads the URL it prints, polls `/health` until
  200, then reads `/startup` (the instance's startup manifest: kind, tier, stage timings).
  It raises `InstanceFailed` with a one-line reason when the instance exits, reports a failed
  start (`/health` 503 "failed"), is stopped, or is not up within `timeout_s`.
- `stop(reason, drain)` signals the master at once (the state is STOPPING from then on: no
  request is routed here): SIGTERM to let in-flight requests finish (`drain`), else SIGQUIT,
  gunicorn's quick shutdown (an idle instance has nothing to finish); SIGKILL to the whole
  group after `grace_s` either way.
- `run_until_exit()` returns the master's exit code once the master is gone and no process of
  the group runs (`process_group.clear_group`): its memory is released.
- `kill()`: SIGKILL the group now and clear it (a failed start, a crash's leftovers).
- `failure()`: why an UP instance's `/health` says it failed since, else None.
- `routable`: UP and the master still running. `outstanding` (requests routed here, not
  finished) and `last_active_s` are the pool's.
The instance's stderr is the activator's; its stdout lines are logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import aiohttp

from snapfn.handler.activator.process_group import clear_group, signal_group
from snapfn.snapshot.errors import SnapfnError

log = logging.getLogger("snapfn.activator")
HEALTH_POLL_S = 0.02
EXIT_POLL_S = 0.02
HEALTH_CHECK_TIMEOUT_S = 2.0
LISTENING = "listening on "
OVERLONG_LINE = "(a line too long to log, dropped)\n"


class InstanceState(enum.Enum):
    STARTING = "starting"
    UP = "up"
    STOPPING = "stopping"
    EXITED = "exited"


class InstanceFailed(SnapfnError):
    """An instance did not come up (exited, failed its start, timed out, was stopped)."""

    code = "instance_failed"


class Instance:
    """A `snapfn serve` subprocess in its own process group, as the activator sees it."""

    def __init__(
        self,
        instance_id: int,
        gpu: str | None,
        argv: Sequence[str],
        env: dict[str, str],
        session: aiohttp.ClientSession,
        grace_s: float,
        api_key: str | None = None,
        spawn: Callable[[], Awaitable[Any]] | None = None,
    ) -> None:
        """`spawn`: makes the instance's process (instance_zygote.fork_instance: a fork of the
        zygote); None: `argv` as a fresh subprocess."""
        self.id = instance_id
        self.gpu = gpu
        self.state = InstanceState.STARTING
        self.stop_reason: str | None = None
        self.url: str | None = None
        self.pid: int | None = None
        self.outstanding = 0
        self.last_active_s = time.monotonic()
        self.startup: dict[str, Any] | None = None
        self.cold_start_s: float | None = None
        self.started_at: float | None = None  # wall clock of the spawn (overlaps: parallel)
        self.spawned_s: float | None = None  # monotonic, for the time to the first answer
        self.answered = False  # the pool observes the first answer's time once
        self.launch = "zygote" if spawn is not None else "exec"
        self._spawn = spawn
        self._argv, self._env, self._session, self._grace_s = list(argv), env, session, grace_s
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._proc: asyncio.subprocess.Process | None = None
        self._kill_timer: asyncio.TimerHandle | None = None
        self._stdout_task: asyncio.Task | None = None

    @property
    def routable(self) -> bool:
        """UP, and its master still runs: a crash shows here before the pool hears of it (the
        pool learns once the crashed group is cleared, and its orphaned workers still listen)."""
        return (
            self.state is InstanceState.UP
            and self._proc is not None
            and self._proc.returncode is None
        )

    # ---- start ---------------------------------------------------------------------------
    async def start(self, timeout_s: float) -> None:
        """Spawn the instance and return once it serves; `InstanceFailed` otherwise."""
        started = self.spawned_s = time.monotonic()
        self.started_at = time.time()
        if self._spawn is not None:  # a fork of the zygote: its own session too
            self._proc = await self._spawn()
        else:
            self._proc = await asyncio.create_subprocess_exec(
                *self._argv,
                env=self._env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                start_new_session=True,  # NOTE: pid = pgid: the whole instance stops as one group
            )
        self.pid = self._proc.pid
        log.info("instance %d: started, pid %d, gpu %s", self.id, self.pid, self.gpu or "-")
        if self.state is InstanceState.STOPPING:  # stopped while it was being spawned
            raise self._exited("as it started")
        try:
            async with asyncio.timeout(timeout_s):
                self.url = await self._read_url()
                await self._wait_until_healthy()
                self.startup = await self._get_json("/startup")
        except TimeoutError:
            raise InstanceFailed(f"instance {self.id} was not up after {timeout_s:g} s") from None
        if self.state is not InstanceState.STARTING:
            raise InstanceFailed(f"instance {self.id} was stopped while starting")
        self.cold_start_s = time.monotonic() - started
        self.state = InstanceState.UP
        self.last_active_s = time.monotonic()

    async def _read_url(self) -> str:
        assert self._proc is not None and self._proc.stdout is not None
        while line := await self._next_line():
            if LISTENING in line:
                self._stdout_task = asyncio.create_task(self._log_stdout())
                return line.split(LISTENING, 1)[1].split()[0]
            log.info("instance %d: %s", self.id, line.rstrip())
        await self._master_exit()  # stdout closed: the instance is exiting
        raise self._exited("before it listened")

    async def _log_stdout(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        while line := await self._next_line():
            log.info("instance %d: %s", self.id, line.rstrip())

    async def _next_line(self) -> str:
        """The instance's next stdout line, "" once it closed. NOTE: a line longer than the
        reader's limit is dropped, never left unread: the instance would block on a full pipe."""
        try:
            return (await self._proc.stdout.readline()).decode(errors="replace")
        except ValueError:  # the reader dropped what it buffered of the line; read on
            return OVERLONG_LINE

    async def _wait_until_healthy(self) -> None:
        while True:
            if self._proc.returncode is not None or self.state is not InstanceState.STARTING:
                raise self._exited("while starting")
            try:
                async with self._session.get(f"{self.url}/health") as r:
                    body = await r.json(content_type=None)
                    if r.status == 200:
                        return
                    if body.get("status") == "failed":
                        reason = body.get("reason") or "no reason given"
                        raise InstanceFailed(f"instance {self.id} failed to start: {reason}")
            except (aiohttp.ClientError, ValueError, AttributeError):
                pass  # not answering yet (or not JSON): poll again
            await asyncio.sleep(HEALTH_POLL_S)

    async def failure(self) -> str | None:
        """Why this UP instance can no longer serve, as its `/health` says (503 "failed": its
        runtime failed after it came up, e.g. a restored function worker died), else None (an
        answer that is not that, or none within `HEALTH_CHECK_TIMEOUT_S`: busy, not failed)."""
        try:
            async with asyncio.timeout(HEALTH_CHECK_TIMEOUT_S):
                async with self._session.get(f"{self.url}/health") as r:
                    body = await r.json(content_type=None)
        except (aiohttp.ClientError, ValueError, TimeoutError):
            return None
        if r.status != 503 or not isinstance(body, dict) or body.get("status") != "failed":
            return None
        return str(body.get("reason") or "no reason given")

    async def _get_json(self, path: str) -> dict[str, Any]:
        try:
            async with self._session.get(f"{self.url}{path}", headers=self._auth) as r:
                body = await r.json(content_type=None)
        except (aiohttp.ClientError, ValueError) as exc:
            raise InstanceFailed(f"instance {self.id}: GET {path} failed: {exc}") from None
        if r.status != 200 or not isinstance(body, dict):
            raise InstanceFailed(f"instance {self.id}: GET {path} answered {r.status}")
        return body

    def _exited(self, when: str) -> InstanceFailed:
        if self.state is InstanceState.STOPPING:
            return InstanceFailed(f"instance {self.id} was stopped ({self.stop_reason}) {when}")
        code = self._proc.returncode if self._proc is not None else None
        return InstanceFailed(f"instance {self.id} exited (code {code}) {when}")

    # ---- stop ----------------------------------------------------------------------------
    def stop(self, reason: str, drain: bool) -> None:
        """Ask the master to stop now, SIGKILL the group after the grace period."""
        if self.state in (InstanceState.STOPPING, InstanceState.EXITED):
            return
        self.state, self.stop_reason = InstanceState.STOPPING, reason
        log.info("instance %d: stopping (%s)", self.id, reason)
        if self.pid is None:
            return  # not spawned yet: `start` sees STOPPING once it is, and gives up
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGTERM if drain else signal.SIGQUIT)
        loop = asyncio.get_running_loop()
        self._kill_timer = loop.call_later(self._grace_s, signal_group, self.pid, signal.SIGKILL)

    async def run_until_exit(self) -> int:
        """Wait for the master to exit, then clear its group; the master's exit code."""
        assert self._proc is not None, "start() first"
        code = await self._master_exit()
        await self._clear()
        return code

    async def kill(self) -> None:
        """SIGKILL the whole group now and wait until none of it runs."""
        if self._proc is not None:
            signal_group(self._proc.pid, signal.SIGKILL)
            await self._master_exit()
            await self._clear()
        self.state = InstanceState.EXITED

    async def _master_exit(self) -> int:
        # NOTE: not `Process.wait()`: on Python 3.11 it also waits for the stdout pipe to close,
        # and workers orphaned by a crashed master keep it open while they serve on
        while (code := self._proc.returncode) is None:
            await asyncio.sleep(EXIT_POLL_S)
        return code

    async def _clear(self) -> None:
        if self._kill_timer is not None:
            self._kill_timer.cancel()
        left = await clear_group(self._proc.pid)
        if left:
            log.warning("instance %d: processes %s survived SIGKILL", self.id, left)
        if self._stdout_task is not None:
            await asyncio.gather(self._stdout_task, return_exceptions=True)
        self.state = InstanceState.EXITED

    def describe(self) -> dict[str, Any]:
        """This instance for the activator's `/startup`."""
        startup = self.startup or {}
        return {
            "id": self.id,
            "state": self.state.value,
            "pid": self.pid,
            "gpu": self.gpu,
            "url": self.url,
            "outstanding": self.outstanding,
            "idle_s": round(time.monotonic() - self.last_active_s, 3),
            "cold_start_s": self.cold_start_s,
            "started_at": self.started_at,
            "launch": self.launch,
            "kind": startup.get("kind"),
            "tier": startup.get("tier"),
        }
