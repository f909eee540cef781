"""Engine behaviour: page exhaustion, refusal, cancellation, stop strings, sampling options."""

from __future__ import annotations

import pytest

from snapfn.handler.llm.engine.request import SamplingParams
from snapfn.snapshot.errors import BadRequest

from parity import greedy, our_engine, random_prompts


def solo(model_dir, prompt, n):
    return our_engine(model_dir).generate([prompt], greedy(n))[0].token_ids


def test_exhausted_pool_queues_and_never_corrupts(tiny_llama_dir):
    # reserving admission (no preemption: tests/test_preemption.py has the default's cases):
    # 6 pages of 4 tokens; each request needs ceil((5 + 6) / 4) = 3 pages: two fit at once
    engine = our_engine(tiny_llama_dir, page_size=4, num_pages=6, preemption=False)
    prompts = random_prompts(256, [5, 5, 5], seed=7)
    ids = [engine.add_request(p, greedy(6)) for p in prompts]
    results = {}
    outs = engine.step()
    assert len(engine.scheduler.running) == 2 and len(engine.scheduler.waiting) == 1
    assert engine.kv.allocator.num_free == 0
    while outs:
        for out in outs:
            results.setdefault(out.request_id, []).extend(out.new_token_ids)
        outs = engine.step()
    for rid, prompt in zip(ids, prompts, strict=True):
        assert tuple(results[rid]) == solo(tiny_llama_dir, prompt, 6)
    assert engine.scheduler.num_available_pages() == 6  # free, or cached and held by none


def test_request_that_can_never_fit_is_refused(tiny_llama_dir):
    engine = our_engine(tiny_llama_dir, page_size=4, num_pages=6)
    with pytest.raises(BadRequest, match="more KV cache than the whole pool"):
        engine.add_request([1] * 10, greedy(20))
    assert not engine.has_work()


def test_prompt_longer_than_max_req_input_len_is_refused(tiny_llama_dir):
    engine = our_engine(tiny_llama_dir, page_size=4, num_pages=6)
    assert engine.max_req_input_len == 23
    with pytest.raises(BadRequest, match="max_req_input_len"):
        engine.add_request([1] * 24, greedy(1))


@pytest.mark.parametrize(
    "params, message",
    [
        (SamplingParams(temperature=-1), "temperature"),
        (SamplingParams(top_p=0), "top_p"),
        (SamplingParams(max_new_tokens=0), "max_new_tokens"),
        (SamplingParams(top_k=-2), "top_k"),
    ],
)
def test_bad_sampling_values_are_refused(tiny_llama_dir, params, message):
    with pytest.raises(BadRequest, match=message):
        our_engine(tiny_llama_dir).add_request([1, 2], params)


def test_cancel_frees_pages_and_leaves_others_intact(tiny_llama_dir):
    engine = our_engine(tiny_llama_dir, page_size=4, num_pages=32)
    a, b = random_prompts(256, [6, 9], seed=8)
    rid_a = engine.add_request(a, greedy(12))
    rid_b = engine.add_request(b, greedy(12))
    tokens = []
    for _ in range(3):
        tokens += [t for out in engine.step() if out.request_id == rid_b for t in out.new_token_ids]
    free_before = engine.scheduler.num_available_pages()
    assert engine.cancel(rid_a)
    assert not engine.cancel(rid_a)
    assert engine.scheduler.num_available_pages() > free_before
    while engine.has_work():
        for out in engine.step():
            assert out.request_id == rid_b
            tokens.extend(out.new_token_ids)
    assert engine.scheduler.num_available_pages() == 32
    assert tuple(tokens) == solo(tiny_llama_dir, b, 12)


def test_stop_string_truncates_text(llama_with_tokenizer):
    engine = our_engine(llama_with_tokenizer)
    (prompt,) = random_prompts(256, [8], seed=9)
    full = engine.generate([prompt], greedy(24))[0]
    stop = full.text[6:9]
    assert len(stop) == 3
    cut = full.text.index(stop)
    params = SamplingParams(max_new_tokens=24, stop=(stop,), ignore_eos=True)
    stopped = engine.generate([prompt], params)[0]
    assert stopped.text == full.text[:cut]
    assert stopped.finish_reason == "stop"
    assert len(stopped.token_ids) < len(full.token_ids)


