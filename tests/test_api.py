"""The function API: Context, hook registration and order, SnapStart hooks, structured errors."""

from __future__ import annotations

import importlib
import sys
import textwrap
import time
import uuid

import pytest

from snapfn.handler import api
from snapfn.handler.api import (
    HOOKS_ATTR,
    Context,
    FunctionError,
    call_handler,
    load_function,
    parse_function_spec,
)
from snapfn.snapshot.errors import BadRequest, InitFailed, RestoreFailed

HOOKED = """
from snapfn.handler import api
from snapfn.handler.api import (
    after_restore, before_snapshot, init, register_after_restore, register_before_snapshot,
    register_init,
)

calls = []

def note(*args, **kwargs):
    calls.append((args, kwargs))

@init
def first_init():
    calls.append("init_1")

register_init(note, "init_2", size=2)

@before_snapshot
def before_1():
    calls.append("before_1")

register_before_snapshot(note, "before_2")

@before_snapshot
def before_3():
    calls.append("before_3")

@after_restore
def after_1():
    calls.append("after_1")

register_after_restore(note, "after_2", x=1)

@after_restore
def after_3():
    calls.append("after_3")

def handler(event, context):
    return {"echo": event, "remaining_ms": context.get_remaining_time_in_millis()}
"""

PLAIN = """
def handler(event, context):
    return 1
"""

LAMBDA_SNAPSTART = """
from snapshot_restore_py import register_after_restore, register_before_snapshot

calls = []

@register_before_snapshot
def flush():
    calls.append("srp_before_1")

def close(what):
    calls.append(f"srp_before_2:{what}")

register_before_snapshot(close, "db")

@register_after_restore
def reseed():
    calls.append("srp_after_1")

register_after_restore(lambda: calls.append("srp_after_2"))

def lambda_handler(event, context):
    return {"statusCode": 200, "body": context.aws_request_id}
"""


@pytest.fixture
def write_module(tmp_path, monkeypatch):
    """Write `source` as a fresh module on sys.path and return its name."""
    monkeypatch.syspath_prepend(str(tmp_path))
    written = []

    def write(source: str) -> str:
        name = f"fn_{uuid.uuid4().hex[:10]}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        written.append(name)
        importlib.invalidate_caches()
        return name

    yield write
    for name in written:
        sys.modules.pop(name, None)


@pytest.fixture
def srp(monkeypatch):
    """snapshot_restore_py with an empty registry (it is process-wide by design)."""
    module = pytest.importorskip("snapshot_restore_py", reason="pip install snapshot-restore-py")
    monkeypatch.setattr(module, "_before_snapshot_registry", [])
    monkeypatch.setattr(module, "_after_restore_registry", [])
    return module


# ---- Context ------------------------------------------------------------------------------------
def test_context_remaining_time_decreases_to_zero():
    ctx = Context.new("fn", timeout_s=0.2)
    first = ctx.get_remaining_time_in_millis()
    assert 150 < first <= 200
    time.sleep(0.05)
    second = ctx.get_remaining_time_in_millis()
    assert second <= first - 40
    time.sleep(0.2)
    assert ctx.get_remaining_time_in_millis() == 0


def test_context_has_a_fresh_uuid4_per_invocation():
    a, b = Context.new("fn", 1.0), Context.new("fn", 1.0)
    assert a.request_id != b.request_id
    assert uuid.UUID(a.request_id).version == 4
    assert a.aws_request_id == a.request_id and a.function_name == "fn"
    assert abs(a.invoked_at - time.time()) < 5
    assert Context.new("fn", 1.0, request_id="given").request_id == "given"


@pytest.mark.parametrize("timeout_s", [-1, float("inf"), float("nan")])
def test_context_refuses_a_bad_timeout(timeout_s):
    with pytest.raises(BadRequest, match="timeout_s"):
        Context.new("fn", timeout_s)


def test_a_zero_timeout_is_a_deadline_already_reached():
    assert Context.new("fn", 0.0).get_remaining_time_in_millis() == 0


# ---- hooks --------------------------------------------------------------------------------------
def test_hooks_run_in_order_with_their_arguments(write_module):
    fn = load_function(f"{write_module(HOOKED)}:handler")
    calls = fn.module.calls
    fn.run_init()
    assert calls == ["init_1", (("init_2",), {"size": 2})]
    calls.clear()
    fn.run_before_snapshot()  # reverse registration order
    assert calls == ["before_3", (("before_2",), {}), "before_1"]
    calls.clear()
    fn.run_after_restore()  # registration order
    assert calls == ["after_1", (("after_2",), {"x": 1}), "after_3"]


