"""The plan of the forward in progress, for one kind of flashinfer attention.

flashinfer splits attention into `plan()` (host work, which syncs, so never inside CUDA graph
capture) and `run()`. Every layer of a forward runs the same plan. `ForwardPlan` keeps it:
- a forward announced by `begin_forward` (decode graphs, before capture and before each
  replay) is planned there, into that graph's own wrapper and buffers;
- any other forward is planned by its first attention call; the later layers' calls see the
  same batch object and reuse the plan.
A plan also depends on the attention's shape, which only the first call shows; until then
`begin_forward` defers to that call, which for a graph is the warm-up run before its capture.
The batch is held, so that `is` never matches a new batch at a freed one's address.
`plan()` writes its metadata into a pinned host buffer and copies it to the GPU without
waiting: each plan waits for the last one's copy first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from snapfn.handler.llm.engine.batch import ForwardBatch
from snapfn.handler.llm.engine.copy_fence import CopyFence


def capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class ForwardPlan:
    """`plan(batch, graph, shape)` makes a plan; `for_call` returns the one this call needs."""

    def __init__(self, what: str, plan: Callable[[ForwardBatch, bool, Any], Any]) -> None:
        self._what, self._plan = what, plan
        self.batch: ForwardBatch | None = None
        self.graph = False
        self.shape: Any = None  # the shape seen last
        self.planned: Any = None  # the plan for `batch` and `shape` (None: not made yet)
        self._copied = CopyFence()

    def begin_forward(self, batch: ForwardBatch, graph: bool) -> None:
        self.batch, self.graph, self.planned = batch, graph, None
        if self.shape is not None:
            self.planned = self._make(batch, graph, self.shape)

    def for_call(self, batch: ForwardBatch, shape: Any) -> Any:
        if batch is not self.batch or shape != self.shape or self.planned is None:
            if capturing(batch.seq_lens.device):
                raise RuntimeError(
                    f"{self._what}: no plan for this batch inside CUDA graph capture; call "
                    "backend.begin_forward(batch, graph=True) and run it once before capturing"
                )
            graph = self.graph and batch is self.batch
            self.batch, self.graph, self.shape = batch, graph, shape
            self.planned = self._make(batch, graph, shape)
        return self.planned

    def _make(self, batch: ForwardBatch, graph: bool, shape: Any) -> Any:
        self._copied.wait()
        planned = self._plan(batch, graph, shape)
        self._copied.mark(batch.seq_lens.device)
        return planned
