"""Prefix caching (handler/llm/engine/prefix_cache.py, the scheduler's matching and
registering): the index's bookkeeping on its own, then engines with and without the cache on
shared-prefix workloads — the same tokens, with the shared pages' prefill skipped."""

from __future__ import annotations

import pytest
import torch

from snapfn.handler.llm.build import EngineOptions, build_engine
from snapfn.handler.llm.engine.engine import SchedulerConfig
from snapfn.handler.llm.engine.kv_pool import PageAllocator
from snapfn.handler.llm.engine.prefix_cache import PrefixCache, page_names
from snapfn.handler.llm.engine.request import SamplingParams

from glm_checkpoints import save_tiny_glm
from parity import greedy, random_prompts

P = 4  # tokens a page


def engine_for(model_dir, cached: bool, num_pages=256, max_tokens=2048, page_size=P):
    sched = SchedulerConfig(
        page_size=page_size, max_num_batched_tokens=max_tokens, prefix_caching=cached
    )
    opts = EngineOptions(dtype="float32", num_pages=num_pages, scheduler=sched)
    return build_engine(model_dir, opts).engine


def shared_prefix_prompts(vocab: int, seed: int) -> list[list[int]]:
    """A 13-token system prompt with 5 different tails, one prompt equal to it, and one that
    shares only its first page."""
    system, *tails = random_prompts(vocab, [13, 3, 6, 1, 9, 4, 5], seed=seed)
    prompts = [system + t for t in tails[:5]] + [list(system)]
    return prompts + [system[:P] + tails[5]]


def run_in_waves(engine, prompts, params, wave: int = 2):
    """Prompts added `wave` at a time, each wave added while the previous ones still run."""
    ids, results = [], {}
    pending = list(prompts)
    while pending or engine.has_work():
        if pending:
            ids += [engine.add_request(p, params) for p in pending[:wave]]
            pending = pending[wave:]
        for out in engine.step():
            got = results.setdefault(out.request_id, ([], []))
            got[0].extend(out.new_token_ids)
            got[1].extend(out.new_logprobs)
    return [results[i] for i in ids]


# ---- the index ---------------------------------------------------------------------------


def test_a_name_stands_for_the_whole_prefix():
    a = page_names([1, 2, 3, 4, 5, 6, 7, 8], P, 2)
    b = page_names([9, 2, 3, 4, 5, 6, 7, 8], P, 2)
    assert a[0] != b[0] and a[1] != b[1]  # same second page, other first page
    assert page_names([1, 2, 3, 4, 5, 6, 7, 8, 9], P, 2) == a


def test_pages_are_shared_counted_idle_then_evicted_oldest_first():
    allocator = PageAllocator(6)
    cache = PrefixCache(allocator, P)
    names = page_names(list(range(12)), P, 3)
    mine = cache.allocate(3)
    for name, page in zip(names, mine, strict=True):
        cache.register(name, page)
    other_start = page_names([99, *range(1, 12)], P, 3)
    assert cache.match(names) == mine and cache.match(other_start) == []
    cache.acquire(mine[:2], 8)  # a second request holds the first two pages
    cache.release(mine)  # the first finishes: its third page is idle, the others still held
    assert cache.to_json()["idle_pages"] == 1 and cache.num_available == 4
    cache.release(mine[:2])  # the second finishes
    assert cache.to_json() == {
        "queried_tokens": 8,
        "hit_tokens": 8,
        "hit_requests": 1,
        "cached_pages": 3,
        "idle_pages": 3,
    }
    got = cache.allocate(5)  # 3 free, then the idle pages least recently released first
    assert got is not None and mine[2] in got and mine[0] in got and mine[1] not in got
    assert cache.match(names) == []  # its first page is gone, so is the whole prefix
    assert cache.allocate(2) is None  # one idle page left: nothing taken
    assert cache.num_available == 1


def test_clear_frees_idle_pages_and_held_ones_when_released():
    allocator = PageAllocator(4)
    cache = PrefixCache(allocator, P)
    names = page_names(list(range(8)), P, 2)
    pages = cache.allocate(2)
    cache.register(names[0], pages[0])
    cache.register(names[1], pages[1])
    cache.acquire(pages[:1], 4)  # page 0 held twice, page 1 once
    cache.release([pages[1]])  # idle
    cache.clear()
    assert cache.match(names) == [] and allocator.num_free == 3
    cache.release(pages[:1])
    cache.release(pages[:1])  # its two holders: freed once, no double free
    assert allocator.num_free == 4 and cache.num_available == 4


