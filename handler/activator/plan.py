"""What the activator starts: each instance's command line and environment, and the GPUs.

Contract: `ActivatorPlan.build(args, config, environ)` runs once, before anything starts, and
imports nothing heavy (no torch, no CUDA: the activator must stay light):
- the target flags are checked as `snapfn serve` checks them (`target_flags.check_target_flags`);
- `gpu_ids` are the GPUs this machine shows, found without torch (`visible_gpu_ids`): the
  `CUDA_VISIBLE_DEVICES` list when set, else the entries of `/proc/driver/nvidia/gpus`, else the
  `GPU …` lines of `nvidia-smi -L`; none on a CPU machine;
- `max_instances` is `--max-instances`, or one per GPU (1 without GPUs); more instances than
  GPUs is refused, since each instance is pinned to one GPU (`CUDA_VISIBLE_DEVICES=<id>`);
- `instance_argv` is today's `snapfn serve` with the target, engine and server flags given
  (`FORWARDED_FLAGS`), on a private loopback port (`--host 127.0.0.1 --port 0`);
- `instance_env(gpu)` is the activator's environment without its own settings (an instance
  must never become an activator), plus the API key (kept out of `ps`), the GPU, and
  `SNAPFN_PARENT_PID` (the instance exits if the activator dies: `parent_watch.py`);
- `model_name` is the name every instance serves as "model", found from the flags as
  `snapfn serve` finds it (`serve.default_model_name`), so that the activator can answer
  `/openapi.json` itself; None where only an instance can tell (an s3:// snapshot without
  `--model-name`: the instance names it after its cache folder).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from snapfn.handler.activator.parent_watch import PARENT_PID_VARIABLE
from snapfn.handler.function.target_flags import check_target_flags
from snapfn.handler.http.serve import default_model_name
from snapfn.handler.http.serve_config import ServeConfig
from snapfn.snapshot.errors import BadRequest
from snapfn.snapshot.unix_socket import default_dir

# `snapfn serve` flags (argparse dests) an instance gets as given; the rest are the activator's
FORWARDED_FLAGS = (
    ("model", "snapshot", "cache_max_bytes", "function", "function_dir")  # what to serve
    + ("device", "dtype", "max_model_len", "max_running_requests", "kv_cache_mb")  # engine
    + ("tp_size", "ep_size")  # each instance's ranks
    + ("workers", "threads", "model_name", "max_body_bytes")  # each instance's server
    + ("startup_queue_size", "startup_wait_s", "failed_start_exit_s", "receive_timeout_s")
    + ("function_errors", "access_log")  # how each instance answers and logs
)
ACTIVATOR_FLAGS = ("host", "port", "api_key", "idle_timeout", "max_instances", "target_concurrency")
ACTIVATOR_FLAGS += ("keeper",)
ACTIVATOR_VARIABLES = (
    "SNAPFN_IDLE_TIMEOUT_S",
    "SNAPFN_MAX_INSTANCES",
    "SNAPFN_TARGET_CONCURRENCY",
    "SNAPFN_INSTANCE_START_TIMEOUT_S",
    "SNAPFN_HOST",
    "SNAPFN_PORT",
    "SNAPFN_API_KEY",
    "SNAPFN_KEEPER",
    "SNAPFN_INSTANCE_ZYGOTE",
    PARENT_PID_VARIABLE,
)
NVIDIA_PROC_GPUS = Path("/proc/driver/nvidia/gpus")
INSTANCE_HOST = "127.0.0.1"


@dataclass(frozen=True)
class ActivatorPlan:
    """Found once at start: the GPUs, how many instances, how to start one."""

    gpu_ids: tuple[str, ...]  # one instance per id; empty on CPU
    max_instances: int
    instance_argv: tuple[str, ...]
    base_env: tuple[tuple[str, str], ...]  # the activator's environment less its own settings
    api_key: str | None
    # with --keeper on: where each GPU's keeper serves is `<keeper_dir>/gpu<id>.sock` ("": off),
    # keeper_dir inside this user's private socket directory (snapshot/unix_socket.py), and the
    # snapshot it holds (a local process snapshot, else None: it only keeps CUDA warm)
    keeper_dir: str = ""
    keeper_snapshot: str | None = None
    model_name: str | None = None  # what every instance serves as "model"; None: ask one

    @classmethod
    def build(
        cls,
        args: argparse.Namespace,
        config: ServeConfig,
        environ: Mapping[str, str],
        gpu_ids: tuple[str, ...] | None = None,
    ) -> ActivatorPlan:
        """The plan for these flags; `gpu_ids` None = look at this machine (`visible_gpu_ids`)."""
        check_target_flags(args)
        gpus = visible_gpu_ids(environ) if gpu_ids is None else gpu_ids
        max_instances = config.max_instances or max(1, len(gpus))
        if gpus and max_instances > len(gpus):
            raise BadRequest(
                f"--max-instances {max_instances} is more than the {len(gpus)} GPU(s) here: "
                "each instance gets one GPU"
            )
        device = args.device or environ.get("SNAPFN_DEVICE") or ""
        ranks = (getattr(args, "tp_size", None) or 1) * (getattr(args, "ep_size", None) or 1)
        if gpus and ranks > 1 and device.startswith("cuda"):
            raise BadRequest(
                f"--tp-size/--ep-size ({ranks} ranks) with --idle-timeout on CUDA: the activator"
                " gives each instance one GPU; serve the ranks without --idle-timeout"
            )
        if gpus and device.startswith("cuda:") and device != "cuda:0":
            raise BadRequest(
                f"device {device!r}: each instance sees one GPU (CUDA_VISIBLE_DEVICES), "
                "use --device cuda"
            )
        env = {k: v for k, v in environ.items() if k not in ACTIVATOR_VARIABLES}
        keeper_dir, keeper_snapshot = "", None
        if config.keeper == "on":
            if not gpus:
                raise BadRequest("--keeper on needs a GPU: none is visible here")
            keeper_dir = str(default_dir(environ) / f"keepers-{os.getpid()}")
            keeper_snapshot = _local_process_snapshot(args.snapshot)
        return cls(
            gpu_ids=gpus,
            max_instances=max_instances,
            instance_argv=tuple(instance_argv(args)),
            base_env=tuple(sorted(env.items())),
            api_key=config.api_key,
            keeper_dir=keeper_dir,
            keeper_snapshot=keeper_snapshot,
            model_name=served_model_name(args, config),
        )

    def keeper_socket(self, gpu: str) -> str:
        return str(Path(self.keeper_dir) / f"gpu{gpu}.sock")

    def keeper_argv(self, gpu: str) -> list[str]:
        """`snapfn keeper` for GPU `gpu` (seen as device 0 through CUDA_VISIBLE_DEVICES)."""
        argv = [sys.executable, "-m", "snapfn.handler.cli", "keeper", "--device", "0"]
        argv += ["--socket", self.keeper_socket(gpu)]
        return argv + (["--snapshot", self.keeper_snapshot] if self.keeper_snapshot else [])

    def keeper_env(self, gpu: str) -> dict[str, str]:
        return {**dict(self.base_env), "CUDA_VISIBLE_DEVICES": gpu}

    def instance_env(self, gpu: str | None, parent_pid: int) -> dict[str, str]:
        env = dict(self.base_env)
        env[PARENT_PID_VARIABLE] = str(parent_pid)
        if self.api_key:
            env["SNAPFN_API_KEY"] = self.api_key
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
            if self.keeper_dir:
                env["SNAPFN_PINNED_SOCKET"] = self.keeper_socket(gpu)
        return env


def served_model_name(args: argparse.Namespace, config: ServeConfig) -> str | None:
    """The name each instance serves as "model": `--model-name`, else `serve.default_model_name`
    of the target `serve_target` would build (read from the flags alone: nothing is loaded), or
    None for an s3:// snapshot without `--model`, named after the cache folder it is pulled to."""
    if config.model_name:
        return config.model_name
    function, model, snapshot = args.function, args.model, args.snapshot
    if function is None and model is None and snapshot is not None and "://" in str(snapshot):
        return None
    # the fields default_model_name reads, as serve_target sets them for a local snapshot
    target = SimpleNamespace(
        kind="function" if function is not None else "llm",
        function=function,
        model_dir=model,
        snapshot_dir=snapshot,
    )
    return default_model_name(target)


