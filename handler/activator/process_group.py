"""Signal and clear a whole process group: an instance's gunicorn master and all its workers.

Contract: the activator starts each instance as the leader of a new session, so the instance's
pid is also its process group id and every worker it forks is in that group.
- `signal_group(pgid, sig)` signals every member; a group already gone is not an error.
- `live_members(pgid)` lists the members still running, read from `/proc` (a zombie holds no
  memory, so it does not count: orphaned workers wait there for init to reap them).
- `clear_group(pgid, timeout_s)` SIGKILLs the group and waits until no member runs, so the
  memory (host and GPU) of a stopped or crashed instance is released before the activator
  starts a replacement in its place. It returns the members still running at the timeout.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

from snapfn.snapshot.process.proc_stat import GONE_STATES, stat_fields

PROC = Path("/proc")
CLEAR_POLL_S = 0.01


def signal_group(pgid: int, sig: int) -> bool:
    """Send `sig` to the group; False if no process is left in it."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True


def live_members(pgid: int, proc: Path = PROC) -> list[int]:
    """Pids of the group's members that have not exited (zombies excluded)."""
    members = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        fields = stat_fields(entry / "stat")
        if fields is None:  # exited while we looked
            continue
        if int(fields[2]) == pgid and fields[0] not in GONE_STATES:
            members.append(int(entry.name))
    return members


async def clear_group(pgid: int, timeout_s: float = 10.0) -> list[int]:
    """SIGKILL the group, then wait until none of it runs; the members left at the timeout."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while signal_group(pgid, signal.SIGKILL):
        left = live_members(pgid)
        if not left or loop.time() >= deadline:
            return left
        await asyncio.sleep(CLEAR_POLL_S)
    return []
