"""`serve --idle-timeout … --keeper on`: the activator runs one `snapfn keeper` per GPU for its
instances' tier-1 restores (snapshot/keeper/daemon.py). Here: the plan (each GPU's keeper command,
environment and socket, and the instance that is told that socket), what is refused, and the
keepers' start and stop as processes — a stand-in command, since a real keeper needs a GPU."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from snapfn.handler.activator.keepers import Keepers
from snapfn.handler.activator.plan import ActivatorPlan
from snapfn.handler.cli import build_parser
from snapfn.handler.http.serve_config import ServeConfig
from snapfn.snapshot.errors import BadRequest


def plan_for(*argv: str, gpus=("0", "1"), environ=None) -> ActivatorPlan:
    args = build_parser().parse_args(["serve", "--idle-timeout", "5", *argv])
    config = ServeConfig.from_env({}, idle_timeout_s=5.0, keeper=args.keeper)
    return ActivatorPlan.build(args, config, environ or {}, gpu_ids=tuple(gpus))


def process_snapshot(tmp_path: Path) -> Path:
    snap = tmp_path / "snap"
    snap.mkdir()
    (snap / "manifest.json").write_text(json.dumps({"tier": "process"}))
    return snap


def test_each_gpu_gets_a_keeper_and_its_instances_are_told_where(tmp_path):
    snap = process_snapshot(tmp_path)
    plan = plan_for(
        "--snapshot", str(snap), "--keeper", "on", environ={"XDG_RUNTIME_DIR": "/run/u"}
    )
    assert plan.keeper_dir == f"/run/u/snapfn-{os.geteuid()}/keepers-{os.getpid()}"
    argv = plan.keeper_argv("1")
    assert argv[1:4] == ["-m", "snapfn.handler.cli", "keeper"]
    assert argv[argv.index("--socket") + 1] == f"{plan.keeper_dir}/gpu1.sock"
    assert argv[argv.index("--device") + 1] == "0"  # GPU 1 is device 0 once it is the only one
    assert argv[argv.index("--snapshot") + 1] == str(snap.resolve())
    assert plan.keeper_env("1")["CUDA_VISIBLE_DEVICES"] == "1"
    env = plan.instance_env("1", parent_pid=1)
    assert env["SNAPFN_PINNED_SOCKET"] == f"{plan.keeper_dir}/gpu1.sock"
    assert env["CUDA_VISIBLE_DEVICES"] == "1"


def test_a_keeper_holds_only_a_local_process_snapshot(tmp_path):
    portable = tmp_path / "portable"
    portable.mkdir()
    (portable / "manifest.json").write_text(json.dumps({"tier": "portable"}))
    for snapshot in (str(portable), "s3://bucket/snap"):
        plan = plan_for("--snapshot", snapshot, "--keeper", "on")
        assert plan.keeper_snapshot is None and "--snapshot" not in plan.keeper_argv("0")
    off = plan_for("--snapshot", str(process_snapshot(tmp_path)))
    assert off.keeper_dir == "" and "SNAPFN_PINNED_SOCKET" not in off.instance_env("0", 1)


def test_keeper_on_is_refused_without_a_gpu_or_an_activator():
    with pytest.raises(BadRequest, match="needs a GPU"):
        plan_for("--keeper", "on", gpus=())
    with pytest.raises(BadRequest, match="keeper needs idle_timeout_s"):
        ServeConfig.from_env({"SNAPFN_KEEPER": "on"})
    with pytest.raises(BadRequest, match="keeper must be on or off"):
        ServeConfig.from_env({"SNAPFN_KEEPER": "yes"}, idle_timeout_s=5.0)
    assert ServeConfig.from_env({"SNAPFN_KEEPER": "on"}, idle_timeout_s=5.0).keeper == "on"


class StandInPlan:
    """A plan whose keeper command is a small Python program: it records its GPU, then waits
    for SIGTERM (`exit_code` set: it exits at once with that status instead)."""

    def __init__(self, plan: ActivatorPlan, out: Path, exit_code: int | None = None) -> None:
        self._plan, self._out, self._exit = plan, out, exit_code

    def __getattr__(self, name):
        return getattr(self._plan, name)

    def keeper_argv(self, gpu: str) -> list[str]:
        then = "time.sleep(60)" if self._exit is None else f"sys.exit({self._exit})"
        code = (
            "import os, sys, time; from pathlib import Path;"
            f"Path({str(self._out)!r}, 'gpu' + os.environ['CUDA_VISIBLE_DEVICES'])"
            f".write_text('up'); {then}"
        )
        return [sys.executable, "-c", code]


def wait_for(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_keepers_start_with_their_gpu_and_stop_with_the_activator(tmp_path):
    plan = plan_for("--keeper", "on", environ={"XDG_RUNTIME_DIR": str(tmp_path)})
    keepers = Keepers(StandInPlan(plan, tmp_path))
    keepers.start()
    try:
        for directory in (Path(plan.keeper_dir).parent, Path(plan.keeper_dir)):  # both private
            st = directory.stat()
            assert (st.st_mode & 0o777, st.st_uid) == (0o700, os.geteuid()), directory
        wait_for(lambda: (tmp_path / "gpu0").exists() and (tmp_path / "gpu1").exists())
        assert keepers.exited() == {}
        procs = list(keepers.procs.values())
    finally:
        keepers.stop()
    assert [p.returncode for p in procs] == [-15, -15]  # SIGTERM, which a real keeper handles
    assert not os.path.exists(plan.keeper_dir) and keepers.procs == {}


def test_a_keeper_that_exits_is_reported_not_fatal(tmp_path):
    plan = plan_for("--keeper", "on", gpus=("0",), environ={"XDG_RUNTIME_DIR": str(tmp_path)})
    keepers = Keepers(StandInPlan(plan, tmp_path, exit_code=3))
    keepers.start()
    wait_for(lambda: keepers.exited() == {"0": 3})
    keepers.stop()
    off = Keepers(plan_for())
    off.start()  # keeper off: nothing starts
    assert off.procs == {}


def test_no_keeper_starts_in_a_socket_directory_that_is_not_private(tmp_path, caplog):
    plan = plan_for("--keeper", "on", environ={"XDG_RUNTIME_DIR": str(tmp_path)})
    parent = Path(plan.keeper_dir).parent
    parent.mkdir()
    parent.chmod(0o755)  # e.g. made by someone else, or by hand
    keepers = Keepers(StandInPlan(plan, tmp_path))
    with caplog.at_level("WARNING", logger="snapfn.activator"):
        keepers.start()
    assert keepers.procs == {} and not (tmp_path / "gpu0").exists()
    assert f"no keepers: {parent} is mode 0755, not 0700" in caplog.text
    keepers.stop()
    assert parent.is_dir() and parent.stat().st_mode & 0o777 == 0o755  # left as it was
