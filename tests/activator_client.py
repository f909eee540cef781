"""A `snapfn serve --idle-timeout …` activator in a subprocess, and what tests read from it.

`Activator(args, workdir)` starts it on a free localhost port in its own session and waits for
its URL. `startup()`, `instances()` and `metrics()` read its endpoints; `wait_for(predicate)`
polls `/startup`; `stop()` sends SIGTERM and checks that it exits 0 leaving no instance
process behind (every instance pid `startup()` ever showed, and their workers). Helpers:
`running(pid)`, `instance_pids(instance)`, `concurrently(calls)`, `delta(after, before, key)`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from snapfn.snapshot.process.criu import is_running

SERVE = [sys.executable, "-m", "snapfn.handler.cli", "serve"]


running = is_running  # the process exists and has not exited (a zombie is not running)


def read_listen_url(proc: subprocess.Popen, what: str, log_tail, timeout_s: float) -> str:
    """The URL a `snapfn serve` process prints ("listening on URL"), read from its stdout;
    fails the test with `log_tail()` if it exits or says nothing within `timeout_s`."""
    found: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            if "listening on " in line and not found:
                found.append(line.split("listening on ")[1].split()[0])

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not found and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.01)
    if not found:
        proc.kill()
        pytest.fail(f"{what} did not start; log:\n{log_tail()}")
    return found[0]


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


class Activator:
    """The activator subprocess; `url` once it printed where it listens."""

    def __init__(self, args: list[str], workdir: Path, env: dict[str, str] | None = None) -> None:
        base = {**os.environ, "XDG_CACHE_HOME": str(workdir / "cache"), "OMP_NUM_THREADS": "1"}
        base.pop("SNAPFN_API_KEY", None)
        self.log_path = workdir / "activator.log"
        self.proc = subprocess.Popen(
            [*SERVE, "--host", "127.0.0.1", "--port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=self.log_path.open("w"),
            text=True,
            env={**base, **(env or {})},
            start_new_session=True,
        )
        self.seen_pids: set[int] = set()  # every instance process seen (masters and workers)
        self.headers: dict[str, str] = {}
        self.url = self._read_url(timeout_s=60)

    def _read_url(self, timeout_s: float) -> str:
        return read_listen_url(self.proc, "activator", self.log_tail, timeout_s)

    def log_tail(self) -> str:
        return self.log_path.read_text()[-4000:]

    def startup(self) -> dict:
        body = requests.get(f"{self.url}/startup", headers=self.headers, timeout=10).json()
        for instance in body["instances"]:
            if instance["pid"] is not None:
                self.seen_pids.add(instance["pid"])
                self.seen_pids.update(children(instance["pid"]))
        return body

    def instances(self, state: str | None = None) -> list[dict]:
        return [i for i in self.startup()["instances"] if state is None or i["state"] == state]

    def wait_for(self, predicate: Callable[[dict], bool], timeout_s: float = 30) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            body = self.startup()
            if predicate(body):
                return body
            time.sleep(0.02)
        pytest.fail(f"timed out; /startup: {self.startup()}\nlog:\n{self.log_tail()}")

    def wait_for_instances(self, count: int, state: str | None = None) -> list[dict]:
        def matches(body: dict) -> bool:
            found = [i for i in body["instances"] if state is None or i["state"] == state]
            return len(found) == count

        self.wait_for(matches)
        return self.instances(state)

    def metrics(self) -> dict:
        text = requests.get(f"{self.url}/metrics", headers=self.headers, timeout=10).text
        return metric_samples(text)

    def stop(self) -> None:
        """SIGTERM: the activator stops every instance, then exits 0; nothing is left."""
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=60)
        assert code == 0, self.log_tail()
        with pytest.raises(ProcessLookupError):
            os.killpg(self.proc.pid, 0)
        assert not [p for p in self.seen_pids if running(p)], self.log_tail()


def metric_samples(text: str) -> dict:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def instance_pids(instance: dict) -> list[int]:
    """An instance's gunicorn master and its workers."""
    return [instance["pid"], *children(instance["pid"])]


def wait_until_gone(pids: list[int], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while [p for p in pids if running(p)] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not [p for p in pids if running(p)]


def concurrently(calls: list) -> list:
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(call) for call in calls]]


def delta(after: dict, before: dict, key: tuple) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)
