"""KV pages taken as tokens need them, and preemption where none is left (engine/scheduler.py):
in a pool too small for every request at once, the latest-admitted running request gives its
pages back, is queued first and computes its tokens again at its next admission. Every output
field equals a run in a pool large enough never to preempt: tokens, logprobs, alternatives,
prompt logprobs (given once), seeded draws, with chunked prefill, the prefix cache on and off,
and MTP drafts."""

from __future__ import annotations

import pytest
import torch

from snapfn.handler.llm.build import EngineOptions, build_engine
from snapfn.handler.llm.engine.engine import SchedulerConfig
from snapfn.handler.llm.engine.request import SamplingParams
from snapfn.handler.llm.init_config import InitConfig

from glm_checkpoints import save_tiny_glm, write_with_mtp
from parity import greedy, random_prompts

P = 4  # tokens a page
LENGTHS = [5, 9, 7, 6, 11, 8]  # prompts; with 14 new tokens each a request needs 5-7 pages


def engine_for(model_dir, num_pages=256, tokens=2048, **sched):
    config = SchedulerConfig(page_size=P, max_num_batched_tokens=tokens, **sched)
    opts = EngineOptions(dtype="float32", num_pages=num_pages, scheduler=config)
    return build_engine(model_dir, opts).engine


def finished(eng, prompts, params, wave: int = 0):
    """Every request as it finished, in prompt order; with `wave`, a prompt added every
    `wave` steps while the earlier ones run."""
    kept, forget = {}, eng._forget

    def keep(req):
        kept[req.request_id] = req
        forget(req)

    eng._forget = keep
    pending, ids, steps = list(zip(prompts, params, strict=True)), [], 0
    while pending or eng.has_work():
        if pending and (not wave or steps % wave == 0):
            for _ in range(1 if wave else len(pending)):
                ids.append(eng.add_request(*pending.pop(0)))
        eng.step()
        steps += 1
    return [kept[i] for i in ids]


