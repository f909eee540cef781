"""Prefix caching: full KV pages of prompts shared across requests by their content.

A prompt's page `i` (its tokens `[i*P, (i+1)*P)`, `P` the page size) is named by a chain
hash: blake2b of page `i-1`'s name and page `i`'s token ids, so a name stands for the whole
prefix up to the end of its page. Once a request has computed a full page of its prompt, the
page is **registered** under its name. A later request whose prompt starts with the same pages
is admitted holding those pages (`match` → `acquire`) and prefills only from the first page it
does not find: its `num_computed` starts past them, its KV writes go to its own fresh pages, so
a shared page is written once and then only read.

Pages are reference-counted: a registered page is held by the requests whose page lists hold
it; when the last one finishes it stays registered but **idle**, in least-recently-released
order, and `allocate` takes idle pages (dropping their names) only when the free list is short.
An unregistered page goes back to the free list as before. At most `(len(prompt) - 1) // P`
pages of a prompt are matched: its last token is always computed, since its logits give the
first output token. A request that asks for its prompt's logprobs matches nothing (every prompt
position must be scored), and registers its pages like any other. Pages of generated tokens
are not registered.

Determinism: the index evolves only with admissions, computed tokens, preemptions and
finishes, in order, so ranks that schedule in lock step (tensor parallel) hold the same index.
A preempted request releases its pages as a finished one does: its registered prompt pages
stay named, idle, and its next admission matches them like any other prompt's.

After a process restore the KV pool's memory is not the one the index describes: `clear`
forgets every name (the pool's pages are then free or owned, as without the cache).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from snapfn.handler.llm.engine.kv_pool import PageAllocator


@dataclass
class PrefixCacheStats:
    """Counters since start (or `clear`): prompt tokens that could be matched, those found."""

    queried_tokens: int = 0
    hit_tokens: int = 0
    hit_requests: int = 0

    def to_json(self, cached_pages: int, idle_pages: int) -> dict[str, int]:
        return {
            "queried_tokens": self.queried_tokens,
            "hit_tokens": self.hit_tokens,
            "hit_requests": self.hit_requests,
            "cached_pages": cached_pages,
            "idle_pages": idle_pages,
        }


def page_names(token_ids: list[int], page_size: int, num_pages: int) -> list[bytes]:
    """The chain names of the first `num_pages` full pages of `token_ids`."""
    names, prev = [], b""
    for i in range(num_pages):
        page = array("q", token_ids[i * page_size : (i + 1) * page_size]).tobytes()
        prev = hashlib.blake2b(prev + page, digest_size=16).digest()
        names.append(prev)
    return names


class PrefixCache:
    """The name → page index over a `PageAllocator`, with reference counts and idle pages."""

    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.stats = PrefixCacheStats()
        self._page_of: dict[bytes, int] = {}
        self._name_of: dict[int, bytes] = {}
        self._refs: dict[int, int] = {}  # registered (or shared) page → requests holding it
        self._idle: OrderedDict[int, None] = OrderedDict()  # registered, held by none: LRU first

    @property
    def num_cached(self) -> int:
        return len(self._name_of)

    @property
    def num_available(self) -> int:
        """Pages `allocate` can hand out: free, or idle (their names dropped)."""
        return self.allocator.num_free + len(self._idle)

    def max_matched_pages(self, prompt_len: int) -> int:
        return max(prompt_len - 1, 0) // self.page_size

    def match(self, names: list[bytes]) -> list[int]:
        """The registered pages of the longest prefix of `names` (page names, in order)."""
        pages = []
        for name in names:
            page = self._page_of.get(name)
            if page is None:
                break
            pages.append(page)
        return pages

    def available_besides(self, hits: list[int]) -> int:
        """Pages left to allocate once `hits` (matched pages) are acquired."""
        return self.num_available - sum(1 for p in hits if p in self._idle)

    def acquire(self, hits: list[int], prompt_tokens: int) -> None:
        """Hold `hits` for a request of `prompt_tokens` matchable tokens being admitted."""
        for page in hits:
            self._refs[page] += 1
            self._idle.pop(page, None)
        self.stats.queried_tokens += prompt_tokens
        self.stats.hit_tokens += len(hits) * self.page_size
        self.stats.hit_requests += bool(hits)

    def allocate(self, n: int) -> list[int] | None:
        """`n` pages, from the free list first, then idle pages (least recently released
        first, unregistered); None, taking nothing, when fewer are available."""
        if n > self.num_available:
            return None
        while self.allocator.num_free < n:
            page, _ = self._idle.popitem(last=False)
            self._forget(page)
            self.allocator.free([page])
        return self.allocator.allocate(n)

    def register(self, name: bytes, page: int) -> None:
        """`page` (held by one request, its content now computed) is the page named `name`;
        a name already registered keeps its page (this one stays the request's own)."""
        if name in self._page_of or page in self._refs:
            return
        self._page_of[name] = page
        self._name_of[page] = name
        self._refs[page] = 1

    def release(self, pages: list[int]) -> None:
        """A finished request's pages: a shared or registered one loses a holder (at none,
        idle if it still has its name, else free), the others go back to the free list."""
        free = []
        for page in pages:
            if page not in self._refs:
                free.append(page)
                continue
            self._refs[page] -= 1
            if self._refs[page] > 0:
                continue
            if page in self._name_of:
                self._idle[page] = None
            else:  # named once, forgotten by `clear` while held
                del self._refs[page]
                free.append(page)
        self.allocator.free(free)

    def clear(self) -> None:
        """Forget every name: idle pages are freed; held ones stay counted until their last
        holder releases them, then are freed."""
        idle = list(self._idle)
        for page in idle:
            del self._refs[page]
        self._page_of.clear()
        self._name_of.clear()
        self._idle.clear()
        self.allocator.free(idle)
        self.stats = PrefixCacheStats()

    def to_json(self) -> dict[str, int]:
        return self.stats.to_json(self.num_cached, len(self._idle))

    def _forget(self, page: int) -> None:
        name = self._name_of.pop(page)
        del self._page_of[name]
        del self._refs[page]