def test_hook_names_say_where_they_come_from(write_module):
    name = write_module(HOOKED)
    fn = load_function(f"{name}:handler")
    assert fn.run_init() == [f"{name}:first_init", f"{name}:note"]
    assert fn.run_before_snapshot() == [f"{name}:before_3", f"{name}:note", f"{name}:before_1"]


def test_each_module_keeps_its_own_hooks(write_module):
    a = load_function(f"{write_module(HOOKED)}:handler")
    b = load_function(f"{write_module(PLAIN)}:handler")
    assert len(a.hooks) == 8 and b.hooks == []
    b.run_init(), b.run_before_snapshot(), b.run_after_restore()
    assert a.module.calls == []


def test_decorators_return_the_function_unchanged(write_module):
    fn = load_function(f"{write_module(HOOKED)}:handler")
    assert fn.module.first_init.__name__ == "first_init"
    fn.module.first_init()
    assert fn.module.calls == ["init_1"]


def test_hooks_registered_during_init_belong_to_that_load(write_module):
    name = write_module(
        """
        from snapfn.handler.api import init, register_after_restore, register_init
        calls = []

        @init
        def connect():
            calls.append("connect")
            register_after_restore(calls.append, "reconnect")
            register_init(calls.append, "late_init")

        def handler(event, context):
            return None
        """
    )
    first, second = load_function(f"{name}:handler"), load_function(f"{name}:handler")
    first.run_init()
    assert first.module.calls == ["connect", "late_init"]  # an init hook's own init hook runs
    first.run_after_restore()
    assert first.module.calls[-1] == "reconnect"
    assert [h.phase for h in second.hooks] == ["init"]  # the module list is as declared
    assert len(getattr(first.module, HOOKS_ATTR)) == 1


def test_a_failing_hook_names_itself(write_module):
    name = write_module(
        """
        from snapfn.handler.api import after_restore, init

        @init
        def load():
            raise OSError("disk gone")

        @after_restore
        def reseed():
            raise ValueError("no entropy")

        def handler(event, context):
            return None
        """
    )
    fn = load_function(f"{name}:handler")
    with pytest.raises(InitFailed, match=f"init hook {name}:load raised OSError: disk gone"):
        fn.run_init()
    with pytest.raises(RestoreFailed, match="after_restore hook .*reseed raised ValueError"):
        fn.run_after_restore()


def test_a_hook_must_be_callable():
    from snapfn.handler.api import register_init

    with pytest.raises(TypeError, match="must be callable"):
        register_init("not a function")


# ---- snapshot_restore_py (Lambda SnapStart) -----------------------------------------------------
def test_a_lambda_snapstart_function_runs_unchanged(write_module, srp):
    fn = load_function(f"{write_module(LAMBDA_SNAPSTART)}:lambda_handler")
    calls = fn.module.calls
    fn.run_init()
    fn.run_before_snapshot()
    assert calls == ["srp_before_2:db", "srp_before_1"]  # reverse order, as awslambdaric
    calls.clear()
    fn.run_after_restore()
    assert calls == ["srp_after_1", "srp_after_2"]
    ctx = Context.new("lambda", 3.0)
    assert call_handler(fn.handler, {}, ctx) == {"statusCode": 200, "body": ctx.request_id}
    assert len(srp.get_before_snapshot()) == 2  # read, never consumed


def test_snapfn_and_snapstart_hooks_run_together(write_module, srp):
    calls = []
    srp.register_before_snapshot(calls.append, "library_before")
    srp.register_after_restore(calls.append, "library_after")
    fn = load_function(f"{write_module(HOOKED)}:handler")
    fn.module.calls = calls
    fn.run_before_snapshot()
    assert [c for c in calls if isinstance(c, str)] == ["before_3", "before_1", "library_before"]
    calls.clear()
    fn.run_after_restore()
    assert [c for c in calls if isinstance(c, str)] == ["library_after", "after_1", "after_3"]


# ---- loading ------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["app.handler", "app:", ":handler", "app:han dler", "a-b:handler"])
def test_function_spec_must_be_module_colon_function(spec):
    with pytest.raises(BadRequest, match="module:function"):
        parse_function_spec(spec)


