"""A GPU function's snapshot behind the front doors, on a GPU: `snapfn init --function …
--device cuda`, then `snapfn serve --function … --snapshot` under gunicorn over HTTP (without and
with a `snapfn keeper` holding the device-memory file pinned) and the activator with
`--keeper on` restoring it per cold start. Each answers bit for bit what a cold init answers;
`/health/generate` calls the function in the restored worker (CPU: test_function_examples.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import torch

from activator_client import Activator
from test_serve_e2e import Server

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.usefixtures("criu_config"),
]
REPO = Path(__file__).resolve().parent.parent
SPEC = "examples.cuda_graph:handler"
SIZE = {"GRAPH_MLP_WIDTH": "4096", "GRAPH_MLP_LAYERS": "8"}  # 0.27 GB in the pool


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(snapshot, cold answers of seeds 0 and 3, the environment every side runs with)."""
    from snapfn.handler.function.runtime import WorkerRuntime
    from snapfn.handler.function.target import ServeTarget
    from snapfn.handler.llm.init_config import InitConfig

    root = tmp_path_factory.mktemp("gpu-fn")
    env = {**SIZE, "SNAPFN_CACHE_DIR": str(root / "cache")}
    argv = [sys.executable, "-m", "snapfn.handler.cli", "init", "--function", SPEC]
    done = subprocess.run(
        [*argv, "--snapshot", str(root / "snap"), "--device", "cuda"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **env},
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "snapshot (process)" in done.stdout, done.stderr[-3000:]
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        mp.chdir(REPO)
        config = InitConfig(device="cuda", cache_dir=root / "cache")
        rt = WorkerRuntime(ServeTarget(kind="function", function=SPEC, init_config=config))
        rt.start(background=False)
        try:
            cold = {seed: rt.invoke({"seed": seed}) for seed in (0, 3)}
        finally:
            rt.close()
    return root / "snap", cold, env


def check_served(url: str, cold: dict) -> dict:
    """The restored worker's answers and health call against the cold init's; /startup."""
    r = requests.post(f"{url}/invoke", json={"seed": 3}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json() == cold[3]
    assert r.json()["graph"] is True  # the captured graph replayed after the restore
    health = requests.get(f"{url}/health/generate", timeout=60)
    assert health.status_code == 200, health.text
    # the health event {"seed": 0}, really called: {"status": "up", "result": {"ok", "result"}}
    assert health.json()["result"]["result"] == cold[0]
    return requests.get(f"{url}/startup", timeout=10).json()


def stage(startup: dict, name: str) -> dict:
    return next(s for s in startup["stages"] if s["name"] == name)


def test_serve_restores_the_gpu_function_over_http(made, tmp_path):
    snapshot, cold, env = made
    args = ["--function", SPEC, "--snapshot", str(snapshot), "--device", "cuda"]
    server = Server(args, tmp_path, **env, SNAPFN_PINNED_SOCKET="")
    try:
        startup = check_served(server.url, cold)
        assert (startup["tier"], startup["fallbacks"]) == ("process", [])
        assert stage(startup, "worker.device_memory")["figures"]["pool_bytes"] > 0
    finally:
        server.stop()


def test_serve_with_a_keeper_holding_the_device_memory_file(made, tmp_path):
    snapshot, cold, env = made
    folder = tmp_path / "keeper"
    folder.mkdir(mode=0o700)
    socket, log = folder / "keeper.sock", tmp_path / "keeper.log"
    keeper = subprocess.Popen(
        [sys.executable, "-m", "snapfn.handler.cli", "keeper", "--snapshot", str(snapshot)]
        + ["--socket", str(socket)],
        stderr=log.open("w"),
        env={**os.environ, **env},
        cwd=REPO,
    )
    try:
        deadline = time.monotonic() + 120
        while "serving on" not in log.read_text():
            assert keeper.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        args = ["--function", SPEC, "--snapshot", str(snapshot), "--device", "cuda"]
        server = Server(args, tmp_path, **env, SNAPFN_PINNED_SOCKET=str(socket))
        try:
            startup = check_served(server.url, cold)
        finally:
            server.stop()
        assert (startup["tier"], startup["fallbacks"]) == ("process", [])
        assert stage(startup, "cuda_restore")["figures"].get("by") == "keeper", startup
        filled = stage(startup, "worker.device_memory")["figures"]
        assert filled["by"] == "restorer" and "verify_s" in filled, filled
    finally:
        keeper.send_signal(signal.SIGTERM)
        assert keeper.wait(timeout=30) == 0, log.read_text()[-2000:]


def test_the_activator_restores_the_gpu_function_per_cold_start(made, tmp_path):
    snapshot, cold, env = made
    args = ["--function", SPEC, "--snapshot", str(snapshot), "--device", "cuda"]
    args += ["--idle-timeout", "2", "--keeper", "on", "--max-instances", "1"]
    activator = Activator(args, tmp_path, env=env)
    try:
        for _ in range(2):  # a cold start, then again after the instance idled out
            activator.wait_for_instances(0)
            r = requests.post(f"{activator.url}/invoke", json={"seed": 3}, timeout=120)
            assert r.status_code == 200, (r.text, activator.log_tail())
            assert r.json() == cold[3]
            last = activator.startup()["last_cold_start"]
            got = (last["kind"], last["tier"], last["ok"])
            assert got == ("restore", "process", True), (last.get("fallbacks"), last)
    finally:
        activator.stop()
