"""Edges of `snapfn serve` (handler/http/): a worker dying after it was up, clients that trickle
their requests, and a tier-1 function worker that stops after it was up.

- A function calling `os._exit(3)` or `os._exit(4)` (gunicorn's boot-error codes) ends the
  gunicorn worker that runs it: the arbiter replaces that worker, as any dead one, instead of
  stopping the server (`arbiter.py`); a worker whose start fails still stops it.
- A request's headers and body must arrive within `receive_timeout_s` (`receive_deadline.py`):
  a client that trickles them gets a JSON 408 and the connection closes, the worker's thread
  (or, with the sync worker, the worker) freed; slow answers and kept-alive connections are not
  cut.
- A restored (tier-1) function worker that exits after it was up leaves the runtime "stopped",
  not "failed to start": in the 503s, the runtime's error and the log.
"""

from __future__ import annotations

import http.client
import json
import select
import socket
import subprocess
import sys
import time
import uuid
from contextlib import closing
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import requests

from snapfn.handler.function.runtime import RuntimeStopped, WorkerRuntime
from snapfn.handler.function.target import ServeTarget
from snapfn.handler.http.app import create_app
from snapfn.handler.http.receive_deadline import DeadlineSocket, ReceiveTimeout
from snapfn.handler.http.serve_config import ServeConfig
from snapfn.snapshot.stages import Readiness

from test_serve_e2e import Server, metric_samples

EXITING = """
import os
import time


def handler(event, context):
    if "exit" in event:
        os._exit(event["exit"])
    time.sleep(event.get("sleep_s", 0))
    return {"pid": os.getpid()}
"""
FAILING_INIT = """
from snapfn.handler.api import init


@init
def load_weights():
    raise RuntimeError("weights missing")


def handler(event, context):
    return {}
"""
RECEIVE_TIMEOUT_S = 1.0


def serve_function(tmp_path, source: str, *args: str, **env: str) -> Server:
    (tmp_path / "edge_fn.py").write_text(source)
    return Server(
        ["--function", "edge_fn:handler", "--function-dir", str(tmp_path), *args], tmp_path, **env
    )


