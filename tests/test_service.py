"""LLMService: concurrent submitters share one engine loop; cancellation frees pages."""

from __future__ import annotations

import threading

import pytest

from snapfn.handler.llm.service import LLMService
from snapfn.snapshot.errors import BadRequest

from parity import greedy, our_engine, random_prompts


@pytest.fixture
def service(tiny_llama_dir):
    svc = LLMService(our_engine(tiny_llama_dir, page_size=4, num_pages=64))
    yield svc
    svc.close()


def test_concurrent_requests_match_solo_runs(service, tiny_llama_dir):
    prompts = random_prompts(256, [3, 9, 14, 5, 7, 11], seed=31)
    solo = [our_engine(tiny_llama_dir).generate([p], greedy(10))[0].token_ids for p in prompts]
    results = [None] * len(prompts)

    def call(i):
        results[i] = service.generate(prompts[i], greedy(10), timeout_s=60).token_ids

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == solo
    assert service.stats.finished == len(prompts)
    assert service.kv_usage() == 0.0


def test_streaming_yields_tokens_in_order(service, tiny_llama_dir):
    (prompt,) = random_prompts(256, [6], seed=32)
    outs = list(service.submit(prompt, greedy(8)))
    assert [t for o in outs for t in o.new_token_ids] == list(
        our_engine(tiny_llama_dir).generate([prompt], greedy(8))[0].token_ids
    )
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])


def test_cancel_frees_pages(service):
    (prompt,) = random_prompts(256, [6], seed=33)
    stream = service.submit(prompt, greedy(200))
    next(iter(stream))
    stream.cancel()
    for _ in range(200):
        if service.kv_usage() == 0.0:
            break
        threading.Event().wait(0.01)
    assert service.kv_usage() == 0.0
    assert service.stats.cancelled == 1


def test_bad_request_raises_at_submit(service):
    with pytest.raises(BadRequest):
        service.submit([], greedy(1))


def _embedded_service():
    from snapfn.handler.llm.build import build_engine
    from snapfn.handler.llm.embedded import embedded_model_dir
    from snapfn.handler.llm.structured.compiler import GrammarCache

    loaded = build_engine(embedded_model_dir())
    engine = loaded.engine
    grammars = GrammarCache(engine.tokenizer, loaded.config.vocab_size, engine.eos_token_ids)
    engine.attach_grammars(grammars)
    return LLMService(engine)


@pytest.mark.parametrize(
    "fields",
    [
        # compile, then fail at their first token on the grammar library's limits
        {"guided_regex": "(a{1000}){1000}"},
        {
            "guided_json": {
                "type": "object",
                "properties": {f"p{i}": {"type": "string"} for i in range(500)},
            }
        },
    ],
)
def test_a_request_whose_grammar_fails_fails_alone(fields):
    """A grammar past the library's limits fails its own request with a 400-kind error; the
    requests beside it run on as if it had not been there."""
    from snapfn.handler.llm.engine.request import SamplingParams
    from snapfn.handler.llm.structured.spec import spec_from_fields

    svc = _embedded_service()
    try:
        prompt = svc.engine.tokenizer.encode("The answer is")
        plain = SamplingParams(max_new_tokens=12, ignore_eos=True)
        alone = svc.generate(prompt, plain, timeout_s=120).token_ids
        guided = SamplingParams(max_new_tokens=12, guide=spec_from_fields(fields))
        beside = svc.submit(prompt, plain)
        failing = svc.submit(prompt, guided)
        with pytest.raises(BadRequest, match="structured output failed") as failed:
            failing.result(timeout_s=120)
        assert "\n" not in str(failed.value) and len(str(failed.value)) < 400  # no state dump
        assert beside.result(timeout_s=120).token_ids == alone
        assert (svc.stats.failed, svc.stats.finished) == (1, 2)
        assert svc.kv_usage() == 0.0
    finally:
        svc.close()
