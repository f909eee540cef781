"""`process_group.py`: a whole process group is signalled, listed (zombies excluded) and cleared."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

from snapfn.handler.activator.process_group import clear_group, live_members, signal_group

# a group leader that forks two children, reports their pids, then sleeps with them
LEADER = """
import os, subprocess, sys, time
kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
print(" ".join(str(k.pid) for k in kids), flush=True)
time.sleep(60)
"""


def start_group() -> tuple[subprocess.Popen, list[int]]:
    leader = subprocess.Popen(
        [sys.executable, "-c", LEADER], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    kids = [int(p) for p in leader.stdout.readline().split()]
    return leader, kids


def test_live_members_lists_the_leader_and_its_children():
    leader, kids = start_group()
    try:
        assert sorted(live_members(leader.pid)) == sorted([leader.pid, *kids])
    finally:
        signal_group(leader.pid, signal.SIGKILL)
        leader.wait()


def test_clear_group_kills_children_a_dead_leader_left_behind():
    leader, kids = start_group()
    leader.kill()  # the leader only: its children run on, orphaned, in the same group
    leader.wait()
    assert sorted(live_members(leader.pid)) == sorted(kids)
    assert asyncio.run(clear_group(leader.pid)) == []
    assert live_members(leader.pid) == []


def test_a_group_that_is_gone_is_not_an_error():
    gone = subprocess.Popen(["true"], start_new_session=True)
    gone.wait()  # exited and reaped: no process has its group id now
    assert signal_group(gone.pid, signal.SIGTERM) is False
    assert live_members(gone.pid) == [] and asyncio.run(clear_group(gone.pid)) == []


def test_stat_fields_survive_a_command_name_with_spaces_and_parentheses(tmp_path):
    from snapfn.handler.activator.process_group import live_members
    from snapfn.snapshot.process.proc_stat import stat_fields

    for pid, comm, state, pgrp in [
        (11, "a) (b", "S", 77),
        (12, "zombie", "Z", 77),
        (13, "x", "R", 5),
    ]:
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} ({comm}) {state} 1 {pgrp} 77 0 -1\n")
    (tmp_path / "self").mkdir()  # not a pid: skipped
    assert stat_fields(tmp_path / "11" / "stat")[:3] == ["S", "1", "77"]
    assert stat_fields(tmp_path / "99" / "stat") is None  # gone
    assert live_members(77, tmp_path) == [11]  # the zombie has exited; 13 is another group
