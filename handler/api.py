"""The function API: what a function author writes against.

A function is `handler(event: dict, context: Context) -> JSON-able`, as on AWS Lambda, named to
snapfn as `module:function` (any callable attribute of the module). Work around it is declared
with hooks, in three phases:

    init             runs once at cold init, before a snapshot is taken (load weights, warm up)
    before_snapshot  runs before a snapshot, in REVERSE registration order (close connections)
    after_restore    runs after a restore, in registration order (re-seed, reconnect)

Declared with decorators (`@init`, `@before_snapshot`, `@after_restore`) or plain calls
(`register_init(fn, *args, **kwargs)`, `register_before_snapshot(...)`,
`register_after_restore(...)`; these return `fn`, so they work as decorators too, exactly like
AWS's `snapshot_restore_py`).

Where hooks live (no process-global registry): a hook belongs to the module whose code
registered it. Each registration appends a `Hook` to that module's own `__snapfn_hooks__` list
(found through the caller's frame globals), so registration order is kept across decorators and
plain calls, and loading `module:function` reads exactly that module's hooks. Hooks defined in
other modules run when the function's module registers them (`register_init(lib.setup)`).
`load_function` copies the module's hooks into the `LoadedFunction` it returns; hooks registered
while init hooks run (a connection opened in init registering its own `after_restore`) are moved
into that `LoadedFunction`, so two loads of one module never share run-time registrations.

Device memory (GPU functions): `device()` is the device snapfn runs the function for ("cpu",
"cuda", from `--device` / SNAPFN_DEVICE); read it in an init hook. While the init hooks run on
CUDA, every allocation they make (on the thread that runs them) lands in a releasable pool that a
process snapshot keeps out of its image and streams back, verified, after each restore (tensors,
modules and captured graphs work unchanged). `unsaved(tensor)` marks memory the snapshot need
not keep: it comes back as zeros (a cache or a workspace re-created by every use). Memory
allocated while serving uses torch's normal allocator.

Health: `health_event(event)` declares the event `/health/generate` calls the handler with (a
real call that must succeed for the function to be healthy); without one it calls with `{}`.

SnapStart compatibility: when `snapshot_restore_py` is installed, the hooks in its registry run
too, read through its public `get_before_snapshot()` / `get_after_restore()` and never mutated.
That registry is process-wide by its own design; a worker process serves one function, so, as on
Lambda, all of it belongs to that function. Libraries register there at import, before the
function's own hooks, so the combined order is: before_snapshot = snapfn hooks reversed, then
`snapshot_restore_py` hooks reversed; after_restore = `snapshot_restore_py` hooks in order, then
snapfn hooks in order.

Errors: an exception raised by a handler becomes a `FunctionError` carrying Lambda's error shape
`{"errorType", "errorMessage", "stackTrace"}`; a `BadRequest` raised by a handler stays a
`BadRequest` (the caller's event is wrong: HTTP 400); a result that is not JSON is a
`FunctionError` of type `Runtime.MarshalError`. Any Exception (or SystemExit) from a handler comes
back as one of those two, so a worker never dies of it.

Time limit: a handler has until its context's deadline (`Context.deadline`: the invocation's
timeout). `call_handler_in_time` runs it on a thread of its own and, once the deadline passes
without an answer, raises `HandlerTimedOut`: a `FunctionError` in Lambda's shape for a function
that timed out (`{"errorType": "Sandbox.Timedout", "errorMessage": "Task timed out after 1.00
seconds"}`). A Python thread cannot be stopped, so the handler may still be running: the process
that ran it is no longer one to call again (the runtime stops, `handler/function/runtime.py`).
"""

from __future__ import annotations

import importlib
import json
import math
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from snapfn.snapshot.errors import BadRequest, InitFailed, RestoreFailed, SnapfnError

__all__ = [
    "BadRequest",
    "Context",
    "FunctionError",
    "after_restore",
    "before_snapshot",
    "device",
    "health_event",
    "init",
    "register_after_restore",
    "register_before_snapshot",
    "register_init",
    "unsaved",
]