# ---- engines -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_glm(tmp_path_factory):
    return save_tiny_glm(tmp_path_factory.mktemp("glm-prefix"), seed=2)


@pytest.mark.parametrize("model", ["llama", "glm"])
@pytest.mark.parametrize("max_tokens", [2048, 6])  # one chunk each, or prefills in chunks of 6
def test_cached_and_uncached_engines_give_the_same_tokens(
    model, max_tokens, tiny_llama_dir, tiny_glm
):
    model_dir = tiny_llama_dir if model == "llama" else tiny_glm
    plain = engine_for(model_dir, cached=False, max_tokens=max_tokens)
    cached = engine_for(model_dir, cached=True, max_tokens=max_tokens)
    vocab = plain.model.config.vocab_size
    prompts = shared_prefix_prompts(vocab, seed=11)
    want = run_in_waves(plain, prompts, greedy(5))
    got = run_in_waves(cached, prompts, greedy(5))
    assert [g[0] for g in got] == [w[0] for w in want]
    for (_, lp_got), (_, lp_want) in zip(got, want, strict=True):
        assert torch.allclose(torch.tensor(lp_got), torch.tensor(lp_want), atol=1e-4)
    stats = cached.prefix_cache_stats()
    assert stats["hit_tokens"] >= 2 * 3 * P  # later waves found the system prompt's 3 pages
    assert plain.prefix_cache_stats() is None
    assert cached.scheduler.num_available_pages() == cached.kv.num_pages


def test_a_hit_skips_the_shared_pages_prefill(tiny_llama_dir):
    engine = engine_for(tiny_llama_dir, cached=True)
    system, tail_a, tail_b = random_prompts(256, [12, 3, 3], seed=4)
    engine.generate([system + tail_a], greedy(2))
    rid = engine.add_request(system + tail_b, greedy(2))
    req = engine._requests[rid]
    engine.step()
    # 15 tokens: 3 full pages matchable ((15 - 1) // 4), all of them the first request's
    assert req.cached_tokens == 12 and req.pages[:3] == engine.scheduler._hits(req)[:3]
    assert engine.prefix_cache_stats()["hit_tokens"] == 12


def test_sampled_requests_with_seeds_match_too(tiny_llama_dir):
    params = SamplingParams(max_new_tokens=6, temperature=0.9, top_p=0.9, seed=3, ignore_eos=True)
    prompts = shared_prefix_prompts(256, seed=5)
    want = run_in_waves(engine_for(tiny_llama_dir, cached=False), prompts, params)
    got = run_in_waves(engine_for(tiny_llama_dir, cached=True), prompts, params)
    assert [g[0] for g in got] == [w[0] for w in want]


def test_a_small_pool_evicts_and_stays_correct(tiny_llama_dir):
    """8 pages: each request reserves 5 of them, so cached pages are evicted all the time."""
    prompts = shared_prefix_prompts(256, seed=6)
    want = run_in_waves(engine_for(tiny_llama_dir, cached=False, num_pages=8), prompts, greedy(3))
    cached = engine_for(tiny_llama_dir, cached=True, num_pages=8)
    got = run_in_waves(cached, prompts, greedy(3), wave=1)
    assert [g[0] for g in got] == [w[0] for w in want]
    assert cached.scheduler.num_available_pages() == 8


def test_a_request_scoring_its_prompt_matches_nothing(tiny_llama_dir):
    engine = engine_for(tiny_llama_dir, cached=True)
    system, tail = random_prompts(256, [12, 3], seed=8)
    engine.generate([system + tail], greedy(1))
    params = SamplingParams(max_new_tokens=1, prompt_logprobs=1, ignore_eos=True)
    want = engine_for(tiny_llama_dir, cached=False).generate([system + tail], params)
    (got,) = engine.generate([system + tail], params)
    assert got.token_ids == want[0].token_ids
    assert engine.prefix_cache_stats()["hit_tokens"] == 0


def test_clearing_the_cache_keeps_the_engine_correct(tiny_llama_dir):
    engine = engine_for(tiny_llama_dir, cached=True)
    prompts = shared_prefix_prompts(256, seed=9)
    first = [r.token_ids for r in engine.generate(prompts[:2], greedy(4))]
    engine.clear_prefix_cache()
    assert engine.prefix_cache_stats()["cached_pages"] == 0
    again = [r.token_ids for r in engine.generate(prompts[:2], greedy(4))]
    assert again == first
