"""A function's time limit, and the replacement of a worker whose runtime stopped.

- A tier-0 handler (called in the worker's own process) that runs past its invocation's
  deadline: the caller gets Lambda's timeout error (`Sandbox.Timedout`, "Task timed out after
  N.NN seconds") at the deadline, and the runtime stops ("the handler overran its N s limit"):
  the handler's thread cannot be stopped, so nothing more is called in that process. A tier-1
  call with no answer by its deadline gets the same error, and the restored worker is killed.
- `snapfn serve`: a gunicorn worker whose runtime stopped after it was up (a handler overran, a
  restored worker process died) answers 503 "stopped" for a moment, then exits; gunicorn starts
  another worker, which starts (or restores) again.
- `snapfn worker`: a job whose handler overran is given back to the queue, and the worker
  drains and exits non-zero for its supervisor to start a fresh one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import requests
from test_probe_serve_edges import init_function_snapshot, pid_when_up, serve_function

from snapfn.handler.api import Context, FunctionError, HandlerTimedOut
from snapfn.handler.function.host import RemoteHandler
from snapfn.handler.function.runtime import RuntimeStopped, WorkerRuntime
from snapfn.handler.function.target import ServeTarget
from snapfn.handler.http.app import create_app
from snapfn.handler.http.serve_config import ServeConfig
from snapfn.snapshot.stages import Readiness

from moto_server import FAKE_AWS_ENV, MotoServer, make_queue, queue_counts, wait_for

LIMIT_S = 1.0
# in this test process a spinning handler must end with its test: `release` ends it
RELEASABLE = """
import os
import threading

from snapfn.handler.api import health_event

release = threading.Event()
health_event({"spin": True})


def handler(event, context):
    if event.get("fail"):
        raise ValueError("bad event")
    while event.get("spin") and not release.is_set():
        pass
    return {"pid": os.getpid(), "left_ms": context.get_remaining_time_in_millis()}
"""
# in a server or worker subprocess: spins for good
RUNAWAY = """
import os


def handler(event, context):
    if event.get("spin"):
        while True:
            pass
    return {"pid": os.getpid()}
"""


@pytest.fixture
def releasable(tmp_path, monkeypatch):
    """A started tier-0 runtime of RELEASABLE (its log lines in `.lines`); spinning handlers
    are released, and the runtime closed, when the test ends."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    name = f"fn_{uuid.uuid4().hex[:10]}"
    (tmp_path / f"{name}.py").write_text(RELEASABLE)
    lines: list[str] = []
    target = ServeTarget(kind="function", function=f"{name}:handler", function_dir=tmp_path)
    runtime = WorkerRuntime(target, log=lines.append)
    runtime.start(background=False)
    assert runtime.readiness.state is Readiness.UP, runtime.readiness.reason
    runtime.lines = lines
    try:
        yield runtime
    finally:
        sys.modules[name].release.set()
        runtime.close()
        sys.modules.pop(name, None)


def answered(call, wait_s: float = LIMIT_S + 5) -> tuple[object, float]:
    """What `call()` returned or raised, and the seconds it took; fails if it has not
    returned within `wait_s` (the call is left on its thread)."""
    outcome: list[object] = []
    started = time.monotonic()

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(wait_s)
    assert outcome, f"no answer within {wait_s:g} s"
    return outcome[0], time.monotonic() - started


def timed_out(call) -> tuple[FunctionError, float]:
    """The FunctionError `call()` raised (within a few seconds), and the seconds it took."""
    exc, took_s = answered(call)
    assert isinstance(exc, FunctionError), exc
    return exc, took_s


def assert_timeout_error(error: dict, took_s: float, limit_s: float = LIMIT_S) -> None:
    assert error == {
        "errorType": "Sandbox.Timedout",
        "errorMessage": f"Task timed out after {limit_s:.2f} seconds",
        "stackTrace": [],
    }
    assert limit_s - 0.05 < took_s < limit_s + 2, took_s


# ---- tier 0, in process -------------------------------------------------------------------
def test_a_handler_past_its_deadline_times_out_and_stops_the_runtime(releasable):
    runtime = releasable
    assert runtime.invoke({}, timeout_s=LIMIT_S)["left_ms"] > 0  # in time: served
    with pytest.raises(FunctionError, match="bad event"):  # its own error: still served
        runtime.invoke({"fail": True}, timeout_s=LIMIT_S)
    assert not runtime.stopped and not runtime.wait_stopped(0)
    exc, took_s = timed_out(lambda: runtime.invoke({"spin": True}, timeout_s=LIMIT_S))
    assert isinstance(exc, HandlerTimedOut)
    assert_timeout_error(exc.error, took_s)
    assert runtime.stopped and runtime.wait_stopped(0)
    assert runtime.readiness.state is Readiness.FAILED
    assert runtime.readiness.reason == "the handler overran its 1 s limit"
    with pytest.raises(RuntimeStopped, match="stopped: the handler overran its 1 s limit"):
        runtime.invoke({})
    said = "\n".join(runtime.lines)
    assert "stopped: the handler overran its 1 s limit" in said
    assert "failed to start" not in said