HOOKS_ATTR = "__snapfn_hooks__"
UNSAVED_ATTR = "__snapfn_unsaved__"  # [(address, nbytes)] of memory a snapshot need not keep
HEALTH_ATTR = "__snapfn_health_event__"
DEVICE_VARIABLE = "SNAPFN_DEVICE"
PHASES = ("init", "before_snapshot", "after_restore")
Handler = Callable[[dict[str, Any], "Context"], Any]


# ---- context ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Context:
    """What a handler learns about its invocation. `deadline` is on the `time.monotonic()` clock."""

    request_id: str
    function_name: str
    deadline: float
    invoked_at: float  # unix seconds

    @classmethod
    def new(cls, function_name: str, timeout_s: float, request_id: str | None = None) -> Context:
        """A context for one invocation: a fresh uuid4 request id unless one is given.

        `timeout_s=0` is a deadline already reached: the handler sees 0 ms left (and, called
        with `call_handler_in_time`, times out at once).
        """
        if not math.isfinite(timeout_s) or timeout_s < 0:
            raise BadRequest(f"timeout_s must be a finite number of seconds >= 0, got {timeout_s}")
        return cls(
            request_id=request_id or str(uuid.uuid4()),
            function_name=function_name,
            deadline=time.monotonic() + timeout_s,
            invoked_at=time.time(),
        )

    def get_remaining_time_in_millis(self) -> int:
        return max(0, int((self.deadline - time.monotonic()) * 1000))

    @property
    def aws_request_id(self) -> str:
        """Lambda's name for `request_id`, so handlers written for Lambda run unchanged."""
        return self.request_id


# ---- hooks --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Hook:
    phase: str  # one of PHASES
    fn: Callable[..., Any]
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        module = getattr(self.fn, "__module__", None) or "?"
        return f"{module}:{getattr(self.fn, '__qualname__', repr(self.fn))}"

    def run(self) -> Any:
        return self.fn(*self.args, **self.kwargs)


def _record(phase: str, fn: Callable[..., Any], args: tuple, kwargs: dict, depth: int = 2):
    if not callable(fn):
        raise TypeError(f"a {phase} hook must be callable, got {type(fn).__name__}")
    namespace = sys._getframe(depth).f_globals  # the module whose code registers the hook
    namespace.setdefault(HOOKS_ATTR, []).append(Hook(phase, fn, tuple(args), dict(kwargs)))
    return fn


def init(fn: Callable[[], Any]) -> Callable[[], Any]:
    """Decorator: run `fn()` once at cold init, before the snapshot."""
    return _record("init", fn, (), {})


def before_snapshot(fn: Callable[[], Any]) -> Callable[[], Any]:
    """Decorator: run `fn()` before a snapshot (hooks run in reverse registration order)."""
    return _record("before_snapshot", fn, (), {})


def after_restore(fn: Callable[[], Any]) -> Callable[[], Any]:
    """Decorator: run `fn()` after a restore (hooks run in registration order)."""
    return _record("after_restore", fn, (), {})