def pid_when_up(server: Server, timeout_s: float = 60) -> int:
    """The pid of the worker answering /invoke once one does; fails if the server exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert server.proc.poll() is None, server.log_path.read_text()[-3000:]
        try:
            r = requests.post(f"{server.url}/invoke", json={}, timeout=10)
        except requests.ConnectionError:
            r = None
        if r is not None and r.status_code == 200:
            return r.json()["pid"]
        time.sleep(0.05)
    pytest.fail(f"no worker came up; log:\n{server.log_path.read_text()[-3000:]}")


# ---- a worker that was up and exits ---------------------------------------------------------
@pytest.mark.slow
def test_a_worker_that_was_up_and_exits_with_a_boot_error_code_is_replaced(tmp_path):
    server = serve_function(tmp_path, EXITING, "--workers", "1")
    try:
        pids = [pid_when_up(server)]
        for code in (3, 4):  # gunicorn's WORKER_BOOT_ERROR, APP_LOAD_ERROR
            with pytest.raises(requests.ConnectionError):
                requests.post(f"{server.url}/invoke", json={"exit": code}, timeout=30)
            pids.append(pid_when_up(server))
        assert len(set(pids)) == 3 and server.workers() == [pids[-1]]
        log = server.log_path.read_text()
        for code in (3, 4):
            assert f"exited with code {code} after it was up (not a failed boot)" in log
        assert "Shutting down" not in log
        samples = metric_samples(server.url)
        assert samples[("snapfn_readiness", (("state", "up"),))] == 1  # the dead ones' left
        invoked = ("snapfn_http_requests_total", (("endpoint", "/invoke"), ("method", "POST")))
        assert samples[(invoked[0], (*invoked[1], ("status", "200")))] >= 3  # theirs kept
    finally:
        server.stop()


@pytest.mark.slow
def test_a_worker_whose_start_fails_still_stops_the_server(tmp_path):
    server = serve_function(tmp_path, FAILING_INIT, SNAPFN_FAILED_START_EXIT_S="0")
    assert server.proc.wait(timeout=60) == 3, server.log_path.read_text()[-3000:]
    log = server.log_path.read_text()
    assert "start failed" in log and "weights missing" in log
    assert "Worker failed to boot" in log and "after it was up" not in log


# ---- the receive deadline -------------------------------------------------------------------
def trickle(url: str, head: bytes, for_s: float = 8.0) -> tuple[http.client.HTTPResponse, float]:
    """Send `head`, then one more byte every 0.1 s until the server answers (at most `for_s`);
    the answer, read whole, and the seconds it took."""
    address = urlsplit(url)
    with socket.create_connection((address.hostname, address.port), timeout=5) as sock:
        sock.sendall(head)
        started = time.monotonic()
        while time.monotonic() - started < for_s:
            if select.select([sock], [], [], 0.1)[0]:
                break
            sock.sendall(b"a")
        response = http.client.HTTPResponse(sock)
        response.begin()
        response.body = response.read()
        return response, time.monotonic() - started


def assert_request_timeout(response: http.client.HTTPResponse, took_s: float) -> None:
    assert response.status == 408, response.body
    assert response.getheader("Content-Type") == "application/json"
    error = json.loads(response.body)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "request_timeout"
    assert f"did not arrive within {RECEIVE_TIMEOUT_S:g} s" in error["message"]
    assert RECEIVE_TIMEOUT_S - 0.2 < took_s < RECEIVE_TIMEOUT_S + 3


@pytest.fixture(scope="module", params=["gthread", "sync"])
def one_thread_server(request, tmp_path_factory):
    """A function server with one thread (gthread), or gunicorn's sync worker: one client
    reading a request holds everything."""
    workdir = tmp_path_factory.mktemp(f"deadline-{request.param}")
    env = {"SNAPFN_RECEIVE_TIMEOUT_S": str(RECEIVE_TIMEOUT_S)}
    if request.param == "sync":
        env["GUNICORN_CMD_ARGS"] = "--worker-class sync"
    server = serve_function(workdir, EXITING, "--threads", "1", **env)
    pid_when_up(server)
    yield server
    server.stop()


@pytest.mark.slow
def test_trickled_headers_get_a_408_and_free_the_worker(one_thread_server):
    url = one_thread_server.url
    response, took_s = trickle(url, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    assert_request_timeout(response, took_s)
    assert response.getheader("Connection") == "close"
    assert requests.get(f"{url}/health", timeout=5).status_code == 200


@pytest.mark.slow
def test_a_trickled_body_gets_a_408_and_frees_the_worker(one_thread_server):
    url = one_thread_server.url
    head = b"POST /invoke HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    response, took_s = trickle(url, head + b"Content-Length: 1000\r\n\r\n{")
    assert_request_timeout(response, took_s)
    assert requests.post(f"{url}/invoke", json={}, timeout=5).status_code == 200
    assert "did not arrive within" in one_thread_server.log_path.read_text()


@pytest.mark.slow
def test_an_answer_slower_than_the_deadline_and_kept_alive_connections_are_not_cut(
    one_thread_server,
):
    url = one_thread_server.url
    with requests.Session() as session:
        slow = session.post(f"{url}/invoke", json={"sleep_s": 2 * RECEIVE_TIMEOUT_S}, timeout=30)
        assert slow.status_code == 200, slow.text
        time.sleep(1.5 * RECEIVE_TIMEOUT_S)  # idle on a kept-alive connection (gthread)
        assert session.post(f"{url}/invoke", json={}, timeout=30).status_code == 200


def test_a_deadline_socket_times_blocking_reads_only():
    ours, theirs = socket.socketpair()
    with closing(DeadlineSocket.adopt(ours)) as sock, closing(theirs):
        sock.arm(0.3, at_first_read=True)
        time.sleep(0.4)  # the clock starts at the first read
        theirs.sendall(b"ab")
        assert sock.recv(1) == b"a"
        started = time.monotonic()
        with pytest.raises(ReceiveTimeout):
            while True:
                assert sock.recv(1)
                theirs.sendall(b"c")  # a byte now and then
                time.sleep(0.05)
        assert time.monotonic() - started < 0.5
        sock.settimeout(0.1)  # a read under its own timeout keeps it (a drain, a close)
        with pytest.raises(TimeoutError):
            while sock.recv(1024):
                pass
        sock.settimeout(None)
        assert sock.disarm() is True  # the deadline had passed
        theirs.sendall(b"d")
        assert sock.recv(1) == b"d"  # disarmed: untimed
        sock.arm(0.2)
        assert sock.gettimeout() is None
        with pytest.raises(ReceiveTimeout):
            sock.recv(1)
        assert sock.gettimeout() is None  # blocking again, for gunicorn's writes


def test_an_up_worker_reaped_by_gunicorn_itself_is_replaced_not_a_halt(monkeypatch):
    """The exit lands after the arbiter's own pass (skipped here), so gunicorn's reaps it: the
    worker was up, so it is replaced, not a halt. An unmarked one still halts the server."""
    import os

    from gunicorn.errors import HaltServer

    from snapfn.handler.http.arbiter import SnapfnArbiter, UpMark

    class Worker:
        def __init__(self, up: bool) -> None:
            self.up_mark = UpMark()
            if up:
                self.up_mark.set()
            self.tmp = type("Tmp", (), {"close": lambda self: None})()

    exits: list[int] = []
    arbiter = SnapfnArbiter.__new__(SnapfnArbiter)
    arbiter.reexec_pid = arbiter.dirty_arbiter_pid = 0
    arbiter.log = type("Log", (), {"error": print, "warning": print, "debug": print})()
    arbiter.cfg = type("Cfg", (), {"child_exit": lambda self, arb, w: exits.append(1)})()
    # the pass saw the worker running; it exits before gunicorn reaps
    monkeypatch.setattr(SnapfnArbiter, "_reap_if_boot_error_code", lambda *a: True)
    for up in (True, False):
        pid = os.fork()
        if pid == 0:
            os._exit(3)
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # exited, not yet reaped
        arbiter.WORKERS = {pid: Worker(up)}
        if up:
            arbiter.reap_workers()
            assert arbiter.WORKERS == {} and exits == [1]
        else:
            with pytest.raises(HaltServer):
                arbiter.reap_workers()


# ---- a tier-1 function worker that stops after it was up ------------------------------------
def init_function_snapshot(tmp_path: Path, source: str) -> tuple[Path, Path]:
    """`source` as `edge_fn.py`, snapshotted with `snapfn init --function` at tier 1:
    (function folder, snapshot)."""
    folder = tmp_path / "fn"
    folder.mkdir()
    (folder / "edge_fn.py").write_text(source)
    snapshot = tmp_path / "snapshot"
    argv = [sys.executable, "-m", "snapfn.handler.cli", "init", "--function", "edge_fn:handler"]
    argv += ["--function-dir", str(folder), "--snapshot", str(snapshot)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "snapshot (process)" in done.stdout, done.stderr[-2000:]
    return folder, snapshot


@pytest.fixture
def tier1_runtime(tmp_path, criu_config):
    folder, snapshot = init_function_snapshot(tmp_path, EXITING)
    lines: list[str] = []
    target = ServeTarget(
        kind="function", function="edge_fn:handler", function_dir=folder, snapshot_dir=snapshot
    )
    runtime = WorkerRuntime(target, log=lines.append)
    runtime.start(background=False)
    assert runtime.readiness.state is Readiness.UP, runtime.readiness.reason
    assert runtime.startup.tier == "process"
    runtime.lines = lines
    yield runtime
    runtime.close()


def test_a_tier1_worker_that_exits_after_it_was_up_says_stopped(tier1_runtime):
    runtime = tier1_runtime
    client = create_app(runtime, ServeConfig(model_name="fn")).test_client()
    assert client.post("/invoke", json={}).status_code == 200
    r = client.post("/invoke", json={"exit": 3})
    assert r.status_code == 500 and r.json["errorType"] == "Runtime.ExitError", r.json
    assert "the function's process exited" in r.json["errorMessage"]
    deadline = time.monotonic() + 5
    while runtime.readiness.state is not Readiness.FAILED and time.monotonic() < deadline:
        time.sleep(0.01)
    assert runtime.readiness.state is Readiness.FAILED and runtime.stopped
    r = client.post("/invoke", json={})
    assert r.status_code == 503 and "Retry-After" not in r.headers
    error = r.json["error"]
    assert error["code"] == "stopped"
    assert error["message"].startswith("the worker stopped: worker process exited: ")
    health = client.get("/health")
    assert health.status_code == 503 and health.json["status"] == "failed"
    with pytest.raises(RuntimeStopped, match="edge_fn:handler stopped: worker process exited"):
        runtime.invoke({})
    said = "\n".join(runtime.lines)
    assert "edge_fn:handler stopped: the edge_fn:handler worker process is gone" in said
    assert "failed to start" not in said
    rejections = ("snapfn_startup_rejections_total", "stopped")
    assert any(
        f'{rejections[0]}{{reason="{rejections[1]}"}} 1.0' in line
        for line in client.get("/metrics").text.splitlines()
    )


def test_a_runtime_closed_after_it_was_up_is_stopped_and_one_never_up_is_not(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    name = f"fn_{uuid.uuid4().hex[:10]}"
    (tmp_path / f"{name}.py").write_text(EXITING)
    target = ServeTarget(kind="function", function=f"{name}:handler", function_dir=tmp_path)
    runtime = WorkerRuntime(target)
    try:
        runtime.start(background=False)
        runtime.close()
    finally:
        sys.modules.pop(name, None)
    assert runtime.stopped and runtime.readiness.reason == "closed"
    never = WorkerRuntime(target)
    never.close()
    assert never.readiness.state is Readiness.FAILED and not never.stopped