def test_a_health_call_past_its_limit_stops_the_runtime_too(releasable):
    exc, took_s = timed_out(lambda: releasable.health_generate(timeout_s=0.5))
    assert_timeout_error(exc.error, took_s, 0.5)
    assert releasable.stopped
    assert releasable.readiness.reason == "the handler overran its 0.5 s limit"


def test_over_http_the_timeout_is_a_function_error_then_503_stopped(releasable):
    config = ServeConfig(model_name="fn", invoke_timeout_s=LIMIT_S)
    client = create_app(releasable, config).test_client()
    assert client.post("/invoke", json={}).status_code == 200
    r, took_s = answered(lambda: client.post("/invoke", json={"spin": True}))
    assert r.status_code == 500 and r.headers["X-Snapfn-Function-Error"] == "Unhandled"
    assert_timeout_error(r.json, took_s)
    r = client.post("/invoke", json={})
    assert r.status_code == 503 and "Retry-After" not in r.headers, r.json
    assert r.json["error"]["code"] == "stopped"
    assert r.json["error"]["message"] == "the worker stopped: the handler overran its 1 s limit"
    health = client.get("/health")
    assert health.status_code == 503 and health.json["status"] == "failed"


# ---- tier 1: the restored worker's answer --------------------------------------------------
class SilentClient:
    """A restored worker's client that never answers: what it was asked, and for how long."""

    def __init__(self) -> None:
        self.calls: list[tuple[dict, float | None]] = []

    def call(self, message: dict, timeout_s: float | None) -> None:
        self.calls.append((message, timeout_s))
        time.sleep(timeout_s or 0)
        return None


def test_a_restored_worker_silent_past_the_deadline_is_the_same_timeout_error():
    client = SilentClient()
    context = Context.new("fn", LIMIT_S)
    exc, took_s = timed_out(lambda: RemoteHandler(client)({"x": 1}, context))
    assert isinstance(exc, HandlerTimedOut)
    assert_timeout_error(exc.error, took_s)
    (message, waited_s), *_ = client.calls
    assert message["op"] == "invoke" and LIMIT_S - 0.05 < waited_s <= LIMIT_S  # the deadline
    assert abs(message["timeout_s"] - waited_s) < 1e-9  # the worker's context: the same


@pytest.fixture
def tier1_snapshot(tmp_path, criu_config):
    """A process snapshot of RUNAWAY (`snapfn init --function`): (function folder, snapshot)."""
    return init_function_snapshot(tmp_path, RUNAWAY)


def test_a_tier1_handler_past_its_deadline_stops_the_runtime_and_its_worker(tier1_snapshot):
    folder, snapshot = tier1_snapshot
    target = ServeTarget(
        kind="function", function="edge_fn:handler", function_dir=folder, snapshot_dir=snapshot
    )
    runtime = WorkerRuntime(target)
    runtime.start(background=False)
    try:
        assert runtime.startup.tier == "process", runtime.readiness.reason
        worker = runtime._remote.client.worker
        assert runtime.invoke({}, timeout_s=LIMIT_S)["pid"]
        exc, took_s = timed_out(lambda: runtime.invoke({"spin": True}, timeout_s=LIMIT_S))
        assert_timeout_error(exc.error, took_s)
        assert runtime.stopped
        assert runtime.readiness.reason == "the handler overran its 1 s limit"
        wait_for(lambda: not Path(f"/proc/{worker.pid}").exists(), 10, "the worker killed")
        with pytest.raises(RuntimeStopped, match="overran its 1 s limit"):
            runtime.invoke({})
    finally:
        runtime.close()


