"""A greedy decode step launched on the GPU whose tokens the host has not read yet.

The overlapped decode loop (`Engine.step`, `SchedulerConfig.overlap_decode`): while the GPU runs
step n, the host builds step n+1 (its input ids are step n's tokens, which never leave the
GPU: the replay copies them into the graph's inputs), launches it, and only then waits for
step n's tokens and streams them. The host's per-step work (scheduling, batch building,
attention planning, detokenizing) then hides behind the GPU's instead of adding to it.

    step = InFlightStep.launch(requests, logits, buffers)   # greedy picks, copied back async
    ...                                                     # launch the next step here
    for req, token, logprob in step.land(): ...             # waits for this step's copy only
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from snapfn.handler.llm.engine.copy_fence import HostCopy
from snapfn.handler.llm.engine.request import Request
from snapfn.handler.llm.engine.sampler import greedy_picks


class PickBuffers:
    """Two pinned `[rows, 2]` float64 buffers, used in turn: two steps are in flight at most
    (one landing while the next runs), so a step's copy never overwrites one still unread."""

    def __init__(self, max_rows: int) -> None:
        self._buffers = [
            torch.empty(max_rows, 2, dtype=torch.float64, pin_memory=True) for _ in range(2)
        ]
        self._turn = 0

    def next(self, rows: int) -> torch.Tensor:
        self._turn ^= 1
        return self._buffers[self._turn][:rows]


@dataclass
class InFlightStep:
    requests: list[Request]
    tokens: torch.Tensor  # [B] int64 on the device: the next step's input ids
    picked: HostCopy  # [B, 2] float64: token ids and their logprobs, to the host

    @classmethod
    def launch(
        cls,
        requests: list[Request],
        logits: torch.Tensor,
        buffers: PickBuffers | None,
        picks: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] = greedy_picks,
    ) -> InFlightStep:
        """Greedy picks of `logits [B, V]` (by `picks`, `sampler.greedy_picks`'s contract)
        enqueued, and their copy to the host; no wait."""
        tokens, picked = picks(logits)
        into = buffers.next(len(requests)) if buffers is not None else None
        return cls(requests, tokens, HostCopy.launch(picked, into))

    def land(self) -> list[tuple[Request, int, float]]:
        """Wait for this step's picks; (request, token, logprob) of the rows still running
        (a request that finished or was cancelled since the launch drops its row)."""
        rows = self.picked.land().tolist()  # float64 holds every token id exactly
        return [
            (req, int(token), logprob)
            for req, (token, logprob) in zip(self.requests, rows, strict=True)
            if not req.finished
        ]