def register_init(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
    """Run `fn(*args, **kwargs)` once at cold init; returns `fn`."""
    return _record("init", fn, args, kwargs)


def register_before_snapshot(
    fn: Callable[..., Any], *args: Any, **kwargs: Any
) -> Callable[..., Any]:
    """Run `fn(*args, **kwargs)` before a snapshot; returns `fn` (same as snapshot_restore_py)."""
    return _record("before_snapshot", fn, args, kwargs)


def register_after_restore(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
    """Run `fn(*args, **kwargs)` after a restore; returns `fn` (same as snapshot_restore_py)."""
    return _record("after_restore", fn, args, kwargs)


# ---- device memory and health -------------------------------------------------------------------
def device() -> str:
    """The device snapfn runs this function for: "cpu" or "cuda[:N]" (read it in a hook)."""
    import os

    return os.environ.get(DEVICE_VARIABLE, "cpu")


def unsaved(tensor: Any) -> Any:
    """Mark `tensor`'s memory as not worth keeping in a snapshot: after a restore it holds zeros.

    For caches and workspaces that are rebuilt by every use; returns `tensor`. Call it from the
    function's module (an init hook): the mark belongs to that module, like a hook.
    """
    storage = tensor.untyped_storage()
    mark = (int(storage.data_ptr()), int(storage.nbytes()))
    sys._getframe(1).f_globals.setdefault(UNSAVED_ATTR, []).append(mark)
    return tensor


def health_event(event: dict[str, Any]) -> dict[str, Any]:
    """Declare the event `/health/generate` invokes the handler with; returns `event`."""
    if not isinstance(event, dict):
        raise TypeError(f"a health event must be a JSON object, got {type(event).__name__}")
    json.dumps(event)  # a health event travels as JSON
    sys._getframe(1).f_globals[HEALTH_ATTR] = dict(event)
    return event


def module_hooks(module: ModuleType) -> list[Hook]:
    """The hooks `module` registered, in registration order."""
    return list(vars(module).get(HOOKS_ATTR, ()))


def snapstart_hooks(phase: str) -> list[Hook]:
    """Hooks in `snapshot_restore_py`'s registry for `phase`, in registration order."""
    try:
        import snapshot_restore_py as srp  # NOTE: optional; imported only when hooks run
    except ImportError:
        return []
    getters = {"before_snapshot": srp.get_before_snapshot, "after_restore": srp.get_after_restore}
    if phase not in getters:
        return []
    return [Hook(phase, fn, tuple(args), dict(kwargs)) for fn, args, kwargs in getters[phase]()]


# ---- loading a function -------------------------------------------------------------------------
def parse_function_spec(spec: str) -> tuple[str, str]:
    """`"pkg.module:function"` → `("pkg.module", "function")`; BadRequest if malformed."""
    module, sep, attr = spec.partition(":")
    names = [*module.split("."), *attr.split(".")]
    if not sep or not all(part.isidentifier() for part in names):
        raise BadRequest(f"name the function as module:function (e.g. app:handler), got {spec!r}")
    return module, attr


@dataclass
class LoadedFunction:
    """A handler and the hooks of its module, owned by one worker runtime."""

    name: str
    module: ModuleType
    handler: Handler
    hooks: list[Hook] = field(default_factory=list)

    def phase(self, name: str) -> list[Hook]:
        return [h for h in self.hooks if h.phase == name]

    @property
    def health_event(self) -> dict[str, Any]:
        return dict(vars(self.module).get(HEALTH_ATTR, {}))

    def unsaved(self) -> list[tuple[int, int]]:
        """The (address, nbytes) ranges the module marked with `unsaved`."""
        return list(vars(self.module).get(UNSAVED_ATTR, ()))

    def run_init(self) -> list[str]:
        """Run init hooks in registration order; keep hooks they register. InitFailed on error."""
        declared = vars(self.module).setdefault(HOOKS_ATTR, [])
        num_declared = len(declared)
        ran, pending = [], self.phase("init")
        try:
            while pending:  # an init hook may register more init hooks: they run next
                ran += _run_hooks(pending, InitFailed)
                pending = [h for h in declared[num_declared:] if h.phase == "init"]
                self.hooks += declared[num_declared:]
                del declared[num_declared:]
        finally:
            self.hooks += declared[num_declared:]
            del declared[num_declared:]
        return ran

    def run_before_snapshot(self) -> list[str]:
        """Run before-snapshot hooks: snapfn's reversed, then snapshot_restore_py's reversed."""
        hooks = self.phase("before_snapshot")[::-1] + snapstart_hooks("before_snapshot")[::-1]
        return _run_hooks(hooks, InitFailed)

    def run_after_restore(self) -> list[str]:
        """Run after-restore hooks: snapshot_restore_py's in order, then snapfn's in order."""
        hooks = snapstart_hooks("after_restore") + self.phase("after_restore")
        return _run_hooks(hooks, RestoreFailed)


def load_function(spec: str) -> LoadedFunction:
    """Import `module:function` and collect the hooks its module registered."""
    module_name, attr = parse_function_spec(spec)
    module = importlib.import_module(module_name)
    handler: Any = module
    for part in attr.split("."):
        handler = getattr(handler, part, None)
        if handler is None:
            raise BadRequest(f"module {module_name!r} has no attribute {attr!r} (from {spec!r})")
    if not callable(handler):
        raise BadRequest(f"{spec!r} is a {type(handler).__name__}, not a callable handler")
    return LoadedFunction(spec, module, handler, module_hooks(module))


def _run_hooks(hooks: list[Hook], error: type[SnapfnError]) -> list[str]:
    for hook in hooks:
        try:
            hook.run()
        except Exception as exc:
            raise error(f"{hook.phase} hook {hook.name} raised {_one_line(exc)}") from exc
    return [h.name for h in hooks]


# ---- errors and invocation ----------------------------------------------------------------------
class FunctionError(SnapfnError):
    """A handler raised. `error` is Lambda's shape: errorType, errorMessage, stackTrace."""

    code = "function_error"

    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(f"{error['errorType']}: {error['errorMessage']}".splitlines()[0])
        self.error = error

    @classmethod
    def from_exception(cls, exc: BaseException) -> FunctionError:
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename != __file__]
        try:
            message = str(exc)
        except Exception:  # noqa: BLE001 - an exception whose str() fails still gets its shape
            message = f"({type(exc).__name__} whose message could not be read)"
        return cls(
            {
                "errorType": type(exc).__name__,
                "errorMessage": message,
                "stackTrace": traceback.format_list(frames),
            }
        )


class HandlerTimedOut(FunctionError):
    """The handler did not answer within `limit_s`, its invocation's time limit: Lambda's
    error for a function that timed out. The handler may still be running."""

    TYPE = "Sandbox.Timedout"

    def __init__(self, limit_s: float) -> None:
        super().__init__(
            {
                "errorType": self.TYPE,
                "errorMessage": f"Task timed out after {limit_s:.2f} seconds",
                "stackTrace": [],
            }
        )
        self.limit_s = limit_s


def call_handler(handler: Handler, event: Any, context: Context) -> Any:
    """Call `handler(event, context)`; its errors come back as FunctionError (or BadRequest)."""
    if not isinstance(event, dict):
        raise BadRequest(f"the event must be a JSON object, got {type(event).__name__}")
    try:
        result = handler(event, context)
    except (BadRequest, FunctionError):  # FunctionError: a remote handler's, already shaped
        raise
    except BaseException as exc:  # NOTE: SystemExit (sys.exit()), KeyboardInterrupt, … too:
        # left to propagate from a request thread, one ends the worker's main loop (a gunicorn
        # worker, and the serve process with it; a restored worker's, with no answer sent)
        raise FunctionError.from_exception(exc) from exc
    _check_json(result)
    return result


def call_handler_in_time(handler: Handler, event: Any, context: Context) -> Any:
    """`call_handler` on a thread of its own, waited for until `context.deadline`; past it,
    `HandlerTimedOut`. NOTE: the thread cannot be stopped: one that overran is left running
    (a daemon thread, so that it never holds up the process's exit)."""
    limit_s = max(0.0, context.deadline - time.monotonic())
    answer: Future = Future()

    def run() -> None:
        answer.set_running_or_notify_cancel()
        try:
            answer.set_result(call_handler(handler, event, context))
        except BaseException as exc:  # call_handler's own errors, carried to the caller
            answer.set_exception(exc)

    threading.Thread(target=run, name="snapfn-handler", daemon=True).start()
    if not wait([answer], timeout=limit_s).done:
        raise HandlerTimedOut(limit_s)
    return answer.result()


def _check_json(result: Any) -> None:
    try:
        json.dumps(result)
    except (TypeError, ValueError, RecursionError) as exc:  # RecursionError: nested too deep
        raise FunctionError(
            {
                "errorType": "Runtime.MarshalError",
                "errorMessage": f"Unable to marshal response: {exc}",
                "stackTrace": [],
            }
        ) from exc


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0]