def _local_process_snapshot(snapshot: str | None) -> str | None:
    """`snapshot` when it is a local process snapshot (what a keeper can hold), else None."""
    from snapfn.snapshot.process.snapshot import has_process_image

    if not snapshot or "://" in str(snapshot):  # s3:// is pulled per instance: nothing to hold
        return None
    path = Path(snapshot)
    return str(path.resolve()) if path.is_dir() and has_process_image(path) else None


def instance_argv(args: argparse.Namespace) -> list[str]:
    """`python -m snapfn.handler.cli serve` + the forwarded flags given + a loopback port."""
    argv = [sys.executable, "-m", "snapfn.handler.cli", "serve"]
    for dest in FORWARDED_FLAGS:
        value = getattr(args, dest, None)
        if value is not None:
            argv += [f"--{dest.replace('_', '-')}", str(value)]
    return argv + ["--host", INSTANCE_HOST, "--port", "0"]


def visible_gpu_ids(
    environ: Mapping[str, str],
    proc_dir: Path = NVIDIA_PROC_GPUS,
    run: Callable[..., subprocess.CompletedProcess] = subprocess.run,
) -> tuple[str, ...]:
    """The GPUs an instance may be pinned to, found without importing torch."""
    given = environ.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        ids = []
        for item in (x.strip() for x in given.split(",")):
            if not item or item.startswith("-"):  # CUDA stops at the first invalid entry
                break
            ids.append(item)
        return tuple(ids)
    try:
        count = len(os.listdir(proc_dir))
    except OSError:
        count = _count_nvidia_smi_gpus(run)
    return tuple(str(i) for i in range(count))


def _count_nvidia_smi_gpus(run: Callable[..., subprocess.CompletedProcess]) -> int:
    try:
        done = run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    if done.returncode != 0:
        return 0
    return sum(1 for line in done.stdout.splitlines() if line.startswith("GPU "))
