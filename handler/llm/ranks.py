"""One command, many ranks: `--tp-size N [--ep-size M]` runs `N * M` processes on one machine.

Under torchrun (RANK and WORLD_SIZE set) a process is the rank torchrun gave it. Otherwise the
process the user started is rank 0 and starts the others itself, as vLLM's
`--tensor-parallel-size` does: `snapfn generate` runs its own command line again
(`python -m snapfn.handler.cli` with the arguments it was given); a server or queue worker, which serves as rank 0, starts
`python -m snapfn.handler.llm.follower` (`command`). Each gets its rank in its environment
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT: torchrun's names), its output on rank
0's stderr, none on stdout. The ranks meet over NCCL on CUDA (`cuda:LOCAL_RANK` each) and gloo
on CPU.

Ranks are laid out `rank = ep_rank * tp_size + tp_rank` (`models/tensor_parallel.py`). A rank
that dies takes the group down: rank 0 watches the ranks it started and, when one exits with an
error, stops the others and fails with `RankFailed` naming the rank and its status (or, when it
is not in a collective that fails first, exits with that line on stderr, status 1); the ranks
it started exit when rank 0 is gone (each watches its parent pid). A rank that hangs in a
collective gives up after `SNAPFN_RANK_TIMEOUT_S` (default 300 s).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta

from snapfn.handler.llm.parallel import ParallelConfig
from snapfn.snapshot.errors import BadRequest, RankFailed

SPAWNED_BY = "SNAPFN_RANK_PARENT"  # set in the ranks rank 0 starts: they start none
DEFAULT_TIMEOUT_S = 300.0


def rank_layout(tp_size: int, ep_size: int, rank: int, ep_dispatch: str) -> ParallelConfig:
    """The `ParallelConfig` of world rank `rank`."""
    return ParallelConfig(
        tp_size=tp_size,
        tp_rank=rank % tp_size,
        ep_size=ep_size,
        ep_rank=rank // tp_size,
        ep_dispatch=ep_dispatch,
    )


@contextmanager
def parallel_ranks(
    tp_size: int,
    ep_size: int,
    ep_dispatch: str,
    device: str,
    environ: Mapping[str, str] | None = None,
    command: list[str] | None = None,
    extra_env: Mapping[str, str] | None = None,
    on_rank_exit: Callable[[str], None] | None = None,
) -> Iterator[tuple[ParallelConfig, str]]:
    """(this process's `ParallelConfig`, its device), inside the process group of all ranks
    (left afterwards). One rank: no group, `device` as given. `command`: what the ranks this
    process starts run (`snapfn generate`: its own command line again), with `extra_env` in
    their environment; None outside torchrun is refused.
    `on_rank_exit(reason)`: what a rank's death does once the others are stopped (a server
    marks itself failed, its /health saying why); by default this process exits with the reason.
    """
    environ = os.environ if environ is None else environ
    for name, size in (("--tp-size", tp_size), ("--ep-size", ep_size)):
        if size < 1:
            raise BadRequest(f"{name} must be >= 1, got {size}")
    world = tp_size * ep_size
    if world == 1:
        yield ParallelConfig(ep_dispatch=ep_dispatch), device
        return
    started: list[subprocess.Popen] = []
    if "RANK" not in environ:
        if command is None:
            raise BadRequest(
                f"{world} ranks: RANK and WORLD_SIZE are not set (torchrun sets them) and no"
                " command was given for the ranks to start"
            )
        environ, started = _start_ranks(world, device, command, dict(extra_env or {}))
    rank, local = _rank_from(environ, world, tp_size, ep_size)
    parallel = rank_layout(tp_size, ep_size, rank, ep_dispatch)
    if device == "cuda":
        device = f"cuda:{local}"
    watcher = _watch(started, on_rank_exit) if started else None
    try:
        _join_group(environ, device, world, rank)
        try:
            yield parallel, device
        except Exception:
            if watcher is not None and (dead := watcher.dead(wait_s=3.0)) is not None:
                raise RankFailed(dead) from None  # the cause, not the collective it broke
            raise
        finally:
            _leave_group()
        for proc in started:
            proc.wait()
    finally:
        if watcher is not None:
            watcher.done.set()
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _rank_from(
    environ: Mapping[str, str], world: int, tp_size: int, ep_size: int
) -> tuple[int, int]:
    sizes = f"--tp-size {tp_size} --ep-size {ep_size}"
    try:
        rank, size = int(environ["RANK"]), int(environ["WORLD_SIZE"])
        local = int(environ.get("LOCAL_RANK", rank))
    except (KeyError, ValueError):
        raise BadRequest(
            f"{sizes}: RANK and WORLD_SIZE must be integers (torchrun sets them; unset, this"
            " command starts its own ranks)"
        ) from None
    if size != world:
        raise BadRequest(f"{sizes} needs {world} ranks but WORLD_SIZE={size}")
    if not 0 <= rank < world:
        raise BadRequest(f"RANK={rank} is outside WORLD_SIZE={world}")
    return rank, local


def _start_ranks(
    world: int, device: str, argv: list[str], extra_env: dict[str, str]
) -> tuple[dict[str, str], list[subprocess.Popen]]:
    """Start ranks 1 … world-1 running `argv`; this process's environment as rank 0."""
    base = {**os.environ, "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1"}
    base["MASTER_PORT"] = str(free_port())
    theirs = {SPAWNED_BY: str(os.getpid()), **extra_env}
    started = []
    print(f"[snapfn] starting ranks 1-{world - 1} of {world} ({device})", file=sys.stderr)
    for rank in range(1, world):
        env = {**base, **theirs, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        started.append(
            subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        )
    return {**base, "RANK": "0", "LOCAL_RANK": "0"}, started


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Watcher(threading.Thread):
    """Rank 0's watch over the ranks it started: one that exits with an error stops them all."""

    def __init__(self, started: list[subprocess.Popen], on_exit) -> None:
        super().__init__(daemon=True, name="snapfn-rank-watch")
        self.started, self.on_exit = started, on_exit
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.5):
            reason = self._first_dead()
            if reason is not None and not self.done.is_set():
                print(f"[snapfn] {reason}", file=sys.stderr, flush=True)
                if self.on_exit is None:
                    os._exit(1)
                self.done.set()
                self.on_exit(reason)

    def dead(self, wait_s: float) -> str | None:
        """Why the group is down (a rank that exited with an error, the others stopped), waiting
        up to `wait_s` for one; None if every rank lives. The watch ends here."""
        deadline = time.monotonic() + wait_s
        while (reason := self._first_dead()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        self.done.set()
        return reason

    def _first_dead(self) -> str | None:
        for rank, proc in enumerate(self.started, start=1):
            code = proc.poll()
            if code not in (None, 0):
                for other in self.started:
                    if other.poll() is None:
                        other.kill()
                return f"rank {rank} exited with status {code}: the group is down"
        return None


def _watch(started: list[subprocess.Popen], on_exit) -> _Watcher:
    watcher = _Watcher(started, on_exit)
    watcher.start()
    return watcher


def _join_group(environ: Mapping[str, str], device: str, world: int, rank: int) -> None:
    import torch.distributed as dist

    if environ.get(SPAWNED_BY):
        _exit_with(int(environ[SPAWNED_BY]))
    if device.startswith("cuda"):
        import torch

        torch.cuda.set_device(device)
    timeout = timedelta(seconds=float(environ.get("SNAPFN_RANK_TIMEOUT_S") or DEFAULT_TIMEOUT_S))
    init = f"tcp://{environ.get('MASTER_ADDR', '127.0.0.1')}:{environ.get('MASTER_PORT', '29500')}"
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=init, world_size=world, rank=rank, timeout=timeout)


def _exit_with(parent: int) -> None:
    """End this rank when rank 0, which started it, is gone: its parent pid changes. Polled on a
    thread, not `PR_SET_PDEATHSIG`: that follows the thread that forked, and rank 0 may start
    its ranks from a thread that ends (a server's start-up thread)."""
    if os.getppid() != parent:
        raise BadRequest("rank 0, which started this rank, has exited")

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        print("[snapfn] rank 0 is gone: this rank exits", file=sys.stderr, flush=True)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="snapfn-rank0-watch").start()


def _leave_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
