"""handler/function/host.py: what a process image cannot hold is refused with its reason and a
portable snapshot written instead (never a silent snapshot that would restore broken), and
`--device cuda` without a GPU is a one-line error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from snapfn.handler.function.host import tier1_problem
from snapfn.snapshot.portable.format import read_manifest

CHILD = """
import subprocess, sys
from snapfn.handler.api import init
state = {}

@init
def start_a_helper():
    state["helper"] = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])

def handler(event, context):
    return {"helper": state["helper"].pid}
"""
DISTRIBUTED = """
import torch.distributed as dist
from snapfn.handler.api import init

@init
def join_a_group():
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)

def handler(event, context):
    return {"world": dist.get_world_size()}
"""


def init(spec: str, folder: Path, dest: Path, *flags: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "snapfn.handler.cli", "init", "--function", spec]
    argv += ["--function-dir", str(folder), "--snapshot", str(dest), *flags]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300)


@pytest.mark.usefixtures("criu_config")
@pytest.mark.parametrize(
    ("source", "reason"),
    [(CHILD, "started child processes"), (DISTRIBUTED, "initialised torch.distributed")],
    ids=["child-process", "torch-distributed"],
)
def test_what_a_process_image_cannot_hold_gets_a_portable_snapshot_and_why(
    source, reason, tmp_path
):
    (tmp_path / "refused_fn.py").write_text(source)
    done = init("refused_fn:handler", tmp_path, tmp_path / "snap")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "snapshot (portable)" in done.stdout
    assert reason in done.stderr  # one line, printed by `snapfn init`
    manifest = read_manifest(tmp_path / "snap")
    assert manifest["tier"] == "portable" and "process" not in manifest
    (fallback,) = manifest["startup"]["fallbacks"]
    assert fallback["step"] == "checkpoint" and reason in fallback["reason"]
    assert not (tmp_path / "snap" / "process").exists()


def test_device_memory_outside_the_pool_over_the_limit_is_refused(monkeypatch):
    from snapfn.handler.function import host

    monkeypatch.setattr(host, "_child_pids", list)  # this test process has children of its own
    figures = {"image_device_bytes": 3 << 30, "pool_bytes": 1 << 30}
    assert tier1_problem(figures, 4 << 30) is None
    problem = tier1_problem(figures, 2 << 30)
    assert "3.22 GB of device memory outside the releasable pool" in problem
    assert "limit 2.15 GB" in problem


def test_device_cuda_without_a_gpu_is_one_line(tmp_path):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    done = init(
        "examples.hello:handler", Path("examples").parent, tmp_path / "s", "--device", "cuda"
    )
    assert done.returncode == 2
    assert "--device cuda: this machine has no usable CUDA GPU" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "s").exists()


COMPILE_WORKERS = """
import torch
from torch._inductor import config
from torch._inductor.async_compile import AsyncCompile
from snapfn.handler.api import init

@init
def start_compile_workers():  # what torch.compile does on a machine with cores to spare
    config.compile_threads = 2
    AsyncCompile.process_pool()

def handler(event, context):
    return {"ok": True}
"""


@pytest.mark.slow
@pytest.mark.usefixtures("criu_config")
def test_torch_compile_workers_are_shut_down_before_the_checkpoint(tmp_path):
    (tmp_path / "compiling_fn.py").write_text(COMPILE_WORKERS)
    done = init("compiling_fn:handler", tmp_path, tmp_path / "snap")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "snapshot (process)" in done.stdout, done.stderr[-2000:]
    manifest = read_manifest(tmp_path / "snap")
    assert manifest["tier"] == "process" and not manifest["startup"]["fallbacks"]
