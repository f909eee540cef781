"""The examples' snapshot cycle on CPU with real criu: `snapfn init --function` writes a process
snapshot (tier 1) or, with no criu, a portable one (tier 0); each restore answers bit for bit
what a cold init answers (each example returns the sha256 of its output's bits), a tier-0
restore compiles nothing, and `snapfn serve --snapshot` serves the restored worker over HTTP.
The same cycle on CUDA: tests/test_function_gpu.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import requests
import torch

from snapfn.handler.function.runtime import WorkerRuntime
from snapfn.handler.function.target import ServeTarget
from snapfn.handler.llm.init_config import InitConfig
from snapfn.snapshot.portable.format import read_manifest
from snapfn.snapshot.stages import Readiness

from activator_client import read_listen_url
from function_examples import EXAMPLES, assert_informative

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("criu_config")]
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """One cache root for the module (the classifier compiles once) and one thread everywhere:
    CPU GEMMs split their sums by thread count, so every side must use the same one."""
    root = tmp_path_factory.mktemp("examples")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SNAPFN_CACHE_DIR", str(root / "cache"))
        mp.setenv("OMP_NUM_THREADS", "1")
        mp.chdir(REPO)
        yield root


def runtime(spec: str, snapshot: Path | None, root: Path) -> WorkerRuntime:
    config = InitConfig(cache_dir=root / "cache")
    target = ServeTarget(kind="function", function=spec, snapshot_dir=snapshot, init_config=config)
    rt = WorkerRuntime(target)
    rt.start(background=False)
    assert rt.readiness.state is Readiness.UP, rt.readiness.reason
    return rt


def answer(spec: str, snapshot: Path | None, root: Path):
    rt = runtime(spec, snapshot, root)
    try:
        return rt.invoke(EXAMPLES[spec]), rt.startup, rt.health_generate()
    finally:
        rt.close()


def init(spec: str, dest: Path, **env: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "snapfn.handler.cli", "init", "--function", spec]
    done = subprocess.run(
        [*argv, "--snapshot", str(dest)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **env},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def cold(workdir):
    answers = {spec: answer(spec, None, workdir)[0] for spec in EXAMPLES}
    for spec, value in answers.items():
        assert_informative(spec, value)
    return answers


@pytest.fixture(scope="module")
def snapshots(workdir, cold):
    made = {}
    for i, spec in enumerate(EXAMPLES):
        process, portable = workdir / f"process{i}", workdir / f"portable{i}"
        assert "snapshot (process)" in init(spec, process).stdout
        done = init(spec, portable, SNAPFN_CRIU="/nonexistent")
        assert "snapshot (portable)" in done.stdout and "no process image" in done.stderr
        made[spec] = (process, portable)
    return made


@pytest.mark.parametrize("spec", EXAMPLES)
def test_a_process_snapshot_answers_bit_for_bit_what_a_cold_init_does(
    spec, workdir, cold, snapshots
):
    got, startup, health = answer(spec, snapshots[spec][0], workdir)
    assert startup.tier == "process" and not startup.fallbacks
    assert got == cold[spec]
    assert health["ok"] is True  # the health event, answered by the restored worker


@pytest.mark.parametrize("spec", EXAMPLES)
def test_a_portable_snapshot_reruns_the_init_compiling_nothing(spec, workdir, cold, snapshots):
    manifest = read_manifest(snapshots[spec][1])
    assert manifest["tier"] == "portable"
    assert manifest["startup"]["fallbacks"][0]["step"] == "checkpoint"  # why: no criu
    got, startup, _ = answer(spec, snapshots[spec][1], workdir)
    assert startup.tier == "portable" and not startup.fallbacks
    assert got == cold[spec]
    assert startup.stage("init_hooks").figures["compiled_files"] == 0


def test_the_classifier_snapshot_carries_what_inductor_compiled(snapshots):
    process, _ = snapshots["examples.image_classifier:handler"]
    caches = read_manifest(process)["user_function"]["caches"]
    assert caches.get("inductor", 0) > 0, caches


def test_init_then_serve_over_http(workdir, snapshots):
    spec = "examples.text_embedding:handler"
    snapshot = snapshots[spec][0]
    log = workdir / "serve.log"
    argv = [sys.executable, "-m", "snapfn.handler.cli", "serve", "--function", spec]
    proc = subprocess.Popen(
        [*argv, "--snapshot", str(snapshot), "--host", "127.0.0.1", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=log.open("w"),
        text=True,
        start_new_session=True,
    )
    try:
        url = read_listen_url(proc, "server", lambda: log.read_text()[-3000:], 120)
        r = requests.post(f"{url}/invoke", json=EXAMPLES[spec], timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["sha256"] == answer(spec, None, workdir)[0]["sha256"]
        assert requests.get(f"{url}/startup", timeout=10).json()["tier"] == "process"
        health = requests.get(f"{url}/health/generate", timeout=60)
        assert health.status_code == 200 and health.json()["result"]["ok"] is True
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]


def test_the_graph_example_reads_its_weights_from_a_checkpoint_as_it_would_draw_them(tmp_path):
    path = tmp_path / "weights.safetensors"
    env = {**os.environ, "GRAPH_MLP_WIDTH": "128", "GRAPH_MLP_LAYERS": "3"}
    write = [sys.executable, "-m", "examples.cuda_graph", "--write-checkpoint", str(path)]
    done = subprocess.run(write, capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    code = (
        "import json, examples.cuda_graph as m; m.stack.load(); "
        "print(json.dumps([m.stack.run({'seed': 2}), len(m.stack.layers)]))"
    )
    run = [sys.executable, "-c", code]
    done = subprocess.run(
        run,
        capture_output=True,
        text=True,
        env={**env, "GRAPH_MLP_CHECKPOINT": str(path), "GRAPH_MLP_WIDTH": "999"},
        cwd=REPO,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    answer, num_layers = json.loads(done.stdout)
    assert num_layers == 3  # the file's size, not the environment's
    assert_informative("examples.cuda_graph:handler", answer)

    from safetensors.torch import save_file

    save_file({"layers.1.weight": torch.zeros(4, 4)}, str(path))  # no layers.0
    done = subprocess.run(
        run,
        capture_output=True,
        text=True,
        env={**env, "GRAPH_MLP_CHECKPOINT": str(path)},
        cwd=REPO,
        timeout=120,
    )
    assert done.returncode != 0 and "no tensor layers.0.weight" in done.stderr
