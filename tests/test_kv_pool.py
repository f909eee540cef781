"""Page allocator and KV pool layout."""

from __future__ import annotations

import pytest
import torch

from snapfn.handler.llm.engine.kv_pool import KVBufferSpec, KVPool, PageAllocator, bytes_per_page


def test_allocate_all_or_nothing_and_free():
    alloc = PageAllocator(4)
    a = alloc.allocate(3)
    assert len(set(a)) == 3 and alloc.num_free == 1
    assert alloc.allocate(2) is None and alloc.num_free == 1  # takes nothing on failure
    alloc.free(a)
    assert alloc.num_free == 4


def test_double_free_is_caught():
    alloc = PageAllocator(2)
    pages = alloc.allocate(1)
    alloc.free(pages)
    with pytest.raises(AssertionError, match="freed twice"):
        alloc.free(pages)


def test_pool_shapes_and_bytes():
    specs = [KVBufferSpec("latent", 3, (40,)), KVBufferSpec("index_k", 2, (16,))]
    pool = KVPool(specs, num_pages=5, page_size=4, dtype=torch.bfloat16, device="cpu")
    assert pool.layer("latent", 2).shape == (6, 4, 40)  # 5 pages + the scratch page
    assert pool.layer("index_k", 1).shape == (6, 4, 16)
    assert pool.scratch_page == 5 and pool.allocator.num_pages == 5
    per_page = bytes_per_page(specs, 4, torch.bfloat16)
    assert per_page == 4 * (3 * 40 + 2 * 16) * 2
    assert pool.num_bytes == 6 * per_page
    assert pool.capacity_tokens == 20 and pool.pages_for(9) == 3
