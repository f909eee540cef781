"""`parent_watch.py`: an instance started with SNAPFN_PARENT_PID dies with that parent."""

from __future__ import annotations

import subprocess
import sys
import time

from snapfn.handler.activator.parent_watch import PARENT_PID_VARIABLE
from snapfn.snapshot.process.criu import is_running

CHILD = """
import os, time
from snapfn.handler.activator.parent_watch import exit_with_parent
assert exit_with_parent(os.environ)
print("armed", flush=True)
time.sleep(60)
"""
# the parent starts the child, waits until it is armed, prints its pid and dies at once
PARENT = f"""
import os, subprocess, sys
env = {{**os.environ, {PARENT_PID_VARIABLE!r}: str(os.getpid())}}
child = subprocess.Popen([sys.executable, "-c", {CHILD!r}], stdout=subprocess.PIPE, env=env)
child.stdout.readline()
print(child.pid, flush=True)
os._exit(0)
"""


running = is_running


def test_the_child_gets_sigterm_when_its_parent_dies():
    parent = subprocess.run(
        [sys.executable, "-c", PARENT], capture_output=True, text=True, timeout=60, check=True
    )
    child = int(parent.stdout.strip())
    deadline = time.monotonic() + 10
    while running(child) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not running(child)


def test_a_parent_already_gone_is_reported_and_no_variable_does_nothing():
    # NOTE: in a subprocess: the prctl would otherwise stay armed on the test runner itself
    check = (
        "import os; from snapfn.handler.activator.parent_watch import exit_with_parent as e; "
        f"print(e({{}}), e({{{PARENT_PID_VARIABLE!r}: str(os.getppid() + 1)}}))"
    )
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["True", "False"], done.stderr