def _streamed(engine, prompt, params) -> tuple[list[str], str | None]:
    """Every output's text delta of one request, and its finish reason."""
    rid, deltas, reason = engine.add_request(prompt, params), [], None
    while engine.has_work():
        for out in engine.step():
            if out.request_id == rid:
                deltas.append(out.text_delta)
                reason = out.finish_reason or reason
    return deltas, reason


def test_streamed_text_never_gives_out_the_start_of_its_stop_string(llama_with_tokenizer):
    """Stop strings that span tokens: the deltas, joined, are the text before the stop (a
    stop's first characters are held back until the text shows whether it completes), and a
    held-back tail that no stop claims comes out when the request ends."""
    engine = our_engine(llama_with_tokenizer)
    (prompt,) = random_prompts(256, [8], seed=9)
    full = engine.generate([prompt], greedy(24))[0].text
    assert len(full) > 20
    for start, length in [(1, 2), (4, 3), (6, 3), (9, 4), (12, 2), (15, 5)]:
        stop = full[start : start + length]
        params = SamplingParams(max_new_tokens=24, stop=("\x00never", stop), ignore_eos=True)
        deltas, reason = _streamed(engine, prompt, params)
        assert "".join(deltas) == full[: full.index(stop)], stop
        assert reason == "stop"
    # a stop whose start ends the text but never completes: the tail comes out at the end
    params = SamplingParams(max_new_tokens=24, stop=(full[-2:] + "\x00",), ignore_eos=True)
    deltas, reason = _streamed(engine, prompt, params)
    assert "".join(deltas) == full and reason == "length"
    assert not deltas[-2].endswith(full[-2:])  # held back until the end


def test_seeded_sampling_is_reproducible(tiny_llama_dir):
    engine = our_engine(tiny_llama_dir)
    (prompt,) = random_prompts(256, [5], seed=10)

    def run(seed):
        return engine.generate(
            [prompt], SamplingParams(max_new_tokens=16, temperature=1.0, seed=seed)
        )[0].token_ids

    assert run(123) == run(123)
    assert run(123) != run(124)


def test_top_k_1_and_tiny_top_p_equal_greedy(tiny_llama_dir):
    engine = our_engine(tiny_llama_dir)
    (prompt,) = random_prompts(256, [5], seed=11)
    ref = engine.generate([prompt], greedy(10))[0].token_ids
    top_k = SamplingParams(max_new_tokens=10, temperature=0.8, top_k=1, seed=1, ignore_eos=True)
    top_p = SamplingParams(max_new_tokens=10, temperature=0.8, top_p=1e-6, seed=1, ignore_eos=True)
    assert engine.generate([prompt], top_k)[0].token_ids == ref
    assert engine.generate([prompt], top_p)[0].token_ids == ref


def test_eos_stops_generation(tiny_llama_dir):
    engine = our_engine(tiny_llama_dir)
    (prompt,) = random_prompts(256, [5], seed=12)
    ref = engine.generate([prompt], greedy(10))[0].token_ids
    params = SamplingParams(max_new_tokens=10, stop_token_ids=(ref[3],))
    out = engine.generate([prompt], params)[0]
    assert out.token_ids == ref[: ref.index(ref[3]) + 1]
    assert out.finish_reason == "stop"


def test_tiny_temperature_samples_greedily(tiny_llama_dir):
    engine = our_engine(tiny_llama_dir)
    (prompt,) = random_prompts(256, [5], seed=13)
    ref = engine.generate([prompt], greedy(6))[0].token_ids
    tiny = SamplingParams(max_new_tokens=6, temperature=1e-300, seed=3, ignore_eos=True)
    assert engine.generate([prompt], tiny)[0].token_ids == ref
