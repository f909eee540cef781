"""Continuous batching: chunked prefill and decode under a token budget.

Pages are taken as tokens need them (`preemption`, on by default; vLLM's policy). Admission
takes the pages of the tokens a request has (its prompt, and a resumed request's outputs too)
and, while other requests run, leaves a watermark of `WATERMARK` of the pool free for their
growth. Each step grows a decode's pages to hold its next token (and the drafts it verifies);
where the pool has no page left, the latest-admitted running request not yet in the step is
**preempted**: its pages go back (its full prompt pages stay in the prefix cache, idle), it is
queued first, and at its next admission it computes its prompt and outputs again (recompute)
and goes on where it stopped. Its outputs, logprobs, sampler state and grammar state are kept,
so a greedy request's tokens are those it would have produced without the preemption. With
`preemption=False`, admission reserves every page a request can ever need (prompt +
max_new_tokens, capped at the model length): no running request ever runs out of cache, and
fewer run at once. Either way a request that does not fit now waits in FIFO order; one that
could never fit was already refused by the engine.

With a prefix cache (`prefix_cache.py`, on by default), admission first matches the prompt's
full pages against the pages earlier prompts computed: the request holds the matched pages
(shared, read-only), reserves only the rest, and starts prefilling after them. `computed`
registers each full prompt page once its KV is written; `finish` releases the pages.

Each step schedules decodes first (one token per running request: latency), then prefill chunks
of waiting-to-finish prompts until `max_num_batched_tokens` is spent.

With speculative decoding (`speculative_tokens > 0`, `speculative.py`), a decode carries its
drafts after its token, as many as the budget leaves room for. Drafts never reach past the
request's length (`MTPDrafter.max_drafts`), so `pages_needed` covers them as it is. The MTP
layer's entry at a prompt's last position reads the first generated token, so a page is
registered only once it holds none of that position. Drafts the pool has no page for are left
out of the step (fewer verified), never a reason to preempt.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from snapfn.handler.llm.engine.kv_pool import PageAllocator
from snapfn.handler.llm.engine.prefix_cache import PrefixCache, page_names
from snapfn.handler.llm.engine.request import Request, RequestState

WATERMARK = 0.01  # of the pool's pages, kept free at admission while others run (vLLM's 1%)


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
        preemption: bool = True,
    ) -> None:
        self.allocator = allocator
        self.prefix_cache = PrefixCache(allocator, page_size) if prefix_caching else None
        self.page_size = page_size
        self.max_running_requests = max_running_requests
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.speculative_tokens = speculative_tokens
        self.preemption = preemption
        self.num_preemptions = 0  # since start: requests preempted (each time counted)
        self._watermark = max(1, int(allocator.num_pages * WATERMARK)) if preemption else 0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def pages_needed(self, req: Request) -> int:
        """Pages `req` can ever need: its prompt and every output token it may produce."""
        tokens = min(len(req.prompt_ids) + req.params.max_new_tokens, self.max_model_len)
        return -(-tokens // self.page_size)

    def _admission_pages(self, req: Request) -> int:
        """Pages `req` takes when admitted: those of the tokens it has (with preemption), or
        every page it can need (without)."""
        if not self.preemption:
            return self.pages_needed(req)
        return min(-(-req.num_tokens // self.page_size), self.pages_needed(req))

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
        spare = self._watermark if self.running else 0
        return self._available(hits) - spare >= self._admission_pages(req) - len(hits)

    def schedule(self) -> ScheduledStep | None:
        self._admit()
        step = ScheduledStep([], [], [])
        budget = self.max_num_batched_tokens
        # a decode has one token to compute (a resumed request's recompute is a prefill)
        decodes = [r for r in self.running if r.num_tokens - r.num_computed <= 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed > 1]
        for req in decodes + prefills:
            if req.state is not RequestState.RUNNING:
                continue  # preempted for a request before it in this step
            n = min(req.num_tokens - req.num_computed + len(req.draft_ids), budget)
            if n <= 0:
                break
            n = self._room(req, n, step.requests)
            if n == 0:
                continue  # preempted: no page for its next token
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
            need = self._admission_pages(req) - len(hits)
            cache = self.prefix_cache
            if cache is not None:
                matchable = cache.max_matched_pages(len(req.prompt_ids)) * self.page_size
                cache.acquire(hits, matchable if req.params.prompt_logprobs is None else 0)
            req.pages = hits + self._allocate(need)
            req.num_computed = len(hits) * self.page_size
            if not req.preemptions:  # what its usage reports: the first admission's hits
                req.cached_tokens = req.num_computed
            req.num_registered = len(hits)
            req.state = RequestState.RUNNING
            self.running.append(req)

    def grow(self, req: Request, num_tokens: int) -> bool:
        """Give `req` the pages its first `num_tokens` tokens need, from free or idle cached
        pages; False, taking nothing, where there are not enough."""
        need = -(-num_tokens // self.page_size) - len(req.pages)
        if need <= 0:
            return True
        fresh = self._allocate(need)
        if fresh is None:
            return False
        req.pages += fresh
        return True

    def _room(self, req: Request, n: int, scheduled: list[Request]) -> int:
        """How many of the `n` tokens `req` brings to this step (its drafts last) its pages
        hold once grown; where its own tokens find no page, requests are preempted for them,
        `req` itself (0 returned) where no other running request is left to preempt."""
        own = min(req.num_tokens - req.num_computed, n)
        while not self.grow(req, req.num_computed + own):
            victim = next(
                (r for r in reversed(self.running) if r is not req and r not in scheduled), None
            )
            self.preempt(victim or req)
            if victim is None:
                return 0
        # its drafts follow its own token: those the pool has no page for are not verified
        return own + (self.draft_room(req, n - own) if n > own else 0)

    def draft_room(self, req: Request, drafts: int) -> int:
        """Of `drafts` tokens to draft after `req`'s next one, how many its pages hold once
        grown for them (their MTP cache entries and the verify write there); a draft never
        preempts."""
        while drafts and not self.grow(req, req.num_tokens + drafts):
            drafts -= 1
        return drafts

    def preempt(self, req: Request) -> None:
        """Take a running request's pages back and queue it first: at its next admission it
        computes its tokens again (those in the prefix cache found there) and goes on."""
        self.running.remove(req)
        self._release(req)
        req.num_computed = req.num_registered = 0
        req.draft_ids, req.draft_probs = [], None  # a new list: pending drafts skip it
        if not req.output_ids:  # its prompt's logprobs go out with its first output: again
            req.prompt_logprobs.clear()
            req.prompt_top_logprobs.clear()
        req.state = RequestState.WAITING
        req.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

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

    def _allocate(self, n: int) -> list[int] | None:
        """`n` pages: free ones, then idle cached ones; None, taking nothing, if short."""
        if self.prefix_cache is None:
            return self.allocator.allocate(n)
        return self.prefix_cache.allocate(n)

    def _release(self, req: Request) -> None:
        if req.pages:
            if self.prefix_cache is not None:
                self.prefix_cache.release(req.pages)
            else:
                self.allocator.free(req.pages)
            req.pages = []

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
        self._release(req)
        req.state = RequestState.FINISHED
        req.finish_reason = reason
