"""End to end: the activator in front of a user function whose requests wait on a gate file.

A request with `{"until": PATH}` is in flight until the test creates PATH, so load and crashes
are staged without timing guesses: instances held busy while the pool scales to its cap and
no further; an instance SIGKILLed while serving (its request gets a 502, its workers are
killed, a replacement serves the next request); and an activator with an API key that is
SIGKILLed itself, whose instances must exit with it.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from activator_client import Activator, delta, instance_pids, wait_until_gone

pytestmark = pytest.mark.slow
GATED_FUNCTION = """
import os
import time
from pathlib import Path


def handler(event, context):
    if "started" in event:
        Path(event["started"]).touch()
    while "until" in event and not Path(event["until"]).exists():
        time.sleep(0.01)
    return {"echo": event, "pid": os.getpid()}
"""
COLD_STARTS = ("snapfn_activator_cold_starts_total", ())


def function_args(folder) -> list[str]:
    (folder / "gated_fn.py").write_text(GATED_FUNCTION)
    return ["--function", "gated_fn:handler", "--function-dir", str(folder)]


@pytest.fixture(scope="module")
def activator(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("fn-activator")
    a = Activator(
        function_args(workdir)
        + ["--idle-timeout", "1", "--max-instances", "2", "--target-concurrency", "1"]
        + ["--threads", "16", "--startup-queue-size", "8"],
        workdir,
    )
    yield a
    a.stop()


@pytest.fixture
def idle(activator):
    activator.wait_for_instances(0)
    return activator


def invoke(url: str, event: dict, headers: dict | None = None) -> requests.Response:
    return requests.post(f"{url}/invoke", json=event, headers=headers, timeout=60)


def served_by(responses: list[requests.Response]) -> list[int]:
    assert [r.status_code for r in responses] == [200] * len(responses)
    return [int(r.headers["X-Snapfn-Instance"]) for r in responses]


def test_max_instances_is_respected_under_load(idle, tmp_path):
    before, gate = idle.metrics(), {"until": str(tmp_path / "open")}
    [first] = served_by([invoke(idle.url, {})])
    live = []
    with ThreadPoolExecutor(10) as pool:
        try:
            waves = [[pool.submit(invoke, idle.url, gate) for _ in range(4)]]
            [_, second] = [i["id"] for i in idle.wait_for_instances(2, "up")]  # demand 4
            waves.append([pool.submit(invoke, idle.url, gate) for _ in range(4)])
            idle.wait_for(lambda b: [i["outstanding"] for i in b["instances"]] == [4, 4])
            live.append(len(idle.instances()))
            waves.append([pool.submit(invoke, idle.url, gate) for _ in range(2)])  # demand 10
            idle.wait_for(lambda b: [i["outstanding"] for i in b["instances"]] == [5, 5])
            live.append(len(idle.instances()))
        finally:
            (tmp_path / "open").touch()
        ids = [served_by([f.result() for f in wave]) for wave in waves]
    assert ids[:2] == [[first] * 4, [second] * 4] and sorted(ids[2]) == [first, second]
    assert live == [2, 2] and delta(idle.metrics(), before, COLD_STARTS) == 2


def test_a_killed_instance_fails_its_request_with_502_and_is_replaced(idle, tmp_path):
    [first] = served_by([invoke(idle.url, {})])
    [victim] = idle.instances("up")
    pids, before = instance_pids(victim), idle.metrics()
    started = tmp_path / "started"
    event = {"started": str(started), "until": str(tmp_path / "never")}
    with ThreadPoolExecutor(1) as pool:
        in_flight = pool.submit(invoke, idle.url, event)
        deadline = time.monotonic() + 30
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(victim["pid"], signal.SIGKILL)  # the master only: the activator clears the rest
        broken = in_flight.result()
    assert broken.status_code == 502 and broken.headers["X-Snapfn-Instance"] == str(first)
    error = broken.json()["error"]
    assert error["code"] == "instance_failed" and f"instance {first} failed" in error["message"]
    wait_until_gone(pids)  # the worker the crashed master left behind was killed too
    assert served_by([invoke(idle.url, {})]) != [first]
    crashes = ("snapfn_activator_instance_exits_total", (("reason", "crash"),))
    assert delta(idle.metrics(), before, crashes) == 1


def test_a_sigkilled_activator_takes_its_instances_with_it(tmp_path):
    a = Activator(function_args(tmp_path) + ["--idle-timeout", "30", "--api-key", "k"], tmp_path)
    try:
        refused = invoke(a.url, {"x": 1})
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        a.headers = {"Authorization": "Bearer k"}
        assert a.metrics()[COLD_STARTS] == 0  # refused before anything started
        r = invoke(a.url, {"x": 1}, headers=a.headers)  # the instance checks the key too
        assert r.status_code == 200 and r.json()["echo"] == {"x": 1}
        pids = instance_pids(a.instances("up")[0])
    finally:
        a.proc.kill()
        a.proc.wait(timeout=10)
    wait_until_gone(pids)
