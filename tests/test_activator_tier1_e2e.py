"""The activator in front of a process snapshot (tier 1) on CPU: each cold start restores the
checkpointed worker, and an idled-out instance takes its restored worker with it.
Skips with criu's reason where criu cannot run."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import requests

from snapfn.handler.cli import main

from activator_client import Activator

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def activator(criu_config, tmp_path_factory):
    root = tmp_path_factory.mktemp("activator-tier1")
    args = ["init", "--tier", "process", "--snapshot", str(root / "snap")]
    assert main([*args, "--cache-dir", str(root / "cache"), "--max-num-batched-tokens", "64"]) == 0
    a = Activator(
        ["--snapshot", str(root / "snap"), "--model-name", "embedded", "--idle-timeout", "1"],
        tmp_path_factory.mktemp("activator"),
    )
    a.root = root
    yield a
    a.stop()


def workers(root: Path) -> list[int]:
    """The checkpointable workers of this module's snapshot (restored ones keep the init's
    command line, which names its cache folder under `root`), not other tests' on the machine."""
    done = subprocess.run(
        ["pgrep", "-f", "snapfn.snapshot.process.worker"], capture_output=True, text=True
    )
    mine = []
    for pid in map(int, done.stdout.split()):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:  # gone since
            continue
        if str(root).encode() in cmdline:
            mine.append(pid)
    return mine


def complete(url: str) -> requests.Response:
    body = {"model": "embedded", "prompt": "ROMEO:", "max_tokens": 8, "temperature": 0}
    return requests.post(f"{url}/v1/completions", json=body, timeout=60)


def test_each_cold_start_restores_the_process_image_and_idle_stops_it(activator):
    activator.wait_for_instances(0)
    first = complete(activator.url)
    assert first.status_code == 200, first.text
    cold = activator.startup()["last_cold_start"]
    outcome = (cold["kind"], cold["tier"], cold["ok"])
    assert outcome == ("restore", "process", True), cold["fallbacks"]
    assert "criu_restore" in [s["name"] for s in cold["stages"]]
    assert len(workers(activator.root)) == 1  # the restored worker serving the instance

    activator.wait_for_instances(0)
    deadline = time.monotonic() + 10
    while (
        workers(activator.root) and time.monotonic() < deadline
    ):  # it exits once its channel closes
        time.sleep(0.05)
    assert workers(activator.root) == []

    second = complete(activator.url)
    assert second.status_code == 200
    assert second.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    assert activator.startup()["last_cold_start"]["tier"] == "process"
