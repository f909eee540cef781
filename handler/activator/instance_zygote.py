"""Activator instances forked from a zygote instead of started as fresh interpreters.

    zygote = start_zygote(plan)                   a Zygote (snapshot/zygote) that imported the
                                                  serve stack and the target's modules, CUDA
                                                  untouched; None (the reason logged) if it
                                                  could not start or SNAPFN_INSTANCE_ZYGOTE=off
    process = await fork_instance(zygote, argv, env)
                                                  one instance: `snapfn serve` run by a fork of
                                                  it, seen as Instance drives a subprocess
                                                  (pid, returncode, stdout)

The zygote's preload is `snapfn.handler.activator.instance_preload`, whose import does the work
(it reads the instance's serve flags from SNAPFN_INSTANCE_ARGV). Each fork is its own session
(pid = process group, as a subprocess started with start_new_session is) and the zygote's child:
its parent-death signal follows the zygote, which the activator's exit closes (the zygote
watches its owner's pipe and kills its workers), so `SNAPFN_PARENT_PID` names the zygote.
Tier 0 and cold starts gain the imports (torch among them); a process-snapshot restore gains
the serve stack's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

log = logging.getLogger("snapfn.activator")
ARGV_VARIABLE = "SNAPFN_INSTANCE_ARGV"  # the serve flags the zygote preloads for
SWITCH_VARIABLE = "SNAPFN_INSTANCE_ZYGOTE"  # "off": every instance a fresh interpreter
PRELOAD = ("snapfn.handler.activator.instance_preload",)
TARGET = "snapfn.handler.activator.instance_zygote:run_instance"


def serve_flags(instance_argv: Sequence[str]) -> list[str]:
    """`python -m snapfn.handler.cli serve FLAGS…` → ["serve", FLAGS…] (what cli.main takes)."""
    argv = list(instance_argv)
    return argv[argv.index("serve") :]


def start_zygote(plan: Any, environ: Mapping[str, str] = os.environ):
    """The instances' zygote, or None (logged: instances then start as fresh interpreters)."""
    from snapfn.snapshot.errors import SnapfnError
    from snapfn.snapshot.zygote.owner import Zygote

    if environ.get(SWITCH_VARIABLE, "on") == "off":
        log.info("instances start as fresh interpreters (%s=off)", SWITCH_VARIABLE)
        return None
    env = {**dict(plan.base_env), ARGV_VARIABLE: json.dumps(serve_flags(plan.instance_argv))}
    start = time.monotonic()
    try:
        zygote = Zygote.start(PRELOAD, env=env, start_timeout_s=600.0)
    except (SnapfnError, OSError, ValueError) as exc:  # a speed-up only: never fatal
        first = str(exc).splitlines()[0] if str(exc) else repr(exc)
        log.warning("no instance zygote (instances start as fresh interpreters): %s", first)
        return None
    log.info(
        "instance zygote %d ready in %.2f s (imports %.2f s): instances fork from it",
        zygote.pid,
        time.monotonic() - start,
        zygote.preload_seconds,
    )
    return zygote


class ForkedProcess:
    """An instance forked by the zygote, with the parts of asyncio.subprocess.Process that
    Instance uses: `pid`, `returncode` (set once the zygote reports the exit), `stdout`."""

    def __init__(self, worker: Any, stdout: asyncio.StreamReader) -> None:
        self.pid = worker.pid
        self.returncode: int | None = None
        self.stdout = stdout
        self._worker = worker
        threading.Thread(target=self._wait, name=f"snapfn-fork-{self.pid}", daemon=True).start()

    def _wait(self) -> None:
        try:
            code = self._worker.wait()
        except Exception as exc:  # the zygote went away: the instance went with it
            log.warning("instance pid %d: %s", self.pid, exc)
            code = -9
        self.returncode = code


async def fork_instance(zygote: Any, argv: Sequence[str], env: Mapping[str, str]) -> ForkedProcess:
    """Fork one instance running `snapfn serve` with `argv`'s flags and `env` applied, its
    stdout a pipe read here, stdin /dev/null, stderr the activator's."""
    loop = asyncio.get_running_loop()
    read_fd, write_fd = os.pipe()
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        worker = await asyncio.to_thread(
            zygote.fork,
            TARGET,
            {"argv": serve_flags(argv)},
            env=dict(env),
            stdin=null,
            stdout=write_fd,
        )
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)
        os.close(null)
    reader = asyncio.StreamReader()
    pipe = os.fdopen(read_fd, "rb", buffering=0)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
    worker.channel.close()  # the instance speaks HTTP; only the exit report is read
    return ForkedProcess(worker, reader)


def run_instance(args: dict[str, Any], channel: Any) -> None:
    """The fork's target: `snapfn serve` with the instance's flags; exits with its code."""
    import sys

    from snapfn.handler.cli import main

    channel.close()
    sys.exit(main(list(args["argv"])))
