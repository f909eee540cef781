"""WorkerRuntime: a user function and the built-in LLM brought up, invoked, failed, restored."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest

from snapfn.handler.api import FunctionError
from snapfn.handler.function.runtime import WorkerRuntime
from snapfn.handler.function.target import NotReady, ServeTarget
from snapfn.handler.llm.init_config import InitConfig
from snapfn.snapshot.errors import BadRequest, InitFailed
from snapfn.snapshot.portable.format import validate_snapshot
from snapfn.snapshot.stages import Readiness

from parity import greedy, our_engine, random_prompts

EXAMPLE = "example_function:handler"


def llm_config(tmp_path: Path) -> InitConfig:
    return InitConfig(
        page_size=4,
        max_num_batched_tokens=64,
        kv_cache_bytes_cpu=1 << 20,
        cache_dir=tmp_path / "cache",
        prewarm_threads=2,
        stream_threads=2,
    )


def started(target: ServeTarget, timeout_s: float = 120.0) -> WorkerRuntime:
    runtime = WorkerRuntime(target)
    runtime.start()
    runtime.wait_ready(timeout_s)
    return runtime


@pytest.fixture(autouse=True)
def own_import_path(monkeypatch):
    """`function_dir` goes on sys.path (as in a worker process); undo it after each test."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.startswith(("fn_", "examples")):
            del sys.modules[name]


@pytest.fixture
def example():
    """The example function module, its hook log cleared."""
    module = importlib.import_module("example_function")
    module.recorder.calls.clear()
    return module


@pytest.fixture
def function_runtime(example):
    runtime = started(ServeTarget(kind="function", function=EXAMPLE))
    yield runtime
    runtime.close()


# ---- kind="function" ----------------------------------------------------------------------------
def test_function_comes_up_after_import_and_init_hooks(function_runtime, example):
    rt = function_runtime
    assert rt.readiness.state is Readiness.UP and rt.function_name == EXAMPLE
    assert [s.name for s in rt.startup.stages] == ["runtime_env", "import_function", "init_hooks"]
    assert rt.startup.kind == "init" and rt.startup.ok
    assert rt.startup.stage("init_hooks").figures["hooks"] == [
        "example_function:load_table",
        "example_function:Recorder.note",
    ]
    assert example.recorder.calls == ["init", "init_plain:2"]


def test_invoke_builds_a_fresh_context_each_time(function_runtime):
    a = function_runtime.invoke({"key": "two"}, timeout_s=5)
    b = function_runtime.invoke({"key": "one"}, request_id="req-fixed")
    assert a["value"] == 2 and b["value"] == 1
    assert uuid.UUID(a["request_id"]).version == 4 and b["request_id"] == "req-fixed"
    assert a["function_name"] == EXAMPLE
    assert 4000 < a["remaining_ms"] <= 5000
    assert b["remaining_ms"] > 800_000  # the target's default timeout: 900 s


def test_a_raising_handler_gives_a_structured_error_and_the_worker_keeps_serving(
    function_runtime,
):
    for attempt in range(3):
        with pytest.raises(FunctionError) as info:
            function_runtime.invoke({"fail": attempt})
        assert info.value.error["errorType"] == "ValueError"
        assert info.value.error["errorMessage"] == f"asked to fail: {attempt}"
        assert "example_function.py" in info.value.error["stackTrace"][-1]
    assert function_runtime.invoke({"key": "one"})["value"] == 1
    assert function_runtime.readiness.state is Readiness.UP


@pytest.mark.parametrize("event", [[1], "x", None])
def test_invoke_refuses_an_event_that_is_not_an_object(function_runtime, event):
    with pytest.raises(BadRequest, match="JSON object"):
        function_runtime.invoke(event)


def test_snapshot_hooks_run_in_their_orders_as_timed_stages(function_runtime, example):
    example.recorder.calls.clear()
    function_runtime.prepare_snapshot()
    assert example.recorder.calls == ["before_3", "before_2:why=plain", "before_1"]
    example.recorder.calls.clear()
    names = function_runtime.after_restore()
    assert example.recorder.calls == ["after_1", "after_2", "registered_in_init"]
    assert names[0] == "example_function:reopen_first"
    stages = [s.name for s in function_runtime.startup.stages]
    assert stages == [
        "runtime_env",
        "import_function",
        "init_hooks",
        "before_snapshot",
        "after_restore",
    ]
    assert function_runtime.startup.stage("after_restore").figures["hooks"] == names


def test_health_generate_of_a_function_calls_its_handler(function_runtime):
    health = function_runtime.health_generate()  # no health event declared: called with {}
    assert health["ok"] is True and health["result"]["function_name"] == EXAMPLE


