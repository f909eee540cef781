"""One process image restored many times at once (CPU, real criu): N = 1, 2, 4 copies started
together, each in its own pid namespace, each answering like the cold init (and each its own
instance: after-restore hooks ran in every copy); the activator scaling from zero to N starts
its instances side by side, each restoring the image. Skips with criu's reason where criu
cannot run. (GPU workers: tests/test_function_gpu_e2e.py.)"""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from snapfn.handler.function.runtime import WorkerRuntime
from snapfn.handler.function.target import ServeTarget
from snapfn.snapshot.process import worker_process

from activator_client import Activator

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("criu_config")]
REPO = Path(__file__).resolve().parent.parent
GATED = """
import os
import time
from pathlib import Path

from snapfn.handler.api import after_restore, init

state = {"warm": False, "restored": 0}


@init
def warm_up():
    state["warm"] = True


@after_restore
def count():
    state["restored"] += 1


def handler(event, context):
    while "until" in event and not Path(event["until"]).exists():
        time.sleep(0.01)
    return {"warm": state["warm"], "restored": state["restored"], "pid": os.getpid()}
"""


def init(spec: str, dest: Path, folder: Path) -> None:
    argv = [sys.executable, "-m", "snapfn.handler.cli", "init", "--function", spec]
    argv += ["--function-dir", str(folder), "--snapshot", str(dest)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "snapshot (process)" in done.stdout, done.stderr[-2000:]


@pytest.fixture(scope="module")
def gated(tmp_path_factory):
    if not worker_process.pid_namespace_works():
        pytest.skip("unshare --pid --fork does not work here: one restore at a time")
    folder = tmp_path_factory.mktemp("gated")
    (folder / "gated_fn.py").write_text(GATED)
    init("gated_fn:handler", folder / "snap", folder)
    return folder


def restored(folder: Path) -> WorkerRuntime:
    target = ServeTarget(
        kind="function",
        function="gated_fn:handler",
        function_dir=folder,
        snapshot_dir=folder / "snap",
    )
    rt = WorkerRuntime(target)
    rt.start(background=False)
    return rt


@pytest.mark.parametrize("n", [1, 2, 4])
def test_one_image_restores_n_times_at_once(gated, n):
    with ThreadPoolExecutor(n) as pool:
        runtimes = list(pool.map(lambda _: restored(gated), range(n)))
    try:
        assert [rt.startup.tier for rt in runtimes] == ["process"] * n, [
            rt.startup.fallbacks for rt in runtimes
        ]
        answers = [rt.invoke({}) for rt in runtimes]
        assert all(a["warm"] and a["restored"] == 1 for a in answers), answers  # init's state
        # each copy is its own process: pid 1 of its namespace, a different host process each
        workers = {rt.startup.stage("criu_restore").figures["pid"] for rt in runtimes}
        assert len(workers) == n
        assert {a["pid"] for a in answers} == {1}
    finally:
        for rt in runtimes:
            rt.close()


def test_the_activator_scales_from_zero_to_n_restoring_side_by_side(gated, tmp_path):
    n = 3
    args = ["--function", "gated_fn:handler", "--function-dir", str(gated)]
    args += ["--snapshot", str(gated / "snap"), "--idle-timeout", "30"]
    args += ["--max-instances", str(n), "--target-concurrency", "1", "--threads", "8"]
    activator = Activator(args, tmp_path)
    gate = tmp_path / "open"
    try:
        with ThreadPoolExecutor(n) as pool:
            calls = [
                pool.submit(
                    requests.post,
                    f"{activator.url}/invoke",
                    json={"until": str(gate)},
                    timeout=120,
                )
                for _ in range(n)
            ]
            up = activator.wait_for_instances(n, "up")
            gate.touch()
            responses = [c.result() for c in calls]
        assert [r.status_code for r in responses] == [200] * n, [r.text for r in responses]
        assert all(r.json()["restored"] == 1 for r in responses)
        instances = activator.startup()["instances"]
        assert sorted(i["tier"] for i in instances) == ["process"] * n, instances
        # side by side: each instance was spawned before the first of them was up
        spans = [(i["started_at"], i["started_at"] + i["cold_start_s"]) for i in instances]
        assert max(start for start, _ in spans) < min(end for _, end in spans), spans
        assert len(up) == n
    finally:
        gate.touch()
        activator.stop()
        time.sleep(0.1)
