"""WorkerRuntime: one function brought up in one worker process, then invoked by the front doors.

The HTTP server (one per gunicorn worker, after fork) and the queue worker each own one:

    runtime = WorkerRuntime(ServeTarget(kind="llm", snapshot_dir=Path("snap")), log=print)
    runtime.start()                        # init or restore on a background thread
    runtime.wait_ready(timeout_s=60)       # Readiness.UP or FAILED (reason in readiness.reason)
    runtime.invoke({"prompt": "Hello"})    # handler(event, context) → JSON-able

Bring-up by kind:
- "llm" (the built-in function): `snapshot_dir` holds files → restore from it: its process image
  (tier 1: the engine runs in the restored worker, `runtime.llm` is a ProcessLLMService), else
  or on any failure its portable tier (tier 0, in this process), else a cold init that rewrites
  the snapshot — every fallback recorded in the startup manifest; `snapshot_dir` empty or
  missing → cold init, then write the snapshot there; no `snapshot_dir` → cold init only;
  `snapshot_uri` (an s3:// snapshot that missed the cache at the fork) → pulled here, tier 0
  restored as it arrives (llm/recipes/s3_restore.py), a hit by now restored as above. The
  engine runs under an `LLMService` (`runtime.llm`, which the OpenAI endpoints use) and `invoke`
  calls an `LLMHandler` bound to it.
- "function": `snapshot_dir` holds a snapshot (`snapfn init --function`): its process image
  (tier 1, on the device it was made for: the checkpointed worker restored and invoked over its
  channel), else or on any failure its portable tier (tier 0: its compile caches restored, the
  module imported and its init hooks run again in this process, compiling nothing), else a cold
  init; every fallback recorded with its reason. No snapshot: a cold init (`runtime_env →
  import_function → init_hooks`, each a timed stage). `prepare_snapshot()` / `after_restore()`
  run an in-process function's hooks.

Any failure leaves readiness FAILED with a one-line reason, recorded in `startup` too; `invoke`
then raises InitFailed. A handler's exception comes back as FunctionError (`api.py`).
A runtime that was up and can no longer serve (its restored worker process or a rank died, a
function's handler overran its time limit, or it was closed) is FAILED too, with `stopped` set
(`wait_stopped()` returns then): `invoke` then raises `RuntimeStopped` (an InitFailed), and the
front doors say "stopped", not "failed to start". The front doors replace such a runtime: a
`snapfn serve` worker exits and gunicorn starts another (`http/serve.py`), `snapfn worker`
drains and exits non-zero (`queue/cli.py`).

Time limit (kind="function"): a call has until its deadline (`invoke`'s `timeout_s`, else the
target's). Tier 0 runs the handler on a thread of its own (`api.call_handler_in_time`), tier 1
waits that long for the restored worker's answer; past it the caller gets `HandlerTimedOut`
(Lambda's `Sandbox.Timedout`, "Task timed out after N.NN seconds") and the runtime stops with
"the handler overran its N s limit": the handler may still be running (a Python thread cannot
be stopped; a restored worker is killed), so nothing more is called in this runtime, as Lambda
replaces the execution environment of a function that timed out. The LLM's generations keep
to their deadline themselves (cancelled at it, `llm/handler.py`).

Fallback sources (snapshot/runtime.py): an LLM's cold fallback reads the model the target
names (`model_dir`), else the source the snapshot records once its content hash matches
(handler/llm/recipes/sources.py); a function's is always the target's `function` spec (never
the manifest's), on the device the snapshot records when that is a device name, else the
target's. A process image's compile caches are put back only into the folder this runtime keeps
the function's caches in, and only files the manifest lists with their digests.

Fatal start (the contract with the front doors): when the start failed because no trustworthy
source is left — every tier of the snapshot was refused and nothing named or verifiable can be
cold-initialised — `runtime.fatal` holds that `NoTrustedSource` error (code
"no_trusted_source", an InitFailed; its message is readiness's reason, one line). Nothing will
change while this process runs: a server reports it (`/health`: failed, with the reason) and
exits non-zero so that an orchestrator replaces it. Any other failed start leaves `fatal` None.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from snapfn.handler.api import (
    Context,
    Handler,
    HandlerTimedOut,
    LoadedFunction,
    call_handler,
    call_handler_in_time,
)
from snapfn.handler.function.target import NotReady, ServeTarget
from snapfn.snapshot.errors import BadRequest, InitFailed, RestoreFailed, SnapfnError
from snapfn.snapshot.runtime import holds_files
from snapfn.snapshot.stages import Readiness, ReadinessState, StageRunner, StartupManifest

if TYPE_CHECKING:
    from snapfn.handler.llm.handler import LLMHandler
    from snapfn.handler.llm.recipes.function import LLMFunction
    from snapfn.handler.llm.service import LLMService
    from snapfn.snapshot.runtime import NoTrustedSource

Log = Callable[[str], None]


class RuntimeStopped(InitFailed):
    """The runtime was up, then stopped: it serves nothing more (HTTP 503, like a failed
    start)."""

    code = "runtime_stopped"


class WorkerRuntime:
    """One served function: start (init or restore), readiness, invoke, health, close."""

    def __init__(self, target: ServeTarget, log: Log | None = None) -> None:
        """Cheap: nothing is imported, loaded or touched on a device until `start()`."""
        self.target = target
        self.readiness = ReadinessState()
        self.startup: StartupManifest | None = None
        self.fatal: NoTrustedSource | None = None  # see the module docstring
        self._stopped = threading.Event()  # FAILED after it was up (`stopped`)
        self.function_name = target.function if target.kind == "function" else "llm"
        self.llm: LLMService | None = None
        self._log = log
        self._handler: Handler | None = None
        self._function: LoadedFunction | None = None
        self._llm_function: LLMFunction | None = None
        self._llm_handler: LLMHandler | None = None
        self._remote = None  # RemoteHandler of a restored function worker (tier 1)
        self._started = False
        self._closed = False
        self._lock = threading.Lock()

    # ---- bring-up ------------------------------------------------------------------------------
    def start(self, background: bool = True) -> None:
        """Init or restore, on a daemon thread by default. Never raises for a failed start."""
        with self._lock:
            if self._started:
                raise RuntimeError("WorkerRuntime.start() was already called")
            self._started = True
        if not background:
            return self._start()
        threading.Thread(target=self._start, name="snapfn-start", daemon=True).start()

    def wait_ready(self, timeout_s: float | None = None) -> Readiness:
        return self.readiness.wait_until_settled(timeout_s)

    @property
    def stopped(self) -> bool:
        """Whether the runtime is FAILED after it was up (see the module docstring)."""
        return self._stopped.is_set()

    def wait_stopped(self, timeout_s: float | None = None) -> bool:
        """Block until the runtime stopped after it was up (or the timeout); whether it has."""
        return self._stopped.wait(timeout_s)

    def _start(self) -> None:
        lines: list[str] = []
        log = self._collecting_log(lines)
        try:
            if self.target.kind == "llm":
                self._start_llm(log)
            else:
                self._start_function(log)
        except BaseException as exc:
            self._fail(exc, lines)
            if not isinstance(exc, Exception):
                raise
            return
        with self._lock:
            if self._closed:  # closed while starting: release what the start built
                self._release()
                self.readiness.set(Readiness.FAILED, "closed while starting")
            else:
                self.readiness.set(Readiness.UP)

    def _collecting_log(self, lines: list[str]) -> Log:
        def log(line: str) -> None:
            lines.append(line)
            if self._log is not None:
                self._log(line)

        return log

    def _fail(self, exc: BaseException, lines: list[str]) -> None:
        from snapfn.snapshot.runtime import NoTrustedSource  # NOTE: no torch import there

        reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
        if isinstance(exc, NoTrustedSource):
            self.fatal = exc
        if self.startup is None:
            kind, tier = self._planned_startup()
            self.startup = StartupManifest(kind=kind, tier=tier, info={"log": lines})
        self.startup.ok = False
        self.startup.info["error"] = reason
        if self._log is not None:
            self._log(f"{self.function_name} failed to start: {reason}")
        self.readiness.set(Readiness.FAILED, reason)

    def _planned_startup(self) -> tuple[str, str]:
        if self.target.snapshot_uri is not None:
            return "restore", "portable"
        if holds_files(self.target.snapshot_dir):
            from snapfn.snapshot.process.snapshot import has_process_image

            return "restore", "process" if has_process_image(
                self.target.snapshot_dir
            ) else "portable"
        return "init", "cold"

    # ---- kind="llm" ----------------------------------------------------------------------------
    def _start_llm(self, log: Log) -> None:
        # NOTE: imported here, in the worker after fork: they import torch; CUDA is first
        # touched by the init or restore below, never before start().
        from snapfn.handler.llm.handler import LLMHandler

        self.llm, self.startup, self._llm_function = self._init_or_restore_llm(log)
        self._handler = self._llm_handler = LLMHandler(self.llm)

    def _init_or_restore_llm(self, log: Log) -> tuple[Any, StartupManifest, LLMFunction | None]:
        from snapfn.handler.llm.embedded import embedded_model_dir
        from snapfn.handler.llm.recipes.process_restore import restore_llm

        t, config = self.target, self.target.init_config
        if config.world_size > 1:
            return init_llm_ranks(t, log, self._ranks_down)
        if t.snapshot_uri is not None:  # a cache miss at the fork: pulled here as it restores
            from snapfn.handler.llm.recipes.s3_restore import restore_llm_from_s3

            cache, named = t.snapshot_cache, t.model_dir
            return restore_llm_from_s3(
                t.snapshot_uri, cache, config, named, log, self._worker_exited
            )
        if holds_files(t.snapshot_dir):  # the fallback: t.model_dir, or a verified record
            return restore_llm(Path(t.snapshot_dir), config, t.model_dir, log, self._worker_exited)
        from snapfn.handler.llm.recipes.function import LLMFunction
        from snapfn.snapshot.runtime import cold_init

        fn = LLMFunction(config, t.model_dir or embedded_model_dir())
        try:
            startup = cold_init(fn, log)
        except BaseException:
            fn.release()
            raise
        if t.snapshot_dir is not None:
            _write_snapshot(fn, Path(t.snapshot_dir), startup, log)
        from snapfn.handler.llm.service import LLMService

        return LLMService(fn.engine), startup, fn

    def _ranks_down(self, reason: str) -> None:
        """A rank of this tensor-parallel runtime died (the others are stopped)."""
        self._lose(reason, f"the {self.function_name} ranks are down: {reason}")

    def _worker_exited(self, reason: str) -> None:
        """A restored process-snapshot worker died: this runtime can no longer serve."""
        self._lose(
            f"worker process exited: {reason}",
            f"the {self.function_name} worker process is gone ({reason})",
        )

    def _lose(self, reason: str, line: str) -> None:
        """FAILED with `reason`; `stopped` when it had been up (else the start fails too). A
        runtime FAILED already keeps its first reason."""
        if self.readiness.state is Readiness.FAILED:
            return
        if self._log is not None:
            up = self.readiness.state is Readiness.UP
            self._log(f"{self.function_name} stopped: {line}" if up else line)
        self._settle_failed(reason)

    def _settle_failed(self, reason: str) -> None:
        """Readiness FAILED with `reason`, and `stopped` when it was UP."""
        if self.readiness.state is Readiness.UP:
            self._stopped.set()
        self.readiness.set(Readiness.FAILED, reason)

    def _overran(self, limit_s: float) -> None:
        """A handler overran its time limit and may still be running: stop, and kill a
        restored worker (see the module docstring)."""
        reason = f"the handler overran its {round(limit_s, 2):g} s limit"
        self._lose(reason, f"{reason}; it may still be running, so nothing more is called here")
        with self._lock:
            remote, self._remote = self._remote, None
        if remote is not None:
            remote.close()

    # ---- kind="function" -----------------------------------------------------------------------
    def _start_function(self, log: Log) -> None:
        from snapfn.snapshot.process.snapshot import has_process_image

        snapshot = self.target.snapshot_dir
        if not holds_files(snapshot):
            return self._cold_start_function(log)
        failed = None
        if has_process_image(snapshot):
            try:
                return self._restore_function(log)
            except RestoreFailed as exc:  # every step of a tier-1 restore raises one
                failed = exc
                log(f"{exc}; falling back to the portable snapshot of {self.function_name}")
        self._restore_function_portable(log, failed)

    def _user_function(self, device: str | None = None):
        from snapfn.handler.function.user_function import UserFunction, function_cache_dir

        t = self.target
        device = device or t.init_config.device
        cache_dir = function_cache_dir(t.function, t.init_config.cache_dir)
        return UserFunction(t.function, t.function_dir, device, cache_dir)

    def _recorded_manifest(self) -> dict[str, Any]:
        """The snapshot's manifest, shape-checked ({} when unreadable: validate says why)."""
        from snapfn.snapshot.portable.format import read_manifest

        try:
            return read_manifest(Path(self.target.snapshot_dir))
        except SnapfnError:
            return {}

    def _recorded_device(self, check: bool = True) -> str:
        """The device the snapshot was made for (its function section), when that is a
        device name (this machine has, with `check`), else the target's."""
        from snapfn.handler.function.user_function import USER_FUNCTION, recorded_device

        section = self._recorded_manifest().get(USER_FUNCTION)
        return recorded_device(section, self.target.init_config.device, check)

    def _restore_function(self, log: Log) -> None:
        """Tier 1: restore the function's checkpointed worker and invoke it over its channel."""
        import os

        from snapfn.handler.function.host import RemoteHandler
        from snapfn.handler.function.user_function import USER_FUNCTION
        from snapfn.snapshot.process.client import ProcessClient
        from snapfn.snapshot.process.snapshot import restore_process_snapshot
        from snapfn.snapshot.process.worker_process import ProcessConfig

        def same_function(manifest: dict[str, Any]) -> None:
            recorded = manifest.get(USER_FUNCTION, {}).get("spec")
            if recorded != self.target.function:
                raise BadRequest(
                    f"snapshot {self.target.snapshot_dir} holds function {recorded!r}, "
                    f"not {self.target.function!r}"
                )

        from snapfn.handler.function.user_function import restore_image_caches
        from snapfn.snapshot.process.snapshot import ProcessRestoreFailed

        # NOTE: no cuInit here, before the restore: its compat check (or keeper) asks beside criu
        device, snapshot = self._recorded_device(check=False), Path(self.target.snapshot_dir)
        cache_dir = self._user_function(device).cache_dir
        try:
            copied = restore_image_caches(snapshot, self._recorded_manifest(), cache_dir)
        except OSError as exc:
            copied = f"could not put the caches back: {exc}"  # criu then says what it misses
        except (SnapfnError, KeyError) as exc:  # a damaged snapshot: nothing was copied
            attempt = StartupManifest(kind="restore", tier="process")
            raise ProcessRestoreFailed("validate", str(exc), attempt) from None
        worker, self.startup, _ = restore_process_snapshot(
            snapshot,
            {},
            device=device,
            config=ProcessConfig.from_env(os.environ).for_device(device),
            log=log,
            accept=same_function,
        )
        self.startup.info["image_caches_restored"] = copied
        self._handler = self._remote = RemoteHandler(ProcessClient(worker, self._worker_exited))

    def _restore_function_portable(self, log: Log, failed: RestoreFailed | None) -> None:
        """Tier 0 (a cold init if that fails too), recording why tier 1 did not serve."""
        from snapfn.snapshot.runtime import restore

        device = self._recorded_device()
        fn, self.startup = restore(
            lambda: self._user_function(device),
            Path(self.target.snapshot_dir),
            fallback=lambda recorded: self._user_function(device),  # the spec the user named
            rewrite_on_fallback=False,
            log=log,
        )
        if failed is not None:
            self.startup.add_failed_process_restore(failed, "portable", first=True)
        self._function, self._handler = fn.loaded, fn.loaded.handler

    def _cold_start_function(self, log: Log) -> None:
        from snapfn.snapshot.runtime import cold_init

        fn = self._user_function()
        self.startup = StartupManifest(kind="init", tier="cold", info={"function": fn.spec})
        cold_init(fn, log, self.startup)
        self._function, self._handler = fn.loaded, fn.loaded.handler

    def prepare_snapshot(self) -> list[str]:
        """Run the before-snapshot hooks (timed stage `before_snapshot`); their names, in order."""
        return self._run_phase("before_snapshot", lambda f: f.run_before_snapshot())

    def after_restore(self) -> list[str]:
        """Run the after-restore hooks (timed stage `after_restore`); their names, in order.

        kind="llm" has none (its snapshot is the portable one, written at start): returns [].
        """
        return self._run_phase("after_restore", lambda f: f.run_after_restore())

    def _run_phase(self, name: str, run: Callable[[LoadedFunction], list[str]]) -> list[str]:
        self._check_up()
        if self._function is None:
            return []
        runner = StageRunner(self.startup, log=self._log, offset_s=self.startup.total_s)

        def stage(figures: dict[str, Any]) -> list[str]:
            figures["hooks"] = run(self._function)
            return figures["hooks"]

        return runner.run(name, stage)

    # ---- serving -------------------------------------------------------------------------------
    def invoke(
        self, event: dict, *, timeout_s: float | None = None, request_id: str | None = None
    ) -> Any:
        """Call the handler with a fresh Context; waits (within the deadline) while starting.

        Raises BadRequest (event not an object, bad timeout_s), FunctionError (the handler raised:
        Lambda's error shape in `.error`; `HandlerTimedOut` once the deadline passed, which stops
        the runtime), InitFailed (the start failed; `RuntimeStopped` once stopped), NotReady
        (still starting).
        """
        if not isinstance(event, dict):
            raise BadRequest(f"the event must be a JSON object, got {type(event).__name__}")
        timeout_s = self.target.timeout_s if timeout_s is None else timeout_s
        context = Context.new(self.function_name, timeout_s, request_id)
        self._check_up(wait_s=context.get_remaining_time_in_millis() / 1000)
        handler = self._handler
        if handler is None:  # closed since the check
            raise NotReady(f"{self.function_name} was closed")
        if self._function is None:  # the LLM's, or a restored worker's: they keep the deadline
            return self._in_time(lambda: call_handler(handler, event, context))
        return self._in_time(lambda: call_handler_in_time(handler, event, context))

    def health_generate(self, timeout_s: float = 30.0) -> Any:
        """A real call through the whole path: llm, one 1-token generation through the service;
        function, the handler called on its declared health event (`api.health_event`, else
        `{}`), in the restored worker for tier 1, within `timeout_s` as any call. Raises what
        the call raised."""
        self._check_up()
        if self._llm_handler is not None:
            return self._llm_handler.health_check(timeout_s)
        remote, handler = self._remote, self._handler
        if remote is not None:
            return {"ok": True, "result": self._in_time(lambda: remote.health(timeout_s))}
        event = self._function.health_event if self._function is not None else {}
        context = Context.new(self.function_name, timeout_s)
        result = self._in_time(lambda: call_handler_in_time(handler, event, context))
        return {"ok": True, "result": result}

    def _in_time(self, call: Callable[[], Any]) -> Any:
        """`call()`; one that overran its time limit stops the runtime, then raises."""
        try:
            return call()
        except HandlerTimedOut as exc:
            self._overran(exc.limit_s)
            raise

    def _check_up(self, wait_s: float = 0.0) -> None:
        if not self._started or self._closed:
            state = "was closed" if self._closed else "was never started"
            raise NotReady(f"{self.function_name} {state}")
        state = self.readiness.wait_until_settled(wait_s) if wait_s > 0 else self.readiness.state
        if state is Readiness.FAILED and self.stopped:
            raise RuntimeStopped(f"{self.function_name} stopped: {self.readiness.reason}")
        if state is Readiness.FAILED:
            raise InitFailed(f"{self.function_name} failed to start: {self.readiness.reason}")
        if state is not Readiness.UP:
            raise NotReady(f"{self.function_name} is still starting; retry shortly")

    def close(self) -> None:
        """Stop the engine loop and release the model (safe while a start is in flight)."""
        with self._lock:
            self._closed = True
            self._release()
            # NOTE: a start in flight settles readiness itself when it ends; a failed start
            # keeps its reason.
            if self.readiness.state is Readiness.UP or not self._started:
                self._settle_failed("closed")

    def _release(self) -> None:
        if self._remote is not None:
            self._remote.close()
            self._remote = None
        if self.llm is not None:
            self.llm.close()
        if self._llm_function is not None:
            self._llm_function.release()
        self.llm = self._llm_function = self._handler = self._llm_handler = None