def test_health_generate_calls_the_declared_event_and_fails_with_the_handler(tmp_path):
    (tmp_path / "healthy_fn.py").write_text(
        "from snapfn.handler.api import health_event\n"
        "health_event({'probe': 1})\n"
        "def handler(event, context):\n"
        "    if event.get('probe') != 1:\n"
        "        raise RuntimeError('not the health event')\n"
        "    return {'seen': event}\n"
    )
    rt = started(ServeTarget(kind="function", function="healthy_fn:handler", function_dir=tmp_path))
    assert rt.health_generate() == {"ok": True, "result": {"seen": {"probe": 1}}}
    (tmp_path / "sick_fn.py").write_text(
        "def handler(event, context):\n    raise RuntimeError('the model is gone')\n"
    )
    sick = started(ServeTarget(kind="function", function="sick_fn:handler", function_dir=tmp_path))
    with pytest.raises(FunctionError, match="the model is gone"):
        sick.health_generate()


def test_a_missing_module_fails_with_a_reason():
    rt = started(ServeTarget(kind="function", function="no_such_module_anywhere:handler"))
    assert rt.readiness.state is Readiness.FAILED
    assert rt.readiness.reason == "ModuleNotFoundError: No module named 'no_such_module_anywhere'"
    assert not rt.startup.ok and rt.startup.stage("import_function").ok is False
    with pytest.raises(InitFailed, match="failed to start: ModuleNotFoundError"):
        rt.invoke({})


def test_the_documented_example_serves_and_renews_its_identity_after_restore():
    root = Path(__file__).resolve().parents[1]
    target = ServeTarget(kind="function", function="examples.hello:handler", function_dir=root)
    rt = started(target)
    assert rt.readiness.state is Readiness.UP, rt.readiness.reason
    first = rt.invoke({"name": "Ada", "lang": "fr"})
    assert first["message"] == "Bonjour, Ada!" and first["restores"] == 0
    rt.prepare_snapshot()
    rt.after_restore()
    second = rt.invoke({})
    assert second["message"] == "Hello, world!" and second["restores"] == 1
    assert second["instance"] != first["instance"]
    with pytest.raises(BadRequest, match="name must be a string"):
        rt.invoke({"name": 3})
    rt.close()


GATED = """
import threading
from snapfn.handler.api import init

gate = threading.Event()

@init
def wait_for_gate():
    assert gate.wait(30), "gate never opened"

def handler(event, context):
    return "served"
"""

FAILING_INIT = """
from snapfn.handler.api import init

@init
def load():
    raise RuntimeError("weights missing")

def handler(event, context):
    return None
"""


def write_function(folder: Path, source: str) -> str:
    name = f"fn_{uuid.uuid4().hex[:10]}"
    (folder / f"{name}.py").write_text(source)
    return name


def test_a_failing_init_hook_fails_the_start(tmp_path):
    name = write_function(tmp_path, FAILING_INIT)
    rt = started(ServeTarget(kind="function", function=f"{name}:handler", function_dir=tmp_path))
    assert rt.readiness.state is Readiness.FAILED
    assert "init hook" in rt.readiness.reason and "weights missing" in rt.readiness.reason
    assert rt.startup.stage("init_hooks").ok is False


def test_invocations_during_start_wait_within_their_deadline(tmp_path):
    name = write_function(tmp_path, GATED)
    rt = WorkerRuntime(
        ServeTarget(kind="function", function=f"{name}:handler", function_dir=tmp_path)
    )
    with pytest.raises(NotReady, match="never started"):
        rt.invoke({})
    rt.start()
    assert rt.readiness.state is Readiness.STARTING
    with pytest.raises(NotReady, match="still starting"):
        rt.invoke({}, timeout_s=0.05)
    threading.Timer(0.1, importlib.import_module(name).gate.set).start()
    assert rt.invoke({}, timeout_s=10) == "served"
    rt.close()
    assert rt.readiness.state is Readiness.FAILED and rt.readiness.reason == "closed"
    with pytest.raises(NotReady, match="closed"):
        rt.invoke({})


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"kind": "lambda"}, "kind must be one of"),
        ({"kind": "function"}, "needs function="),
        ({"kind": "function", "function": "app.handler"}, "module:function"),
        ({"kind": "llm", "function": "app:handler"}, 'needs kind="function"'),
        ({"kind": "function", "function": "a:b", "timeout_s": 0}, "timeout_s must be > 0"),
    ],
)
def test_serve_target_is_checked_when_built(kwargs, message):
    with pytest.raises(BadRequest, match=message):
        ServeTarget(**kwargs)


def test_importing_the_runtime_imports_no_torch():
    code = "import sys, snapfn.handler.function.runtime; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---- kind="llm" ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm_runtime(llama_with_tokenizer, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("llm")
    rt = started(ServeTarget(model_dir=llama_with_tokenizer, init_config=llm_config(tmp)))
    yield rt
    rt.close()


