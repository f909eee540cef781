"""Continuous batching: chunked prefill and decode under a token budget.

Admission reserves every page a request can ever need (prompt + max_new_tokens, capped at the
model length) before it runs, so a running request can never run out of cache mid-generation
and no request's pages are ever shared or reclaimed under it. A request that does not fit now
waits in FIFO order; one that could never fit was already refused by the engine.

Each step schedules decodes first (one token per running request: latency), then prefill chunks
of waiting-to-finish prompts until `max_num_batched_tokens` is spent.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from snapfn.handler.llm.engine.kv_pool import PageAllocator
from snapfn.handler.llm.engine.request import Request, RequestState


@dataclass
class ScheduledStep:
    requests: list[Request]
    token_ids: list[list[int]]  # new tokens per request
    start_positions: list[int]

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)


class Scheduler:
    def __init__(
        self,
        allocator: PageAllocator,
        page_size: int,
        max_running_requests: int,
        max_num_batched_tokens: int,
        max_model_len: int,
    ) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.max_running_requests = max_running_requests
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def pages_needed(self, req: Request) -> int:
        tokens = min(len(req.prompt_ids) + req.params.max_new_tokens, self.max_model_len)
        return -(-tokens // self.page_size)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def can_admit(self) -> bool:
        """Whether the next `schedule` would admit the head of the queue."""
        return (
            bool(self.waiting)
            and len(self.running) < self.max_running_requests
            and self.allocator.num_free >= self.pages_needed(self.waiting[0])
        )

    def schedule(self) -> ScheduledStep | None:
        self._admit()
        step = ScheduledStep([], [], [])
        budget = self.max_num_batched_tokens
        decodes = [r for r in self.running if r.num_computed >= len(r.prompt_ids)]
        prefills = [r for r in self.running if r.num_computed < len(r.prompt_ids)]
        for req in decodes + prefills:
            n = min(req.num_tokens - req.num_computed, budget)
            if n <= 0:
                break
            step.requests.append(req)
            step.token_ids.append(req.all_ids[req.num_computed : req.num_computed + n])
            step.start_positions.append(req.num_computed)
            budget -= n
        return step if step.requests else None

    def _admit(self) -> None:
        # FIFO: a head that does not fit waits for pages; nothing overtakes it
        while self.can_admit():
            req = self.waiting.popleft()
            req.pages = self.allocator.allocate(self.pages_needed(req))
            req.state = RequestState.RUNNING
            self.running.append(req)

    def finish(self, req: Request, reason: str) -> None:
        """Mark finished and return its pages; safe for waiting, running or finished requests."""
        if req.finished:
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.pages:
            self.allocator.free(req.pages)
            req.pages = []
        req.state = RequestState.FINISHED
        req.finish_reason = reason
