"""Tier 1 without root, as the shipped container runs it (USER 10001, every capability dropped
but the three criu needs): `infra/install-criu.sh --capabilities` gives criu its file
capabilities, then a function is initialised into a process snapshot and restored from it by
uid 10001 with a bounding set of CAP_SYS_ADMIN, CAP_SYS_PTRACE and CAP_SETPCAP only.
With no_new_privs (Kubernetes' allowPrivilegeEscalation: false) criu cannot work and doctor says
why. Needs root (to install and to switch user), setpriv and the Debian mirror; skips otherwise."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent
USER = "10001"
BOUNDING = "-all,+sys_admin,+sys_ptrace,+setpcap"  # what the deployment files grant
RESTORE = """
import sys
from pathlib import Path
from snapfn.handler.function.runtime import WorkerRuntime
from snapfn.handler.function.target import ServeTarget
target = ServeTarget(kind="function", function="examples.hello:handler", snapshot_dir=Path(sys.argv[1]))
rt = WorkerRuntime(target)
rt.start(background=False)
print("TIER", rt.startup.tier, rt.startup.fallbacks, rt.invoke({"name": "Ada"})["restores"])
rt.close()
"""


@pytest.fixture(scope="module")
def setup():
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv (util-linux) to run as another user")
    from snapfn.snapshot.process.doctor import CRIU_CAPABILITIES

    status = Path("/proc/self/status").read_text()
    bounding = int(status.split("CapBnd:")[1].split()[0], 16)
    lacking = [cap for cap, bit in CRIU_CAPABILITIES.items() if not bounding >> bit & 1]
    if lacking:  # a bounding set cannot grow: the user could not be given them
        pytest.skip(f"this machine's bounding set lacks {', '.join(lacking)}")
    home = Path(tempfile.mkdtemp(prefix="snapfn-unprivileged-"))
    os.chmod(home, 0o755)
    prefix = home / "criu"
    done = subprocess.run(
        ["bash", str(REPO / "infra/install-criu.sh"), "--prefix", str(prefix), "--capabilities"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode != 0:
        shutil.rmtree(home, ignore_errors=True)
        pytest.skip(f"install-criu.sh --capabilities failed here: {done.stderr.strip()[-300:]}")
    work = home / "work"
    work.mkdir()
    os.chown(work, int(USER), int(USER))
    env = {**os.environ, "HOME": str(work), "XDG_RUNTIME_DIR": str(work)}
    env.update(SNAPFN_CRIU=str(prefix / "bin/criu"), SNAPFN_CACHE_DIR=str(work / "cache"))
    env.pop("SNAPFN_CRIU_PREFIX", None)
    yield work, env
    shutil.rmtree(home, ignore_errors=True)


def as_user(argv: list[str], env: dict[str, str], *extra: str) -> subprocess.CompletedProcess:
    switch = ["setpriv", f"--reuid={USER}", f"--regid={USER}", "--clear-groups"]
    switch += ["--bounding-set", BOUNDING, *extra]
    return subprocess.run(
        [*switch, *argv], capture_output=True, text=True, env=env, cwd=REPO, timeout=300
    )


def test_a_non_root_user_makes_and_restores_a_process_snapshot(setup):
    work, env = setup
    spawn = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'pass'], check=True)"
    probe = as_user([sys.executable, "-c", spawn], env)  # the worker is such a child
    if probe.returncode != 0:
        pytest.skip(f"uid {USER} cannot run this interpreter: {probe.stderr.strip()[-200:]}")
    init = [sys.executable, "-m", "snapfn.handler.cli", "init", "--function"]
    init += ["examples.hello:handler", "--snapshot", str(work / "snap")]
    done = as_user(init, env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "snapshot (process)" in done.stdout, done.stderr[-2000:]
    for _ in range(2):
        done = as_user([sys.executable, "-c", RESTORE, str(work / "snap")], env)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "TIER process [] 1" in done.stdout, done.stdout + done.stderr[-2000:]


def test_no_new_privs_keeps_criu_from_working_and_doctor_says_why(setup):
    _, env = setup
    done = as_user([sys.executable, "-m", "snapfn.handler.cli", "doctor"], env, "--no-new-privs")
    assert "allowPrivilegeEscalation: false" in done.stdout, done.stdout
    assert "FAIL  tier 1 (process)" in done.stdout
