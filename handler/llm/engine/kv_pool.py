"""Paged KV pool: a free list of pages and the cache tensors that the pages index.

The page count is handed in from outside (the init phase profiles memory and computes it);
nothing here sizes itself. A model describes what it caches per token through
`KVBufferSpec`s — standard K/V for llama, the MLA latent and the DSA indexer keys for
glm_moe_dsa — and the pool allocates each as `[num_layers, num_pages, page_size, *token_shape]`.

Pages are owned by exactly one request at a time: `PageAllocator.allocate` hands out pages from
the free list or returns None (never a page someone else holds), `free` returns them and
refuses double frees, so one request can never write into another's cache.
"""

from __future__ import annotations

import functools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVBufferSpec:
    """One cache buffer: how many layers hold it and what each token stores per layer."""

    name: str
    num_layers: int
    token_shape: tuple[int, ...]

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return self.num_layers * math.prod(self.token_shape) * elem


def bytes_per_page(specs: list[KVBufferSpec], page_size: int, dtype: torch.dtype) -> int:
    """Bytes one page costs across all buffers: what the memory plan divides by."""
    return page_size * sum(s.bytes_per_token(dtype) for s in specs)


class PageAllocator:
    """Free list of page ids `0..num_pages-1`."""

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """Take `n` pages, or None (taking nothing) when fewer than `n` are free."""
        if n > len(self._free):
            return None
        pages = [self._free.popleft() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for page in pages:
            if page not in self._used:
                raise AssertionError(f"page {page} freed twice or never allocated")
            self._used.remove(page)
            self._free.append(page)


class KVPool:
    """Cache tensors for every buffer spec plus the page allocator."""

    def __init__(
        self,
        specs: list[KVBufferSpec],
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        alloc: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
    ) -> None:
        """`alloc(shape, dtype)` places the buffers (process snapshots use a releasable region);
        by default they are fresh zeroed tensors on `device`."""
        self.specs = {s.name: s for s in specs}
        self.num_pages = num_pages
        self.page_size = page_size
        self.dtype = dtype
        self.allocator = PageAllocator(num_pages)
        # NOTE: one physical page more than the allocator hands out: the scratch page that
        # padded rows of a CUDA-graph batch read and write, so padding never touches real pages.
        if alloc is None:
            alloc = functools.partial(torch.zeros, device=device)
        self.buffers: dict[str, torch.Tensor] = {
            s.name: alloc((s.num_layers, num_pages + 1, page_size, *s.token_shape), dtype=dtype)
            for s in specs
        }

    @property
    def scratch_page(self) -> int:
        return self.num_pages

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def num_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def layer(self, name: str, layer: int) -> torch.Tensor:
        """The `[num_pages, page_size, *token_shape]` cache of one layer of one buffer."""
        return self.buffers[name][layer]

    def usage(self) -> float:
        return 1.0 - self.allocator.num_free / self.num_pages
