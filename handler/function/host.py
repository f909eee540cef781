"""A user's Lambda-style function as a process-snapshot host (tier 1), and its remote handler.

    snapfn init --function mod:handler --snapshot DIR      (FunctionHost in a checkpointable worker)
    snapfn serve --function mod:handler --snapshot DIR     (RemoteHandler → the restored worker)

The worker imports the function and runs its init hooks (cold init), then, before the dump,
its before-snapshot hooks (snapfn's in reverse registration order, then `snapshot_restore_py`'s
in reverse); after each restore, `identity.refresh()` (fresh RNG seeds) and its after-restore
hooks in registration order; then it answers {"op": "invoke", "event", "timeout_s",
"request_id"} with the handler's JSON result, or the Lambda-shaped error of FunctionError.
There is no GPU step and no portable tier: a failed restore falls back to a cold init.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from snapfn.handler.api import (
    Context,
    FunctionError,
    call_handler,
    cold_start_function,
    cold_start_manifest,
)
from snapfn.snapshot.errors import BadRequest, SnapfnError
from snapfn.snapshot.stages import StageRunner, StartupManifest

USER_FUNCTION = "user_function"  # its section's key in manifest.json


class FunctionHost:
    uses_cuda = False

    def __init__(self, args: dict[str, Any]) -> None:
        self.spec = args["function"]
        self.function_dir = args.get("function_dir")
        self.loaded = None

    def init(self) -> dict[str, Any]:
        from snapfn.snapshot.portable.compat import compat_key

        startup = cold_start_manifest(self.spec)
        self.loaded = cold_start_function(startup, self.spec, self.function_dir)
        return {
            "function": USER_FUNCTION,
            "startup": startup.to_json(),
            "compat": compat_key("cpu", 1, light=True),
            "section": {"spec": self.spec, "function_dir": self.function_dir},
        }

    def before_snapshot(self) -> list[str]:
        return self.loaded.run_before_snapshot()

    def after_restore(self, resume: dict[str, Any]) -> dict[str, Any]:
        runner = StageRunner(StartupManifest(kind="restore", tier="process"), clock=time.time)
        t0 = time.time()
        runner.run("after_restore", lambda f: f.update(hooks=self.loaded.run_after_restore()))
        return {"t0": t0, "stages": [_record(s) for s in runner.manifest.stages]}

    def handle(self, message: dict[str, Any], send) -> None:
        if message["op"] != "invoke":
            raise ValueError(f"unknown op {message['op']!r}")
        rid = message["id"]
        context = Context.new(self.spec, float(message["timeout_s"]), message.get("request_id"))
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


def _record(stage: Any) -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(stage)


class RemoteHandler:
    """`handler(event, context)` that invokes the function in a restored worker."""

    def __init__(self, client: Any) -> None:
        self.client = client

    def __call__(self, event: dict, context: Context) -> Any:
        timeout_s = context.get_remaining_time_in_millis() / 1000
        invoke = {"op": "invoke", "event": event, "timeout_s": timeout_s}
        message = self.client.call({**invoke, "request_id": context.aws_request_id}, timeout_s + 5)
        if message is None:
            raise FunctionError(
                {
                    "errorType": "Runtime.Timeout",
                    "errorMessage": f"no answer from the function within {timeout_s:.0f} s",
                    "stackTrace": [],
                }
            )
        if message["event"] == "result":
            return message["value"]
        if "error" in message:
            raise FunctionError(message["error"])
        if message.get("code") == BadRequest.code:
            raise BadRequest(message["message"])
        raise SnapfnError(message["message"])

    def close(self) -> None:
        self.client.close()


def init_function_snapshot(spec: str, dest: Path, function_dir: Path | None, log) -> Any:
    """`snapfn init --function`: the function's process snapshot (there is no portable tier)."""
    import os

    from snapfn.snapshot.process.snapshot import init_process_snapshot
    from snapfn.snapshot.process.worker_process import ProcessConfig

    args = {"function": spec, "function_dir": str(function_dir) if function_dir else None}
    config = ProcessConfig.from_env(os.environ)
    startup, _ = init_process_snapshot("snapfn.handler.function.host:make", args, dest, config, log)
    return startup