def init_llm_ranks(
    target: ServeTarget, log: Log, on_rank_exit: Callable[[str], None] | None = None
) -> tuple[Any, StartupManifest, Any]:
    """A tensor- or expert-parallel LLM: this process is rank 0 (it serves), the other ranks
    are started here (`python -m snapfn.handler.llm.follower`, `ranks.py`); every rank comes up
    the same way (`recipes/ranks_start.py`: the snapshot restored, or a cold init that writes
    it), then rank 0's service drives the others in lock step (`lockstep.py`). Leaving the
    group stops them."""
    import dataclasses
    from contextlib import ExitStack

    from snapfn.handler.llm.embedded import embedded_model_dir
    from snapfn.handler.llm.lockstep import Lockstep
    from snapfn.handler.llm.ranks import parallel_ranks
    from snapfn.handler.llm.recipes.process_restore import process_restore_enabled
    from snapfn.handler.llm.recipes.ranks_start import start_rank
    from snapfn.handler.llm.service import LLMService

    config, snapshot = target.init_config, target.snapshot_dir
    failed = None
    if process_restore_enabled(snapshot):
        from snapfn.handler.llm.recipes.process_ranks import restore_process_ranks

        try:
            service, startup, _ = restore_process_ranks(Path(snapshot), config, log)
            return service, startup, None
        except RestoreFailed as exc:
            failed = exc
            if log is not None:
                log(f"{exc}; falling back to the portable snapshot on every rank")
    model_dir = target.model_dir
    if model_dir is None and not holds_files(snapshot):
        model_dir = embedded_model_dir()
    command = [sys.executable, "-m", "snapfn.handler.llm.follower", str(model_dir or "-")]
    command += [str(snapshot)] if snapshot is not None else []
    stack = ExitStack()
    try:
        parallel, device = stack.enter_context(
            parallel_ranks(
                config.tp_size,
                config.ep_size,
                config.ep_dispatch,
                config.device,
                command=command,
                extra_env=config.to_env(),
                on_rank_exit=on_rank_exit,
            )
        )
        config = dataclasses.replace(config, device=device)
        path = Path(model_dir) if model_dir is not None else None
        fn, startup = start_rank(config, path, Path(snapshot) if snapshot else None, parallel, log)
        service = LLMService(fn.engine, lockstep=Lockstep(parallel), on_close=stack.close)
    except BaseException:
        stack.close()
        raise
    if failed is not None:
        startup.add_failed_process_restore(failed, "portable", first=True)
    return service, startup, fn


def _write_snapshot(fn: LLMFunction, dest: Path, startup: StartupManifest, log: Log) -> None:
    """Write the snapshot after a cold init; a failed write is recorded, the worker still serves."""
    from snapfn.snapshot.runtime import write_snapshot

    try:
        write_snapshot(fn, dest, startup, log)
    except (SnapfnError, OSError) as exc:
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
        startup.info["snapshot_write_error"] = reason
        log(f"could not write the snapshot to {dest} ({reason}); serving from the cold init")
