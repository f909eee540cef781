"""A user's Lambda-style function as a process-snapshot host (tier 1), and its remote handler.

    snapfn init --function mod:handler --snapshot DIR [--device cuda]   (FunctionHost in a
                                                                       checkpointable worker)
    snapfn serve --function mod:handler --snapshot DIR                 (RemoteHandler → the
                                                                       restored worker)

The worker cold-inits the function (`UserFunction`: runtime_env → import_function →
init_hooks) and writes the portable part of the snapshot (its compile caches and
--function-dir files), so that a snapshot whose process image cannot be written or restored
still restores as tier 0. On CUDA the init hooks' allocations land in a releasable pool
(`DeviceMemory`). Before the dump: the function's before-snapshot hooks (snapfn's in reverse
registration order, then `snapshot_restore_py`'s in reverse), the checks that refuse what a
process image cannot hold (`tier1_problem`: a tier-0 snapshot with that reason is published
instead), and on CUDA the pool's image written and its memory released. After each restore:
`identity.refresh()` (fresh seeds for random, NumPy, torch CPU and CUDA), the pool mapped back
and filled, verified, then the after-restore hooks in registration order. It then answers
{"op": "invoke", "event", "timeout_s", "request_id"} with the handler's JSON result, or the
Lambda-shaped error of FunctionError, and {"op": "health"} with a call on the health event.
A call whose worker exits before it answers (the function ended its process) raises a
FunctionError `Runtime.ExitError`, as Lambda reports a runtime that exited; one the worker has
not answered by the invocation's deadline raises `HandlerTimedOut` (Lambda's
`Sandbox.Timedout`, as for a tier-0 handler), and the runtime then stops and kills the worker,
whose handler may still be running.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from pathlib import Path
from typing import Any

from snapfn.handler.api import Context, FunctionError, HandlerTimedOut, call_handler
from snapfn.handler.function.user_function import USER_FUNCTION, UserFunction
from snapfn.snapshot.cuda.stack_limit import StackLimit
from snapfn.snapshot.errors import BadRequest, RestoreFailed, SnapfnError
from snapfn.snapshot.process.client import WORKER_EXITED
from snapfn.snapshot.stages import StageRunner, StartupManifest

HOST = "snapfn.handler.function.host:make"


def log(line: str) -> None:
    print(f"[snapfn worker] {line}", file=sys.stderr, flush=True)


class FilesWriter:
    """The writer a function writes its tier-0 files through, in the worker: the owner holds
    the real SnapshotWriter, which digests them when it publishes."""

    def __init__(self, root: Path) -> None:
        self.root = root


class FunctionHost:
    def __init__(self, args: dict[str, Any]) -> None:
        self.device = str(args.get("device", "cpu"))
        self.uses_cuda = self.device.startswith("cuda")
        self.root = Path(args["root"])
        memory_for = _device_memory if self.uses_cuda else None
        self.fn = UserFunction(
            args["function"],
            args.get("function_dir"),
            self.device,
            args.get("cache_dir"),
            memory_for,
        )
        self.max_image_device_bytes = args.get("max_image_device_bytes")
        self.checkpoint_figures: dict[str, Any] = {}
        self.checkpoint_registered: list[list[Any]] = []
        self.region_specs: list[dict[str, Any]] = []
        self.memory_section: dict[str, Any] = {}
        self.stack = StackLimit()  # lowered for the checkpoint, set back after each restore

    @property
    def loaded(self):
        return self.fn.loaded

    def init(self) -> dict[str, Any]:
        from snapfn.snapshot.portable.compat import compat_key
        from snapfn.snapshot.runtime import cold_init

        startup = StartupManifest(kind="init", tier="cold", info={"function": self.fn.spec})
        cold_init(self.fn, log, startup)
        section = self.fn.write_snapshot(FilesWriter(self.root), startup.to_json())
        return {
            "function": USER_FUNCTION,
            "startup": startup.to_json(),
            "compat": compat_key(self.device, 1, light=True),
            "section": section,
        }

    def before_snapshot(self) -> list[str]:
        hooks = self.loaded.run_before_snapshot()
        if stop_compile_workers():
            hooks.append("stop_compile_workers")
        if not self.uses_cuda:
            problem = tier1_problem(None, None)
            if problem is not None:
                raise RestoreFailed(problem)
            return hooks
        import torch

        torch.cuda.synchronize()
        gc.collect()
        # NOTE: cuBLAS keeps a workspace per (thread's handle, stream) that the CUDA checkpoint
        # would copy into the image; eager matmuls allocate them again after a restore.
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:
            clear_workspaces()
        torch.cuda.empty_cache()  # cached free blocks need not be in the image
        memory = self.fn.memory
        figures = device_figures(memory)
        problem = tier1_problem(figures, self.max_image_device_bytes)
        if problem is not None:
            raise RestoreFailed(problem)
        self.memory_section, self.checkpoint_registered = memory.checkpoint(
            self.root, self.loaded.unsaved()
        )
        self.region_specs = memory.region_specs
        info = {k: v for k, v in self.memory_section.items() if k not in ("image", "file")}
        stack = self.stack.lower()
        if stack:  # the local memory it freed leaves the image too
            figures["image_device_bytes"] -= min(
                figures["image_device_bytes"], stack["stack_freed_bytes"]
            )
        self.checkpoint_figures = {**figures, **info, **stack}
        log(f"at checkpoint: {self.checkpoint_figures}")
        return hooks

    def after_restore(self, resume: dict[str, Any]) -> dict[str, Any]:
        runner = StageRunner(StartupManifest(kind="restore", tier="process"), clock=time.time)
        t0 = time.time()
        if self.uses_cuda:  # NOTE: the first driver call waits for the CUDA restore to finish
            snapshot_dir = Path(resume["snapshot_dir"])
            runner.run("cuda_ready", lambda f: self.stack.restore())  # before any kernel runs
            runner.run(
                "device_memory",
                lambda f: f.update(
                    self.fn.memory.restore(self.memory_section, snapshot_dir, resume)
                ),
            )
        runner.run("after_restore", lambda f: f.update(hooks=self.loaded.run_after_restore()))
        return {"t0": t0, "stages": [_record(s) for s in runner.manifest.stages]}

    def handle(self, message: dict[str, Any], send) -> None:
        op, rid = message["op"], message["id"]
        if op == "health":
            message = {**message, "event": self.loaded.health_event, "timeout_s": 30.0}
        elif op != "invoke":
            raise ValueError(f"unknown op {op!r}")
        context = Context.new(self.fn.spec, float(message["timeout_s"]), message.get("request_id"))
        try:
            value = call_handler(self.loaded.handler, message["event"], context)
        except FunctionError as exc:
            send({"id": rid, "event": "error", "code": exc.code, "error": exc.error})
            return
        send({"id": rid, "event": "result", "value": value})

    def close(self) -> None:
        pass


def make(args: dict[str, Any]) -> FunctionHost:
    return FunctionHost(args)


def _device_memory(device: str):
    from snapfn.handler.function.device_memory import DeviceMemory

    return DeviceMemory(device)


def _record(stage: Any) -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(stage)


# ---- what a process image cannot hold -----------------------------------------------------------
def device_figures(memory: Any) -> dict[str, int]:
    """Where the device memory in use is, just before the checkpoint: the releasable pool's
    pieces, torch's other segments (graph pools, allocations on other streams) and the rest
    (the CUDA context, libraries' own allocations). All but the pool go into the image."""
    import torch

    free, total = torch.cuda.mem_get_info()
    pool = memory.pool_bytes() if memory is not None else 0
    lo, hi = (memory.pool.span.base, memory.pool.span.top) if memory is not None else (0, 0)
    outside = sum(
        int(s["total_size"])
        for s in torch.cuda.memory_snapshot()
        if not lo <= int(s["address"]) < hi
    )
    in_use = total - free
    return {
        "device_in_use_bytes": in_use,
        "pool_bytes": pool,
        "torch_outside_pool_bytes": outside,
        "image_device_bytes": max(0, in_use - pool),  # what the CUDA checkpoint copies
    }


def tier1_problem(figures: dict[str, int] | None, max_image_device_bytes: int | None) -> str | None:
    """Why this worker's process image would not restore correctly, or None: torch.distributed
    communicators (NCCL's state lives in other processes and the network), child processes
    (criu would dump them without their GPU state; CUDA IPC peers are children), or more device
    memory outside the pool than the CUDA checkpoint may copy into host memory."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return (
            f"the function initialised torch.distributed (backend {dist.get_backend()}): "
            "its communicators cannot be checkpointed"
        )
    children = _child_pids()
    if children:
        return (
            f"the function started child processes (pids {', '.join(map(str, children))}), "
            "which a process image cannot take with their GPU state"
        )
    if figures is not None:
        limit = max_image_device_bytes or _default_image_limit()
        outside = figures["image_device_bytes"]
        if outside > limit:
            return (
                f"{outside / 1e9:.2f} GB of device memory outside the releasable pool would go "
                f"into the image (limit {limit / 1e9:.2f} GB): allocate it in an init hook, on "
                "the thread that runs it"
            )
    return None


def stop_compile_workers(wait_s: float = 10.0) -> bool:
    """Shut down the compile workers torch.compile started (inductor's pool of subprocesses for
    parallel compiles): a process image cannot hold child processes, and inductor starts them
    again should it compile after a restore. True when there were any; waits up to `wait_s`
    for them to exit."""
    async_compile = sys.modules.get("torch._inductor.async_compile")
    if async_compile is None or not getattr(async_compile, "_pool_set", None):
        return False
    async_compile.shutdown_compile_workers()
    deadline = time.monotonic() + wait_s
    while _child_pids() and time.monotonic() < deadline:
        time.sleep(0.01)
    return True


def _child_pids() -> list[int]:
    pids: list[int] = []
    for task in Path("/proc/self/task").iterdir():
        try:
            pids += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    return sorted(set(pids))


def _default_image_limit() -> int:
    """Half of the host memory available now: the CUDA checkpoint holds the copy in RAM."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 // 2
    except OSError:
        pass
    return 8 << 30


# ---- the front door's side ----------------------------------------------------------------------
class RemoteHandler:
    """`handler(event, context)` that invokes the function in a restored worker."""

    def __init__(self, client: Any) -> None:
        self.client = client

    def __call__(self, event: dict, context: Context) -> Any:
        """The handler's answer by `context`'s deadline; past it, `HandlerTimedOut`."""
        timeout_s = max(0.0, context.deadline - time.monotonic())
        invoke = {"op": "invoke", "event": event, "timeout_s": timeout_s}
        return self._answer(
            self.client.call({**invoke, "request_id": context.aws_request_id}, timeout_s),
            timeout_s,
        )

    def health(self, timeout_s: float = 30.0) -> Any:
        """A call of the handler on its declared health event, in the restored worker, answered
        within `timeout_s` (else `HandlerTimedOut`)."""
        return self._answer(self.client.call({"op": "health"}, timeout_s), timeout_s)

    def _answer(self, message: dict[str, Any] | None, timeout_s: float) -> Any:
        if message is None:
            raise HandlerTimedOut(timeout_s)
        if message["event"] == "result":
            return message["value"]
        if "error" in message:
            raise FunctionError(message["error"])
        if message.get("code") == WORKER_EXITED:  # as Lambda reports a runtime that exited
            raise FunctionError(
                {
                    "errorType": "Runtime.ExitError",
                    "errorMessage": f"the function's process exited: {message['message']}",
                    "stackTrace": [],
                }
            )
        if message.get("code") == BadRequest.code:
            raise BadRequest(message["message"])
        raise SnapfnError(message["message"])

    def close(self) -> None:
        self.client.close()


def init_function_snapshot(
    spec: str,
    dest: Path,
    function_dir: Path | None,
    log,
    device: str = "cpu",
    cache_root: Path | None = None,
) -> Any:
    """`snapfn init --function`: the function's process snapshot, or its portable one (with the
    reason in the startup manifest) where no process image can be written. Its compile caches
    go to `function_cache_dir(spec, cache_root)`."""
    from snapfn.handler.function.user_function import check_device, function_cache_dir
    from snapfn.snapshot.process.snapshot import init_process_snapshot
    from snapfn.snapshot.process.worker_process import ProcessConfig

    check_device(device)
    config = ProcessConfig.from_env(os.environ).for_device(device)
    args = {
        "function": spec,
        "function_dir": str(Path(function_dir).absolute()) if function_dir else None,
        "device": device,
        "cache_dir": str(function_cache_dir(spec, cache_root).absolute()),
    }
    startup, _ = init_process_snapshot(HOST, args, dest, config, log)
    return startup
