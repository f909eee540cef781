"""Continuous batching: chunked prefill and decode under a token budget.

Admission reserves every page a request can ever need (prompt + max_new_tokens, capped at the
model length) before it runs, so a running request can never run out of cache mid-generation
and no page is ever reclaimed under it. A request that does not fit now waits in FIFO order;
one that could never fit was already refused by the engine.

With a prefix cache (`prefix_cache.py`, on by default), admission first matches the prompt's
full pages against the pages earlier prompts computed: the request holds the matched pages
(shared, read-only), reserves only the rest, and starts prefilling after them. `computed`
registers each full prompt page once its KV is written; `finish` releases the pages.

Each step schedules decodes first (one token per running request: latency), then prefill chunks
of waiting-to-finish prompts until `max_num_batched_tokens` is spent.

With speculative decoding (`speculative_tokens > 0`, `speculative.py`), a decode carries its
drafts after its token, as many as the budget leaves room for. Drafts never reach past the
request's length (`MTPDrafter.max_drafts`), so the reservation covers them as it is. The MTP
layer's entry at a prompt's last position reads the first generated token, so a page is
registered only once it holds none of that position.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from snapfn.handler.llm.engine.kv_pool import PageAllocator
from snapfn.handler.llm.engine.prefix_cache import PrefixCache, page_names
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
        prefix_caching: bool = True,
        speculative_tokens: int = 0,
    ) -> None:
        self.allocator = allocator
        self.prefix_cache = PrefixCache(allocator, page_size) if prefix_caching else None
        self.page_size = page_size
        self.max_running_requests = max_running_requests
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.speculative_tokens = speculative_tokens
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
        if not self.waiting or len(self.running) >= self.max_running_requests:
            return False
        req = self.waiting[0]
        hits = self._hits(req)
        return self._available(hits) >= self.pages_needed(req) - len(hits)

    def schedule(self) -> ScheduledStep | None:
        self._admit()
        step = ScheduledStep([], [], [])
        budget = self.max_num_batched_tokens
        decodes = [r for r in self.running if r.num_computed >= len(r.prompt_ids)]
        prefills = [r for r in self.running if r.num_computed < len(r.prompt_ids)]
        for req in decodes + prefills:
            n = min(req.num_tokens - req.num_computed + len(req.draft_ids), budget)
            if n <= 0:
                break
            step.requests.append(req)
            ids = req.all_ids + req.draft_ids if req.draft_ids else req.all_ids
            step.token_ids.append(ids[req.num_computed : req.num_computed + n])
            step.start_positions.append(req.num_computed)
            budget -= n
        return step if step.requests else None

    def _admit(self) -> None:
        # FIFO: a head that does not fit waits for pages; nothing overtakes it
        while self.can_admit():
            req = self.waiting.popleft()
            hits = self._hits(req)
            need = self.pages_needed(req) - len(hits)
            cache = self.prefix_cache
            if cache is None:
                fresh = self.allocator.allocate(need)
            else:
                matchable = cache.max_matched_pages(len(req.prompt_ids)) * self.page_size
                cache.acquire(hits, matchable if req.params.prompt_logprobs is None else 0)
                fresh = cache.allocate(need)
            req.pages = hits + fresh
            req.num_computed = req.cached_tokens = len(hits) * self.page_size
            req.num_registered = len(hits)
            req.state = RequestState.RUNNING
            self.running.append(req)

    def computed(self, req: Request) -> None:
        """After `req.num_computed` grew: register its prompt's pages that are now full."""
        if self.prefix_cache is None:
            return
        # with drafts: not the prompt's last position (its MTP entry reads an output token)
        prompt = len(req.prompt_ids) - (self.speculative_tokens > 0)
        full = min(req.num_computed, prompt) // self.page_size
        if full <= req.num_registered:
            return
        names = self._names(req)
        for i in range(req.num_registered, full):
            self.prefix_cache.register(names[i], req.pages[i])
        req.num_registered = full

    def _hits(self, req: Request) -> list[int]:
        """The cached pages `req`'s prompt starts with (none without a cache, or for a
        request that scores its prompt)."""
        if self.prefix_cache is None or req.params.prompt_logprobs is not None:
            return []
        names = self._names(req)[: self.prefix_cache.max_matched_pages(len(req.prompt_ids))]
        return self.prefix_cache.match(names)

    def _names(self, req: Request) -> list[bytes]:
        if req.page_names is None:  # once per request: its full prompt pages' names
            full = len(req.prompt_ids) // self.page_size
            req.page_names = page_names(req.prompt_ids, self.page_size, full)
        return req.page_names

    def _available(self, hits: list[int]) -> int:
        if self.prefix_cache is None:
            return self.allocator.num_free
        return self.prefix_cache.available_besides(hits)

    def num_available_pages(self) -> int:
        """Pages a new request could get: free, or cached and held by no request."""
        return self._available([])

    def finish(self, req: Request, reason: str) -> None:
        """Mark finished and return its pages; safe for waiting, running or finished requests."""
        if req.finished:
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.pages:
            if self.prefix_cache is not None:
                self.prefix_cache.release(req.pages)
            else:
                self.allocator.free(req.pages)
            req.pages = []
        req.state = RequestState.FINISHED
        req.finish_reason = reason