def test_llm_cold_init_serves_the_same_tokens_as_the_engine(llm_runtime, llama_with_tokenizer):
    assert llm_runtime.readiness.state is Readiness.UP, llm_runtime.readiness.reason
    assert llm_runtime.startup.kind == "init" and llm_runtime.startup.tier == "cold"
    assert llm_runtime.llm is not None
    prompts = random_prompts(256, [5, 11], seed=41)
    expected = our_engine(llama_with_tokenizer).generate(prompts, greedy(10))
    for prompt, want in zip(prompts, expected, strict=True):
        got = llm_runtime.invoke({"prompt_ids": prompt, "max_tokens": 10, "ignore_eos": True})
        assert got["token_ids"] == list(want.token_ids)
        assert got["logprobs"] == pytest.approx(list(want.logprobs), abs=1e-5)
        assert got["finish_reason"] == "length"
        assert got["usage"] == {
            "prompt_tokens": len(prompt),
            "completion_tokens": 10,
            "total_tokens": len(prompt) + 10,
        }


def test_llm_text_prompt_and_stop_string(llm_runtime):
    tok = llm_runtime.llm.tokenizer
    full = llm_runtime.invoke({"prompt": "hello world", "max_tokens": 12, "ignore_eos": True})
    assert full["token_ids"][:1] and full["text"] == tok.decode(full["token_ids"])
    assert (
        llm_runtime.invoke(
            {"prompt_ids": tok.encode("hello world"), "max_tokens": 12, "ignore_eos": True}
        )["token_ids"]
        == full["token_ids"]
    )
    stop = full["text"][len(full["text"]) // 2 :][:2]
    assert stop.strip(), f"the seeded model's text changed: {full['text']!r}"
    stopped = llm_runtime.invoke({"prompt": "hello world", "max_tokens": 12, "stop": stop})
    assert stopped["finish_reason"] == "stop" and stop not in stopped["text"]
    n = len(stopped["token_ids"])
    assert 0 < n < len(full["token_ids"]) and stopped["token_ids"] == full["token_ids"][:n]


def test_llm_deadline_cancels_the_generation_and_frees_its_pages(llm_runtime):
    event = {"prompt_ids": [5, 6, 7], "max_tokens": 200, "ignore_eos": True}
    with pytest.raises(FunctionError) as info:
        llm_runtime.invoke(event, timeout_s=0.001)
    assert info.value.error["errorType"] == "TimeoutError"
    for _ in range(200):
        if llm_runtime.llm.kv_usage() == 0.0:
            break
        threading.Event().wait(0.01)
    assert llm_runtime.llm.kv_usage() == 0.0
    assert (
        llm_runtime.invoke({"prompt_ids": [5], "max_tokens": 1})["usage"]["completion_tokens"] == 1
    )


@pytest.mark.parametrize(
    "event, message",
    [
        ({}, "exactly one of prompt, prompt_ids, messages"),
        ({"prompt": "a", "prompt_ids": [1]}, "exactly one of"),
        ({"prompt": 3}, "prompt must be a string"),
        ({"prompt_ids": [1, "2"]}, "list of integer token ids"),
        ({"prompt_ids": [1, True]}, "list of integer token ids"),
        ({"prompt_ids": []}, "the prompt is empty"),
        ({"prompt_ids": [999]}, "out of range"),
        ({"prompt_ids": [1] * 5000}, "max_req_input_len"),
        ({"prompt_ids": [1], "max_tokens": 0}, "max_tokens must be >= 1"),
        ({"prompt_ids": [1], "max_tokens": "8"}, "max_tokens must be int"),
        ({"prompt_ids": [1], "temperature": -1}, "temperature must be in"),
        ({"prompt_ids": [1], "top_p": 0}, "top_p must be in"),
        ({"prompt_ids": [1], "stop": [1]}, "stop must be a string or a list"),
        ({"prompt_ids": [1], "seed": 1.5}, "seed must be an integer"),
        ({"prompt_ids": [1], "max_new_tokens": 3}, "unknown field.*max_new_tokens"),
        ({"prompt_ids": [1], "chat": True}, "chat applies to prompt or messages"),
        ({"prompt": "hi", "chat": True}, "no chat template"),
        ({"messages": [{"role": "user"}]}, r"messages\[0\] must be an object"),
        ({"messages": []}, "non-empty list"),
    ],
)
def test_llm_bad_events_say_what_to_fix(llm_runtime, event, message):
    with pytest.raises(BadRequest, match=message):
        llm_runtime.invoke(event)


def test_llm_seeded_sampling_is_reproducible(llm_runtime):
    event = {
        "prompt_ids": [3, 4, 5],
        "max_tokens": 8,
        "temperature": 1.0,
        "seed": 7,
        "ignore_eos": True,
    }
    assert llm_runtime.invoke(event)["token_ids"] == llm_runtime.invoke(event)["token_ids"]


def test_llm_health_generate_runs_one_token_through_the_service(llm_runtime):
    before = llm_runtime.llm.stats.finished
    health = llm_runtime.health_generate()
    assert health["ok"] is True and isinstance(health["token"], int)
    assert health["token"] == llm_runtime.startup.stage("health_check").figures["token"]
    assert llm_runtime.llm.stats.finished == before + 1


def test_llm_has_no_process_snapshot_hooks(llm_runtime):
    assert llm_runtime.prepare_snapshot() == [] and llm_runtime.after_restore() == []


def test_llm_snapshot_is_written_then_restored(llama_with_tokenizer, tmp_path):
    snap, config = tmp_path / "snap", llm_config(tmp_path)
    event = {"prompt_ids": [7, 8, 9, 10], "max_tokens": 8, "ignore_eos": True}
    first = started(
        ServeTarget(model_dir=llama_with_tokenizer, snapshot_dir=snap, init_config=config)
    )
    assert first.readiness.state is Readiness.UP, first.readiness.reason
    assert first.startup.kind == "init" and first.startup.stages[-1].name == "write_snapshot"
    validate_snapshot(snap, None, verify="full")
    cold = first.invoke(event)
    first.close()
    second = started(ServeTarget(snapshot_dir=snap, init_config=config))  # no model_dir needed
    assert second.readiness.state is Readiness.UP, second.readiness.reason
    assert second.startup.kind == "restore" and second.startup.tier == "portable"
    assert not second.startup.fallbacks
    assert second.invoke(event) == cold
    second.close()


def test_an_empty_snapshot_dir_is_filled_by_a_cold_init(llama_with_tokenizer, tmp_path):
    snap = tmp_path / "empty"
    snap.mkdir()
    rt = started(
        ServeTarget(
            model_dir=llama_with_tokenizer, snapshot_dir=snap, init_config=llm_config(tmp_path)
        )
    )
    assert rt.startup.kind == "init" and rt.readiness.state is Readiness.UP
    validate_snapshot(snap, None)
    rt.close()


def test_a_corrupt_snapshot_falls_back_to_a_cold_init_and_is_rewritten(
    llama_with_tokenizer, tmp_path
):
    snap, config = tmp_path / "snap", llm_config(tmp_path)
    started(
        ServeTarget(model_dir=llama_with_tokenizer, snapshot_dir=snap, init_config=config)
    ).close()
    weights = snap / "weights/rank0.bin"
    data = bytearray(weights.read_bytes())
    data[100] ^= 0x40
    weights.write_bytes(bytes(data))
    rt = started(ServeTarget(snapshot_dir=snap, init_config=config))  # source from the manifest
    assert rt.readiness.state is Readiness.UP, rt.readiness.reason
    assert rt.startup.tier == "cold (fallback)"
    (fallback,) = rt.startup.fallbacks
    assert fallback["step"] == "stream_weights" and fallback["from"] == "portable"
    assert rt.invoke({"prompt_ids": [1, 2], "max_tokens": 2})["usage"]["completion_tokens"] >= 1
    validate_snapshot(snap, None, verify="full")  # rewritten
    rt.close()


def test_a_broken_model_dir_fails_with_a_reason(llama_with_tokenizer, tmp_path):
    broken = Path(shutil.copytree(llama_with_tokenizer, tmp_path / "broken"))
    (broken / "config.json").write_text("{not json")
    rt = started(ServeTarget(model_dir=broken, init_config=llm_config(tmp_path)))
    assert rt.readiness.state is Readiness.FAILED
    assert rt.readiness.reason and "\n" not in rt.readiness.reason
    assert rt.startup.ok is False and rt.startup.info["error"] == rt.readiness.reason
    assert any("FAILED" in line for line in rt.startup.info["log"])
    assert rt.llm is None
    with pytest.raises(InitFailed, match="failed to start"):
        rt.invoke({"prompt_ids": [1]})
    with pytest.raises(InitFailed):
        rt.health_generate()
    reason = rt.readiness.reason
    rt.close()
    assert rt.readiness.state is Readiness.FAILED and rt.readiness.reason == reason


def test_a_snapshot_without_a_known_model_fails_when_it_cannot_fall_back(tmp_path):
    snap = tmp_path / "junk"
    snap.mkdir()
    (snap / "manifest.json").write_text("{not json")
    rt = started(ServeTarget(snapshot_dir=snap, init_config=llm_config(tmp_path)))
    assert rt.readiness.state is Readiness.FAILED
    assert "no trustworthy source for a cold init" in rt.readiness.reason
    assert "falling back" not in " ".join(rt.startup.info["log"])
    assert rt.fatal is not None and rt.fatal.code == "no_trusted_source"
    assert rt.startup.kind == "restore"
