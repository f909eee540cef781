"""Rank 0 drives the other ranks of a tensor-parallel engine in lock step.

Every rank of a tensor-parallel engine (and of an expert-parallel one with the `replicated`
exchange) runs every request: each forward is one collective call per layer on every rank, so
the ranks' engines must hold the same requests and take the same steps. Rank 0 serves (HTTP,
SQS); its service (`LLMService` with a `Lockstep`) adds and cancels requests only between steps,
and before each step tells the others what it added and cancelled and whether it steps
(`Lockstep.send`). The others (`follow`, in `python -m snapfn.handler.llm.follower`) apply the
same changes and step with it; their schedulers, fed the same requests in the same order, make
the same batches, and a sampled draw is rank 0's (`tensor_parallel.broadcast_tokens`).

The messages are JSON (no pickle) over a gloo group of the whole world (`cpu_group`). While idle
rank 0 sends an empty message at every idle wake (`idle_wait_s`), so that the others never wait
in a collective past the group's timeout. A `{"stop": true}` message ends `follow`.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from snapfn.handler.llm.engine.engine import Engine
from snapfn.handler.llm.engine.request import SamplingParams
from snapfn.handler.llm.parallel import ParallelConfig


class Lockstep:
    """The control channel of a group of ranks (every rank makes one, at the same point)."""

    def __init__(self, parallel: ParallelConfig) -> None:
        from snapfn.handler.llm.models.tensor_parallel import cpu_group, groups

        groups(parallel)  # the world is the one `parallel` asks for
        self.parallel = parallel
        self.group = cpu_group()

    def send(self, message: dict[str, Any]) -> None:
        """Rank 0: `message` to every other rank."""
        data = json.dumps(message, separators=(",", ":")).encode()
        self._broadcast(torch.tensor([len(data)], dtype=torch.int64))
        self._broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def receive(self) -> dict[str, Any]:
        """Another rank: rank 0's next message."""
        size = torch.zeros(1, dtype=torch.int64)
        self._broadcast(size)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        self._broadcast(data)
        return json.loads(bytes(data.numpy()))

    def _broadcast(self, t: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.broadcast(t, src=0, group=self.group)


def apply(engine: Engine, changes: list[list[Any]]) -> None:
    """The adds (`["add", id, prompt_ids, params]`) and cancels (`["cancel", id]`) of one
    message, in order."""
    for change in changes:
        if change[0] == "add":
            _, request_id, prompt_ids, params = change
            engine.add_request(prompt_ids, SamplingParams.from_json(params), request_id=request_id)
        elif change[0] == "cancel":
            engine.cancel(change[1])
        else:
            raise ValueError(f"unknown lock-step change {change[0]!r}")


def follow(engine: Engine, lockstep: Lockstep) -> None:
    """Another rank's loop: rank 0's changes applied, its steps taken, until it says stop."""
    while True:
        message = lockstep.receive()
        if message.get("stop"):
            return
        apply(engine, message.get("changes", []))
        if message.get("step"):
            engine.step()