def assert_same_outputs(got, want):
    for a, b in zip(got, want, strict=True):
        assert (a.output_ids, a.finish_reason) == (b.output_ids, b.finish_reason)
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=0)
        assert [[t for t, _ in top] for top in a.top_logprobs] == [
            [t for t, _ in top] for top in b.top_logprobs
        ]
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs)
        prompt_a = [x for x in a.prompt_logprobs if x is not None]
        prompt_b = [x for x in b.prompt_logprobs if x is not None]
        torch.testing.assert_close(prompt_a, prompt_b, atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def tiny_glm(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm-preempt")
    plain = save_tiny_glm(root / "plain", seed=5)
    write_with_mtp(plain, root / "mtp")
    return {"glm": plain, "mtp": root / "mtp"}


@pytest.mark.parametrize("model", ["llama", "glm"])
@pytest.mark.parametrize("tokens", [2048, 6])  # one prefill chunk each, or chunks of 6
@pytest.mark.parametrize("cached", [True, False])
def test_a_tight_pool_preempts_and_gives_the_large_pools_outputs(
    model, tokens, cached, tiny_llama_dir, tiny_glm
):
    model_dir = tiny_llama_dir if model == "llama" else tiny_glm["glm"]
    prompts = random_prompts(256, LENGTHS, seed=3)
    params = [greedy(14)] * len(prompts)
    want = finished(engine_for(model_dir, tokens=tokens, prefix_caching=cached), prompts, params)
    tight = engine_for(model_dir, num_pages=12, tokens=tokens, prefix_caching=cached)
    got = finished(tight, prompts, params)
    assert_same_outputs(got, want)
    assert tight.scheduler.num_preemptions > 0
    assert sum(r.preemptions for r in got) == tight.scheduler.num_preemptions
    assert tight.scheduler.num_available_pages() == 12  # every page back: free or idle cached
    assert tight.kv_usage() == 0.0


def test_more_requests_run_at_once_than_reserving_admits(tiny_llama_dir):
    """12 pages, prompts of 5 tokens and 14 new tokens each: reserving admits two (5 pages
    each), taking pages as needed admits five (2 pages each, a page kept free)."""
    prompts = random_prompts(256, [5] * 6, seed=2)
    counts = {}
    for preemption in (False, True):
        eng = engine_for(tiny_llama_dir, num_pages=12, preemption=preemption)
        for p in prompts:
            eng.add_request(p, greedy(14))
        eng.step()
        counts[preemption] = len(eng.scheduler.running)
        while eng.has_work():
            eng.step()
        assert (eng.scheduler.num_preemptions > 0) == preemption
    assert counts == {False: 2, True: 5}


def test_the_latest_admitted_request_is_preempted_and_queued_first(tiny_llama_dir):
    prompts = random_prompts(256, [8, 8, 8], seed=4)
    eng = engine_for(tiny_llama_dir, num_pages=7)  # 2 pages a prompt, 6 taken, 1 kept free
    first, second, third = (eng.add_request(p, greedy(9)) for p in prompts)
    reqs = [eng._requests[i] for i in (first, second, third)]
    eng.step()  # three prefills: each prompt's 8 tokens fill its 2 pages
    assert [r.num_computed for r in reqs] == [8, 8, 8] and eng.kv.allocator.num_free == 1
    eng.step()  # each decode needs a third page: the first takes the last free one
    assert reqs[2].preemptions == 1 and list(eng.scheduler.waiting) == [reqs[2]]
    assert reqs[2].num_computed == 0 and reqs[2].pages == [] and len(reqs[2].output_ids) == 1
    assert reqs[0].preemptions == reqs[1].preemptions == 0
    while eng.has_work():
        eng.step()
    solo = engine_for(tiny_llama_dir).generate(prompts, greedy(9))
    assert [eng._requests.get(i) for i in (first, second, third)] == [None] * 3
    assert [len(r.output_ids) for r in reqs] == [9, 9, 9]
    assert [tuple(r.output_ids) for r in reqs] == [s.token_ids for s in solo]


def test_a_resumed_request_finds_its_prompt_pages_in_the_prefix_cache(tiny_llama_dir):
    """Prompts that share nothing: every hit is a preempted request's own prompt pages, kept
    idle in the cache while it waited."""
    prompts = random_prompts(256, [13, 13, 13], seed=8)
    eng = engine_for(tiny_llama_dir, num_pages=12)
    got = finished(eng, prompts, [greedy(14)] * 3)
    assert eng.scheduler.num_preemptions > 0
    stats = eng.prefix_cache_stats()
    assert stats["hit_tokens"] > 0 and stats["hit_requests"] > 0
    want = engine_for(tiny_llama_dir, prefix_caching=False).generate(prompts, greedy(14))
    assert [tuple(r.output_ids) for r in got] == [w.token_ids for w in want]
    assert [r.cached_tokens for r in got] == [0, 0, 0]  # usage: the first admission's hits


def test_mixed_requests_keep_every_output_field_across_preemption(tiny_llama_dir):
    """Prompt logprobs (reported once, with the first output), alternatives, biases,
    penalties, a stop token and seeded draws, added in waves into a tight pool."""
    prompts = random_prompts(256, [6, 9, 4, 10, 7, 5, 8], seed=6)
    params = [
        SamplingParams(max_new_tokens=12, prompt_logprobs=2, ignore_eos=True),
        SamplingParams(max_new_tokens=12, top_logprobs=3, ignore_eos=True),
        SamplingParams(max_new_tokens=12, logit_bias=((5, 3.0),), ignore_eos=True),
        SamplingParams(max_new_tokens=14, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
        SamplingParams(max_new_tokens=12, repetition_penalty=1.3, presence_penalty=0.5),
        SamplingParams(max_new_tokens=12, temperature=1.0, seed=11, prompt_logprobs=1),
        greedy(13),
    ]
    want = finished(engine_for(tiny_llama_dir), prompts, params, wave=2)
    for tokens in (2048, 5):
        tight = engine_for(tiny_llama_dir, num_pages=11, tokens=tokens)
        got = finished(tight, prompts, params, wave=2)
        assert tight.scheduler.num_preemptions > 0
        assert_same_outputs(got, want)


def test_a_preempted_request_can_be_cancelled(tiny_llama_dir):
    prompts = random_prompts(256, [8, 8, 8], seed=4)
    eng = engine_for(tiny_llama_dir, num_pages=7)
    ids = [eng.add_request(p, greedy(9)) for p in prompts]
    eng.step()
    eng.step()
    assert eng._requests[ids[2]].preemptions == 1
    assert eng.cancel(ids[2])
    while eng.has_work():
        eng.step()
    assert eng.scheduler.num_available_pages() == 7 and not eng.scheduler.waiting


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_drafts_in_a_tight_pool_give_the_plain_tokens(tiny_glm, k):
    """Drafts the pool has no page for are left out of the step, and preempted requests drop
    theirs; greedy tokens stay the plain engine's."""
    prompts = random_prompts(256, LENGTHS, seed=9)
    params = [greedy(14)] * len(prompts)
    want = finished(engine_for(tiny_glm["mtp"]), prompts, params)
    for tokens in (2048, 7):
        tight = engine_for(tiny_glm["mtp"], num_pages=13, tokens=tokens, speculative_tokens=k)
        got = finished(tight, prompts, params, wave=2)
        assert tight.scheduler.num_preemptions > 0
        assert_same_outputs(got, want)
        assert tight.spec_stats()["draft_tokens"] > 0
        assert tight.scheduler.num_available_pages() == 13


def test_init_config_reads_the_switch():
    assert InitConfig().engine_options(num_pages=8).scheduler.preemption is True
    off = InitConfig.from_env({"SNAPFN_PREEMPTION": "0"})
    assert off.engine_options(num_pages=8).scheduler.preemption is False


def test_metrics_count_preemptions(tiny_llama_dir):
    from snapfn.handler.http.metrics import engine_metrics
    from snapfn.handler.llm.service import LLMService

    eng = engine_for(tiny_llama_dir, num_pages=7)
    eng.generate(random_prompts(256, [8, 8, 8], seed=4), greedy(9))  # as in the case above
    service = LLMService(eng)
    try:
        values = {f.name: f.samples[0].value for f in engine_metrics(service)}
    finally:
        service.close()
    assert values["snapfn_engine_preemptions"] == service.preemptions() > 0
