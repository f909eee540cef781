"""The process that a process snapshot (tier 1) checkpoints: init, wait, be dumped, be restored.

    python -m snapfn.snapshot.process.worker HOST_TARGET ARGS_JSON READ_FD WRITE_FD

Run by `process.spawn` with the channel's pipe ends on READ_FD and WRITE_FD, stdout and stderr
on a third pipe, stdin on /dev/null. Its life, as the owner sees it on the channel:

    <- {"event": "initialized", ...host.init()}          the warmed state is built
    -> {"op": "checkpoint"}
    <- {"event": "ready", "hooks": [...], "uses_cuda": b} before-snapshot hooks ran; now idle
       (the owner locks and checkpoints its GPU state and criu dumps it here, killing it)
    -> {"op": "resume", ...}                             sent by each restorer to its restored copy
    <- {"event": "restored", "identity": {...}, "t0": s, "stages": [...]}   then it serves:
    -> {"op": ..., "id": ...}                            host.handle(message, send) on a thread
    -> {"op": "close"} or EOF                            host.close(), exit 0

Any failure is reported as {"event": "failed", "step": str, "error": str} before exiting 1.

A host is what HOST_TARGET ("pkg.module:factory") returns for ARGS_JSON, with methods
`init() -> dict`, `before_snapshot() -> list[str]`, `after_restore(resume) -> {"t0": wall clock, "stages": [StageRecord JSON]}`, `handle(message, send)`, `close()` and attribute `uses_cuda`;
optionally `checkpoint_figures` (dict), `region_specs` (what a restorer may make and fill
for it beside criu: snapshot/keeper/region_prefetch.py; the resume message then names the socket as
"regions") and `checkpoint_registered` (snapshot files it wrote at checkpoint, with their chunk
digests: [[relpath, chunk_bytes, chunk_sha256, file_sha256]], registered as `init()`'s are).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import traceback
from typing import Any

from snapfn.snapshot.process import identity
from snapfn.snapshot.process.pipe_channel import PipeChannel
from snapfn.snapshot.zygote.channel import resolve_target

EXIT_FAILED = 1


def main(argv: list[str]) -> int:
    if os.getsid(0) != os.getpid():
        os.setsid()  # criu restores a session leader without a terminal (no --shell-job)
    _stdin_from_here()
    fds = [int(argv[3]), int(argv[4])]
    channel = PipeChannel(*fds)
    step = "init"
    try:
        host = resolve_target(argv[1])(json.loads(argv[2]))
        channel.send({"event": "initialized", **host.init()})
        message = channel.recv()
        if message is None or message.get("op") != "checkpoint":
            host.close()
            return 0
        step = "before_snapshot"
        hooks = host.before_snapshot()
        _quiesce()
        channel.send(
            {
                "event": "ready",
                "hooks": hooks,
                "uses_cuda": bool(host.uses_cuda),
                "fds": fds,
                "figures": getattr(host, "checkpoint_figures", {}),
                "regions": getattr(host, "region_specs", []),
                "registered": getattr(host, "checkpoint_registered", []),
            }
        )
        message = channel.recv()  # the dump happens while waiting here; a restore resumes here
        if message is None or message.get("op") != "resume":
            host.close()
            return 0
        step = "after_restore"
        found = identity.refresh()
        channel.send({"event": "restored", "identity": found, **host.after_restore(message)})
    except Exception as exc:
        traceback.print_exc()
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
        channel.send({"event": "failed", "step": step, "error": reason})
        return EXIT_FAILED
    serve(host, channel)
    sys.stdout.flush()
    sys.stderr.flush()
    # NOTE: exit without interpreter finalization: a restored process's native threads (torch's
    # pools) do not survive finalization reliably, and there is nothing left to clean up.
    os._exit(0)


def serve(host: Any, channel: PipeChannel) -> None:
    """Answer requests until close or EOF; each request runs on its own thread."""
    while True:
        message = channel.recv()
        if message is None or message.get("op") == "close":
            break
        threading.Thread(
            target=_handle, args=(host, message, channel.send), daemon=True, name="snapfn-req"
        ).start()
    host.close()


def _handle(host: Any, message: dict[str, Any], send: Any) -> None:
    try:
        host.handle(message, send)
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
        code = getattr(exc, "code", "internal_error")
        send({"id": message.get("id"), "event": "error", "code": code, "message": reason})


def _stdin_from_here() -> None:
    """Reopen stdin (/dev/null) in our own mount namespace. NOTE: the one our parent opened
    belongs to its mount namespace; in a worker with a mount namespace of its own
    (SNAPFN_PROCESS_PID_NAMESPACE=mount) criu cannot place it and refuses the dump ("Can't
    lookup mount=… for fd=0 path=/dev/null")."""
    fd = os.open(os.devnull, os.O_RDONLY)
    if fd != 0:
        os.dup2(fd, 0)
        os.close(fd)


def _quiesce() -> None:
    """Before the dump: flush output; freeze the heap so no collection sweeps it after restore.

    NOTE: a full garbage collection touches every object; after a lazy-pages restore that
    pulls in the whole heap one page fault at a time (docs/criu.md). gc.freeze() moves every
    live object out of the collector's generations.
    """
    gc.collect()
    gc.freeze()
    sys.stdout.flush()
    sys.stderr.flush()
    if os.environ.get("SNAPFN_PROCESS_TRIM", "1") == "1":
        _malloc_trim()


def _malloc_trim() -> None:
    """Give the C heap's free pages back to the kernel (glibc keeps them in its arenas, and
    criu would dump them): 161.6 → 157.5 MB for the embedded model's CPU worker."""
    import contextlib
    import ctypes

    with contextlib.suppress(OSError, AttributeError):  # AttributeError: not glibc
        ctypes.CDLL(None).malloc_trim(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