# ---- snapfn serve: the worker whose runtime stopped is replaced ----------------------------
def new_worker_answers(server, old_pid: int, timeout_s: float = 60) -> int:
    """The pid of the worker answering once it is another than `old_pid`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pid = pid_when_up(server, timeout_s=deadline - time.monotonic())
        if pid != old_pid:
            return pid
        time.sleep(0.05)
    pytest.fail(f"worker {old_pid} was not replaced; log:\n{server.log_path.read_text()[-3000:]}")


@pytest.mark.slow
@pytest.mark.parametrize("worker_class", ["gthread", "sync"])
def test_serve_times_a_runaway_handler_out_and_replaces_its_worker(tmp_path, worker_class):
    env = {"SNAPFN_INVOKE_TIMEOUT_S": str(LIMIT_S)}
    if worker_class == "sync":
        env["GUNICORN_CMD_ARGS"] = "--worker-class sync"
    server = serve_function(tmp_path, RUNAWAY, **env)
    try:
        old = pid_when_up(server)
        assert server.workers() == [old]
        started = time.monotonic()
        r = requests.post(f"{server.url}/invoke", json={"spin": True}, timeout=LIMIT_S + 5)
        assert r.status_code == 500, r.text
        assert_timeout_error(r.json(), time.monotonic() - started)
        r = requests.post(f"{server.url}/invoke", json={}, timeout=30)  # meanwhile: stopped
        assert r.status_code == 503 and r.json()["error"]["code"] == "stopped", r.text
        new = new_worker_answers(server, old)
        assert server.workers() == [new] and not Path(f"/proc/{old}").exists()
        log = server.log_path.read_text()
        assert f"[{old}] the runtime stopped (the handler overran its 1 s limit)" in log
        assert "Shutting down" not in log and server.proc.poll() is None
    finally:
        server.stop()


def restored_workers(folder: Path) -> list[int]:
    """The pids of the running function workers (`python -m snapfn.snapshot.process.worker`)
    whose command line names `folder`: a restored worker keeps the checkpointed one's."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        named = any(str(folder).encode() in arg for arg in argv)
        if argv[1:3] == [b"-m", b"snapfn.snapshot.process.worker"] and named and state != "Z":
            pids.append(int(entry.name))
    return pids


@pytest.mark.slow
def test_serve_replaces_a_worker_whose_restored_process_was_killed(tier1_snapshot):
    folder, snapshot = tier1_snapshot
    server = serve_function(folder, RUNAWAY, "--snapshot", str(snapshot))
    try:
        pid_when_up(server)
        (old,) = server.workers()
        assert requests.get(f"{server.url}/startup", timeout=10).json()["tier"] == "process"
        (restored,) = restored_workers(folder)
        os.kill(restored, signal.SIGKILL)
        health = lambda: requests.get(f"{server.url}/health", timeout=10).json()  # noqa: E731
        wait_for(lambda: health()["status"] == "failed", 10, "the runtime stopped")
        r = requests.post(f"{server.url}/invoke", json={}, timeout=30)  # meanwhile: stopped
        assert r.status_code == 503 and r.json()["error"]["code"] == "stopped", r.text
        wait_for(lambda: server.workers() not in ([], [old]), 30, "a new gunicorn worker")
        pid_when_up(server)
        (new,) = server.workers()
        assert new != old
        startup = requests.get(f"{server.url}/startup", timeout=10).json()
        assert (startup["kind"], startup["tier"]) == ("restore", "process")
        log = server.log_path.read_text()
        assert f"[{old}] the runtime stopped (worker process exited" in log
        assert "Shutting down" not in log and server.proc.poll() is None
    finally:
        server.stop()


# ---- snapfn worker: the job is given back, the worker exits --------------------------------
@pytest.mark.slow
def test_a_queue_worker_gives_an_overrun_job_back_and_exits(tmp_path):
    (tmp_path / "edge_fn.py").write_text(RUNAWAY)
    names = f"t{uuid.uuid4().hex[:12]}"
    with MotoServer() as aws:
        sqs, s3 = aws.client("sqs"), aws.client("s3")
        s3.create_bucket(Bucket=names)
        queue_url, _ = make_queue(sqs, names, max_receive_count=3)
        body = {"id": "spin", "event": {"spin": True}, "result": {"s3": f"s3://{names}/r/"}}
        sqs.send_message(QueueUrl=queue_url, MessageBody=json.dumps(body))
        argv = [sys.executable, "-m", "snapfn.handler.cli", "worker", "--queue-url", queue_url]
        argv += ["--endpoint-url", aws.endpoint_url, "--wait-time-s", "1"]
        argv += ["--job-timeout-s", str(LIMIT_S), "--retry-delay-s", "3"]
        argv += ["--function", "edge_fn:handler", "--function-dir", str(tmp_path)]
        env = {**os.environ, **FAKE_AWS_ENV, "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
        lines: list[str] = []
        threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
        try:
            assert proc.wait(timeout=30) == 2, "".join(lines)
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
        said = "".join(lines)
        assert "job spin failed: HandlerTimedOut: Sandbox.Timedout: Task timed out" in said
        assert "the runtime stopped (the handler overran its 1 s limit)" in said
        assert "error [runtime_stopped]: edge_fn:handler stopped: the handler overran" in said
        assert s3.list_objects_v2(Bucket=names).get("KeyCount", 0) == 0  # nothing written
        wait_for(lambda: queue_counts(sqs, queue_url) == (1, 0), 15, "the job back in the queue")
        back = sqs.receive_message(QueueUrl=queue_url, WaitTimeSeconds=1)["Messages"]
        assert [json.loads(m["Body"])["id"] for m in back] == ["spin"]