def test_loading_reports_missing_or_non_callable_attributes(write_module):
    name = write_module("VALUE = 3\n")
    with pytest.raises(BadRequest, match="has no attribute 'handler'"):
        load_function(f"{name}:handler")
    with pytest.raises(BadRequest, match="not a callable handler"):
        load_function(f"{name}:VALUE")
    with pytest.raises(ModuleNotFoundError):
        load_function("no_such_module_here:handler")


# ---- errors -------------------------------------------------------------------------------------
def raising_handler(event, context):
    return helper_that_raises(event["n"])


def helper_that_raises(n):
    raise ZeroDivisionError(f"cannot divide {n} by zero")


def test_a_raising_handler_gives_lambdas_error_shape():
    with pytest.raises(FunctionError) as info:
        call_handler(raising_handler, {"n": 7}, Context.new("fn", 1.0))
    error = info.value.error
    assert error["errorType"] == "ZeroDivisionError"
    assert error["errorMessage"] == "cannot divide 7 by zero"
    assert "in raising_handler" in error["stackTrace"][0]
    assert "in helper_that_raises" in error["stackTrace"][-1]
    assert not any(api.__file__ in frame for frame in error["stackTrace"])
    assert info.value.code == "function_error"
    assert str(info.value) == "ZeroDivisionError: cannot divide 7 by zero"


def test_sys_exit_in_a_handler_is_an_error_not_an_exit():
    with pytest.raises(FunctionError) as info:
        call_handler(lambda e, c: sys.exit(3), {}, Context.new("fn", 1.0))
    assert info.value.error["errorType"] == "SystemExit"


def test_bad_request_from_a_handler_stays_a_bad_request():
    def refuse(event, context):
        raise BadRequest("name must be a string")

    with pytest.raises(BadRequest, match="name must be a string"):
        call_handler(refuse, {}, Context.new("fn", 1.0))


@pytest.mark.parametrize("event", [[1, 2], "text", None, 3])
def test_the_event_must_be_a_json_object(event):
    with pytest.raises(BadRequest, match="must be a JSON object"):
        call_handler(lambda e, c: e, event, Context.new("fn", 1.0))


def test_a_result_that_is_not_json_is_a_marshal_error():
    with pytest.raises(FunctionError) as info:
        call_handler(lambda e, c: {"when": object()}, {}, Context.new("fn", 1.0))
    assert info.value.error["errorType"] == "Runtime.MarshalError"
    assert "not JSON serializable" in info.value.error["errorMessage"]


def test_an_exception_whose_message_cannot_be_read_keeps_the_error_shape():
    class Unprintable(Exception):
        def __str__(self):
            raise RuntimeError("no")

    def handler(event, context):
        raise Unprintable()

    with pytest.raises(FunctionError) as info:
        call_handler(handler, {}, Context.new("fn", 1.0))
    assert info.value.error["errorType"] == "Unprintable"
    assert "could not be read" in info.value.error["errorMessage"]


def test_a_result_nested_too_deep_to_encode_is_a_marshal_error():
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(FunctionError) as info:
        call_handler(lambda e, c: {"deep": deep}, {}, Context.new("fn", 1.0))
    assert info.value.error["errorType"] == "Runtime.MarshalError"


# ---- device memory marks and the health event ----------------------------------------------------
MARKED = """
import torch
from snapfn.handler.api import health_event, init, unsaved

health_event({"probe": True})
state = {}

@init
def load():
    state["weights"] = torch.ones(1024)
    state["scratch"] = unsaved(torch.zeros(4096))

def handler(event, context):
    return {}
"""


def test_unsaved_memory_and_the_health_event_belong_to_the_module(write_module):
    fn = load_function(f"{write_module(MARKED)}:handler")
    assert fn.health_event == {"probe": True} and fn.unsaved() == []
    fn.run_init()
    scratch = fn.module.state["scratch"]
    assert fn.unsaved() == [(scratch.untyped_storage().data_ptr(), 4096 * 4)]
    other = load_function(f"{write_module(PLAIN)}:handler")
    assert other.health_event == {} and other.unsaved() == []


def test_a_health_event_must_be_a_json_object():
    from snapfn.handler.api import health_event

    with pytest.raises(TypeError, match="JSON object"):
        health_event(["not", "an", "object"])
    with pytest.raises(TypeError):
        health_event({"when": object()})


def test_device_is_what_snapfn_runs_the_function_for(monkeypatch):
    from snapfn.handler.api import device

    monkeypatch.delenv("SNAPFN_DEVICE", raising=False)
    assert device() == "cpu"
    monkeypatch.setenv("SNAPFN_DEVICE", "cuda:1")
    assert device() == "cuda:1"
