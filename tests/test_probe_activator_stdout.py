"""An instance's stdout lines longer than the activator's pipe reader takes at once (64 KiB):
the activator keeps reading (and logging) the pipe, before and after the URL line, so an
instance that prints one never blocks on its next print with a full pipe."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

from snapfn.handler.activator.app import _instance_session
from snapfn.handler.activator.instance import Instance, InstanceFailed

# prints overlong lines around its URL, then 2 MB more, then exits 0 (its /health never answers)
PRINTER = """
print("x" * 100_000)
print("snapfn serve: listening on http://127.0.0.1:9 (a port nothing answers)", flush=True)
print("y" * 100_000)
for _ in range(20_000):
    print("z" * 100)
"""


def test_overlong_stdout_lines_are_read_past_and_the_pipe_kept_drained():
    async def run():
        async with _instance_session() as session:
            argv = [sys.executable, "-c", PRINTER]
            instance = Instance(1, None, argv, dict(os.environ), session, grace_s=1.0)
            with pytest.raises(InstanceFailed) as failed:
                await instance.start(timeout_s=10)
            assert "exited (code 0) while starting" in str(failed.value)
            assert instance.url == "http://127.0.0.1:9"
            await instance.kill()

    asyncio.run(asyncio.wait_for(run(), 20))
