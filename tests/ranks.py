"""Tests over several torch.distributed ranks on one machine: spawned processes that each join
one group (gloo on CPU, NCCL with a GPU each), run, and leave."""

from __future__ import annotations

import multiprocessing
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist


def run_ranks(target, world: int, *args, timeout_s: float = 300) -> None:
    """`target(rank, world, port, *args)` in `world` spawned processes (a module-level function:
    spawn imports it); fails on a rank that exits badly or outlives `timeout_s`, and kills it."""
    context = multiprocessing.get_context("spawn")
    port = free_port()
    ranks = [context.Process(target=target, args=(r, world, port, *args)) for r in range(world)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout_s)
    for process in ranks:
        process.kill()  # one stuck in a collective: the test fails below, nothing lingers
        assert process.exitcode == 0, f"rank exited {process.exitcode}"


def join_group(rank: int, world: int, port: int, cuda: bool = False) -> None:
    """This process as rank `rank` of `world` on 127.0.0.1:`port`, NCCL on GPU `rank` or gloo.
    A collective that one rank never joins fails in a minute, not gloo's default half hour."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if cuda:
        torch.cuda.set_device(rank)  # NCCL runs on each rank's current device
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=60))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
