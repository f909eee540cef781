"""End to end: the scale-to-zero activator (`snapfn serve --idle-timeout`) on the embedded model.

One snapshot is built for the module (`snapfn init`); one activator in front of it (idle
timeout 1 s, at most 2 instances, a new one per request in flight, hold queue of 3) goes
through the whole cycle: zero → restore → answer → idle → zero → restore again; the hold
queue overflowing; instances killed while they start; a stream relayed event by event. Each
test starts from zero instances. The activator process never maps torch.
(`test_activator_function_e2e.py` covers load, crashes in flight and auth with a function.)
"""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from snapfn.handler.cli import main

from activator_client import Activator, concurrently, delta, instance_pids, metric_samples, running

pytestmark = pytest.mark.slow
MODEL = "embedded"
COLD_STARTS = ("snapfn_activator_cold_starts_total", ())
PORTABLE = (("kind", "restore"), ("tier", "portable"))


@pytest.fixture(scope="module")
def snapshot_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("activator-snapshot")
    snap, cache = root / "snap", root / "cache"
    args = ["init", "--snapshot", str(snap), "--cache-dir", str(cache)]
    assert main([*args, "--max-num-batched-tokens", "64"]) == 0
    return snap


@pytest.fixture(scope="module")
def activator(snapshot_dir, tmp_path_factory):
    a = Activator(
        ["--snapshot", str(snapshot_dir), "--model-name", MODEL, "--threads", "8"]
        + ["--idle-timeout", "1", "--max-instances", "2", "--target-concurrency", "1"]
        + ["--startup-queue-size", "3"],
        tmp_path_factory.mktemp("activator"),
    )
    yield a
    a.stop()


@pytest.fixture
def idle(activator):
    """The activator with every instance idled out and gone."""
    activator.wait_for_instances(0)
    return activator


def complete(url: str, max_tokens: int = 8, stream: bool = False, **fields) -> requests.Response:
    """A greedy completion of "ROMEO:" through the activator."""
    body = {"model": MODEL, "prompt": "ROMEO:", "max_tokens": max_tokens, "temperature": 0}
    body.update(stream=stream, **fields)
    return requests.post(f"{url}/v1/completions", json=body, timeout=60, stream=stream)


def test_zero_restore_answer_idle_zero_and_restore_again(idle):
    before = idle.metrics()
    first = complete(idle.url)
    assert first.status_code == 200, first.text
    [up] = idle.instances("up")
    pids = instance_pids(up)
    assert len(pids) == 2  # the gunicorn master and its worker
    cold = idle.startup()["last_cold_start"]
    assert (cold["instance"], cold["kind"], cold["tier"], cold["ok"]) == (
        up["id"],
        "restore",
        "portable",
        True,
    )
    assert "stream_weights" in [s["name"] for s in cold["stages"]] and cold["total_s"] > 0

    idle.wait_for_instances(0)  # idle for 1 s: stopped, its whole process group gone
    assert not [p for p in pids if running(p)]
    assert idle.metrics()[("snapfn_activator_instances", (("state", "up"),))] == 0

    second = complete(idle.url)
    assert second.status_code == 200
    assert second.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]  # greedy
    assert int(second.headers["X-Snapfn-Instance"]) != up["id"]
    cold = idle.startup()["last_cold_start"]
    assert (cold["kind"], cold["tier"]) == ("restore", "portable")  # again from the snapshot
    after = idle.metrics()
    assert delta(after, before, COLD_STARTS) == 2
    assert delta(after, before, ("snapfn_activator_restore_seconds_count", PORTABLE)) == 2
    assert delta(after, before, ("snapfn_activator_hold_seconds_count", ())) == 2
    assert delta(after, before, ("snapfn_activator_instance_exits_total", (("reason", "idle"),)))
    stage = (
        "snapfn_startup_stage_seconds",
        tuple(sorted({*PORTABLE, ("stage", "stream_weights")})),
    )
    assert after[stage] > 0


def test_hold_queue_overflow_is_a_503_with_retry_after(idle):
    responses = concurrently([lambda: complete(idle.url)] * 6)
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200, 200, 200, 503, 503, 503]
    refused = [r for r in responses if r.status_code == 503]
    for r in refused:
        assert r.headers["Retry-After"] == "5"
        assert r.json()["error"]["code"] == "queue_full"
        assert "requests already wait" in r.json()["error"]["message"]


def test_requests_held_through_a_crashed_start_are_served_by_the_replacement(idle):
    before = idle.metrics()
    with ThreadPoolExecutor(2) as pool:
        held = [pool.submit(complete, idle.url) for _ in range(2)]
        body = idle.wait_for(lambda b: len([i for i in b["instances"] if i["pid"]]) == 2)
        assert {i["state"] for i in body["instances"]} == {"starting"}
        killed = {i["id"] for i in body["instances"]}
        for instance in body["instances"]:
            os.killpg(instance["pid"], signal.SIGKILL)
        responses = [f.result() for f in held]
    assert [r.status_code for r in responses] == [200, 200]
    assert not {int(r.headers["X-Snapfn-Instance"]) for r in responses} & killed
    failed = ("snapfn_activator_instance_exits_total", (("reason", "failed_start"),))
    assert delta(idle.metrics(), before, failed) == 2


def test_a_stream_is_relayed_event_by_event(idle):
    r = complete(idle.url, max_tokens=3000, stream=True, ignore_eos=True)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    [instance] = idle.instances("up")
    lines = r.iter_lines()
    first = json.loads(next(line for line in lines if line.startswith(b"data: "))[6:])
    assert first["object"] == "text_completion"
    instance_metrics = metric_samples(requests.get(f"{instance['url']}/metrics", timeout=10).text)
    assert instance_metrics[("snapfn_generations_in_flight", ())] == 1  # not buffered: mid-way
    r.close()  # the client goes: the instance must see it and cancel the generation
    cancelled = ("snapfn_engine_requests_total", (("outcome", "cancelled"),))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        text = requests.get(f"{instance['url']}/metrics", timeout=10).text
        if metric_samples(text)[cancelled] == 1:
            break
        time.sleep(0.05)
    assert metric_samples(text)[cancelled] == 1
    short = complete(idle.url, stream=True)
    events = [line[6:] for line in short.iter_lines() if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert text == complete(idle.url).json()["choices"][0]["text"]


def test_the_activator_never_loads_torch(activator):
    maps = Path(f"/proc/{activator.proc.pid}/maps").read_text()
    assert "libtorch" not in maps and "torch/lib" not in maps
