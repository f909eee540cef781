"""`activator/plan.py`: GPUs found without torch, the instance command line and environment.

Also: the activator (CLI, plan, app) never imports torch, checked in a fresh interpreter.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from snapfn.handler.activator.plan import (
    ACTIVATOR_FLAGS,
    FORWARDED_FLAGS,
    ActivatorPlan,
    visible_gpu_ids,
)
from snapfn.handler.cli import build_parser
from snapfn.handler.http.serve_config import ServeConfig
from snapfn.snapshot.errors import BadRequest

NVIDIA_SMI_L = "GPU 0: NVIDIA H200 (UUID: GPU-a)\n  MIG 1g.18gb Device 0: (UUID: MIG-x)\nGPU 1: NVIDIA H200 (UUID: GPU-b)\n"


def serve_args(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def plan_for(*argv: str, gpus=(), environ=None) -> ActivatorPlan:
    args = serve_args("--idle-timeout", "5", *argv)
    config = ServeConfig.from_env({}, idle_timeout_s=5.0, max_instances=args.max_instances)
    return ActivatorPlan.build(args, config, environ or {}, gpu_ids=tuple(gpus))


def no_nvidia_smi(*args, **kwargs):
    raise FileNotFoundError("nvidia-smi")


def test_gpus_from_cuda_visible_devices_first(tmp_path):
    assert visible_gpu_ids({"CUDA_VISIBLE_DEVICES": "2, GPU-b"}, tmp_path) == ("2", "GPU-b")
    assert visible_gpu_ids({"CUDA_VISIBLE_DEVICES": "3,-1,4"}, tmp_path) == ("3",)
    assert visible_gpu_ids({"CUDA_VISIBLE_DEVICES": ""}, tmp_path) == ()


def test_gpus_from_proc_then_nvidia_smi_then_none(tmp_path):
    for bus_id in ("0000:18:00.0", "0000:2a:00.0"):
        (tmp_path / bus_id).mkdir()
    assert visible_gpu_ids({}, tmp_path, run=no_nvidia_smi) == ("0", "1")

    def nvidia_smi(argv, **kwargs):
        assert argv == ["nvidia-smi", "-L"]
        return subprocess.CompletedProcess(argv, 0, stdout=NVIDIA_SMI_L)

    missing = tmp_path / "no-driver"
    assert visible_gpu_ids({}, missing, run=nvidia_smi) == ("0", "1")
    assert visible_gpu_ids({}, missing, run=no_nvidia_smi) == ()


def test_max_instances_defaults_to_one_per_gpu_and_one_on_cpu():
    assert plan_for().max_instances == 1
    assert plan_for("--max-instances", "3").max_instances == 3  # CPU: the flag decides
    assert plan_for(gpus=("0", "1")).max_instances == 2
    with pytest.raises(BadRequest, match="each instance gets one GPU"):
        plan_for("--max-instances", "3", gpus=("0", "1"))
    with pytest.raises(BadRequest, match="use --device cuda"):
        plan_for("--device", "cuda:1", gpus=("0", "1"))


def test_instance_argv_forwards_the_flags_given_and_listens_on_loopback(tmp_path):
    plan = plan_for("--snapshot", str(tmp_path), "--kv-cache-mb", "4", "--port", "9000")
    assert plan.instance_argv[1:] == (
        "-m", "snapfn.handler.cli", "serve", "--snapshot", str(tmp_path),
        "--kv-cache-mb", "4", "--host", "127.0.0.1", "--port", "0",
    )  # fmt: skip


def test_instance_env_drops_activator_settings_and_pins_one_gpu():
    environ = {"SNAPFN_IDLE_TIMEOUT_S": "5", "SNAPFN_MAX_INSTANCES": "2", "KEEP": "1"}
    args = serve_args("--idle-timeout", "5", "--api-key", "secret")
    config = ServeConfig.from_env(environ, idle_timeout_s=5.0, api_key="secret")
    plan = ActivatorPlan.build(args, config, environ, gpu_ids=("0", "1"))
    env = plan.instance_env("1", parent_pid=42)
    assert env["KEEP"] == "1" and "SNAPFN_IDLE_TIMEOUT_S" not in env
    assert "SNAPFN_MAX_INSTANCES" not in env  # an instance never becomes an activator
    assert (env["CUDA_VISIBLE_DEVICES"], env["SNAPFN_PARENT_PID"]) == ("1", "42")
    assert env["SNAPFN_API_KEY"] == "secret" and "secret" not in plan.instance_argv


def test_every_serve_flag_is_forwarded_or_the_activators():
    serve = next(a for a in build_parser()._actions if a.dest == "command").choices["serve"]
    dests = {a.dest for a in serve._actions if a.dest != "help"}
    assert dests == set(FORWARDED_FLAGS) | set(ACTIVATOR_FLAGS)


def test_target_flags_are_checked_before_anything_starts(tmp_path):
    with pytest.raises(BadRequest, match="drop --model"):
        plan_for("--function", "m:f", "--model", str(tmp_path))


def test_the_activator_never_imports_torch():
    check = """
import json, sys
from snapfn.handler.cli import build_parser
from snapfn.handler.activator.app import create_activator_app
from snapfn.handler.http.serve import serve_config
args = build_parser().parse_args(["serve", "--idle-timeout", "1", "--max-instances", "2"])
config = serve_config(args, {})
from snapfn.handler.activator.plan import ActivatorPlan
plan = ActivatorPlan.build(args, config, {})
print(json.dumps({"torch": sorted(m for m in sys.modules if m.split(".")[0] == "torch"),
                  "max_instances": plan.max_instances}))
"""
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"torch": [], "max_instances": 2}


def test_ranks_are_forwarded_on_cpu_and_refused_on_one_gpu_per_instance(tmp_path):
    plan = plan_for("--model", str(tmp_path), "--tp-size", "2")
    argv = list(plan.instance_argv)
    assert argv[argv.index("--tp-size") + 1] == "2"
    with pytest.raises(BadRequest, match="gives each instance one GPU"):
        plan_for("--model", str(tmp_path), "--tp-size", "2", "--device", "cuda", gpus=("0", "1"))
