"""The overlapped decode loop (`engine/in_flight.py`, `Engine.step`): greedy decode steps landed
one step late, the next launched with the GPU's own tokens, give what the plain loop gives.

On CPU, `EagerGraphs` stands in for `DecodeGraphs` (same `bucket_for` / `replay` contract,
eager forwards), so the loop's bookkeeping runs here: positions, token hand-over, requests that
end by length, stop on a token or a string, are cancelled, or arrive mid-run. Each case runs
the same requests through the engine with overlap on and off and compares tokens, logprobs,
text and finish reasons, and checks that overlapped steps ran and every page came back. The
GPU run of the same loop (pinned picks, events, real graphs): the whole-model greedy checks of
tests/flashinfer_checks.py and tests/triton_checks.py, which capture graphs.
"""

from __future__ import annotations

import dataclasses

from snapfn.handler.llm.engine.graphs import GraphStats
from snapfn.handler.llm.engine.request import SamplingParams

from parity import greedy, our_engine, random_prompts


class EagerGraphs:
    """`DecodeGraphs`' interface over eager forwards: decode batches of up to `max_batch`."""

    def __init__(self, engine, max_batch: int = 8):
        self.engine = engine
        self.buckets = [max_batch]
        self.stats = GraphStats(buckets=self.buckets)

    def captured(self, n):
        return True  # short prefills replay as rows too (engine.py, _replay_rows)

    def bucket_for(self, batch):
        return self.buckets[0] if batch.is_decode and batch.num_seqs <= self.buckets[0] else None

    def replay(self, batch, n, input_ids=None):
        if input_ids is not None:
            assert batch.input_ids.tolist() == [0] * batch.num_seqs  # a placeholder, replaced
            batch = dataclasses.replace(batch, input_ids=input_ids.clone())
        self.stats.replays += 1
        return self.engine.model(batch.to(self.engine.model.device), self.engine.kv)


def _engine(model_dir, overlap: bool, **kw):
    engine = our_engine(model_dir, **kw)
    engine.graphs = EagerGraphs(engine)
    engine.overlap_decode = overlap
    return engine


def _run_both(model_dir, prompts, params, **kw):
    out = {}
    for overlap in (False, True):
        engine = _engine(model_dir, overlap, **kw)
        results = engine.generate(prompts, params)
        assert not engine.has_work()
        assert engine.scheduler.num_available_pages() == engine.kv.num_pages, "pages leaked"
        out[overlap] = (results, engine.overlapped_steps)
    assert out[False][1] == 0
    return out[False][0], out[True][0], out[True][1]


def _same(plain, overlapped):
    for a, b in zip(plain, overlapped, strict=True):
        assert b.token_ids == a.token_ids
        assert b.logprobs == a.logprobs
        assert (b.text, b.finish_reason) == (a.text, a.finish_reason)


def test_requests_ending_by_length_at_different_steps(tiny_llama_dir):
    prompts = random_prompts(256, [5, 9, 3], seed=3)
    params = [greedy(3), greedy(7), greedy(12)]
    plain, overlapped, steps = _run_both(tiny_llama_dir, prompts, params)
    _same(plain, overlapped)
    assert [len(r.token_ids) for r in overlapped] == [3, 7, 12]
    assert steps >= 8  # request 3 alone from its 8th token on: every step overlapped


def test_a_stop_token_drops_the_speculated_row(tiny_llama_dir):
    (prompt,) = random_prompts(256, [6], seed=12)
    ref = _engine(tiny_llama_dir, False).generate([prompt], greedy(12))[0].token_ids
    stop = ref[4]
    params = SamplingParams(max_new_tokens=12, stop_token_ids=(stop,), ignore_eos=True)
    plain, overlapped, steps = _run_both(tiny_llama_dir, [prompt, prompt[:3]], [params, greedy(12)])
    _same(plain, overlapped)
    assert overlapped[0].token_ids == ref[: ref.index(stop) + 1]
    assert overlapped[0].finish_reason == "stop" and steps > 0


def test_a_stop_string(llama_with_tokenizer):
    (prompt,) = random_prompts(256, [8], seed=9)
    full = _engine(llama_with_tokenizer, False).generate([prompt], greedy(24))[0]
    params = SamplingParams(max_new_tokens=24, stop=(full.text[6:9],), ignore_eos=True)
    plain, overlapped, steps = _run_both(llama_with_tokenizer, [prompt], params)
    _same(plain, overlapped)
    assert overlapped[0].finish_reason == "stop" and steps > 0


def test_a_request_arriving_mid_run_and_a_cancelled_one(tiny_llama_dir):
    a, b, late = random_prompts(256, [5, 7, 4], seed=5)
    solo = {
        name: _engine(tiny_llama_dir, False).generate([p], greedy(10))[0].token_ids
        for name, p in (("a", a), ("late", late))
    }
    engine = _engine(tiny_llama_dir, True)
    ids = {"a": engine.add_request(a, greedy(10)), "b": engine.add_request(b, greedy(10))}
    tokens: dict[str, list[int]] = {rid: [] for rid in ids.values()}
    for i in range(40):
        if i == 4:
            assert engine.overlapped_steps > 0 and engine._in_flight is not None
            assert engine.cancel(ids["b"])
            ids["late"] = engine.add_request(late, greedy(10))
            tokens[ids["late"]] = []
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
        if not engine.has_work():
            break
    assert tuple(tokens[ids["a"]]) == solo["a"]
    assert tuple(tokens[ids["late"]]) == solo["late"]
    assert len(tokens[ids["b"]]) < 10  # nothing landed for b after its cancel
    assert engine.scheduler.num_available_pages() == engine.kv.num_pages


def test_sampled_requests_and_prefills_run_the_plain_way(tiny_llama_dir):
    engine = _engine(tiny_llama_dir, True)
    (prompt,) = random_prompts(256, [5], seed=1)
    params = SamplingParams(max_new_tokens=6, temperature=0.8, seed=3)
    engine.generate([prompt], params)
    assert engine.overlapped_steps == 0
    engine.graphs = None  # no graphs (CPU, or graphs off): the plain loop
    engine.generate([prompt], greedy(6))
    assert engine.overlapped_steps == 0


def test_penalised_and_top_logprob_requests_run_the_plain_way(tiny_llama_dir):
    """Greedy requests that shape their logits or ask for alternatives take the sampler's
    reference path, never the backend's picks or a speculated step: overlap on or off, the
    same tokens, and nothing overlapped while one of them runs."""
    prompts = random_prompts(256, [5, 7], seed=31)
    for extra in (dict(repetition_penalty=1.4), dict(top_logprobs=3), dict(logit_bias=((3, 1.0),))):
        shaped = dataclasses.replace(greedy(6), **extra)
        plain, overlapped, steps = _run_both(tiny_llama_dir, prompts, [greedy(6), shaped])
        _same(plain, overlapped)
        assert steps == 0, extra


def test_a_full_pool_keeps_overlapping_while_the_queue_waits(tiny_llama_dir):
    # 6 pages of 4 tokens, each request needs 3: two run, the third waits for pages; overlap
    # goes on while it cannot be admitted, and stops for the step that admits it
    prompts = random_prompts(256, [5, 5, 5], seed=7)
    plain, overlapped, steps = _run_both(
        tiny_llama_dir, prompts, [greedy(6), greedy(4), greedy(6)], page_size=4, num_pages=6
    )
    _same(plain, overlapped)
    assert [len(r.token_ids) for r in overlapped] == [6, 4, 6]
    assert steps >= 4


def test_a_tight_pool_preempts_between_overlapped_steps(tiny_llama_dir):
    """Pages taken as tokens need them: a speculated step takes its page where one is free,
    and where none is the scheduler's step preempts; overlap on or off, the same outputs."""
    prompts = random_prompts(256, [5, 9, 7, 6], seed=13)
    plain, overlapped, steps = _run_both(
        tiny_llama_dir, prompts, greedy(16), page_size=4, num_pages=10
    )
    _same(plain, overlapped)
    solo = our_engine(tiny_llama_dir).generate(prompts, greedy(16))
    assert [r.token_ids for r in overlapped] == [r.token_ids for r in solo]
    assert steps > 0
    engine = _engine(tiny_llama_dir, True, page_size=4, num_pages=10)
    engine.generate(prompts, greedy(16))
    assert engine.scheduler.num_preemptions > 0 and engine.overlapped_steps > 0


def test_greedy_picks_come_from_the_models_backend(tiny_llama_dir, monkeypatch):
    """Both loops take their greedy picks from `model.backend.greedy_picks` (the Triton kernel
    on the triton and flashinfer backends), not the sampler's torch ops directly: every decode
    step's picks go through it, and its answer is what the requests get."""
    for overlap in (False, True):
        engine = _engine(tiny_llama_dir, overlap)
        backend = engine.model.backend
        calls = []
        real = backend.greedy_picks

        def counted(logits, real=real, calls=calls):
            calls.append(logits.shape[0])
            return real(logits)

        monkeypatch.setattr(backend, "greedy_picks", counted)
        engine._picks = backend.greedy_picks  # what __init__ took, now counted
        prompts = random_prompts(256, [5, 9], seed=21)
        results = engine.generate(prompts, [greedy(4), greedy(6)])
        assert [len(r.token_ids) for r in results] == [4, 6]
        # one pick per step: the prefill's and each decode step's (speculated ones included)
        assert len(calls) >= 6 and sum(calls) >= 10, calls

        # and what they pick is what the requests get: a backend that picks token 7 everywhere
        def sevens(logits, real=real):
            tokens, picked = real(logits)
            picked[:, 0] = 7.0
            return tokens.fill_(7), picked

        engine = _engine(tiny_llama_dir, overlap)
        engine._picks = sevens
        out = engine.generate([prompts[0]], greedy(3))[0].token_ids
        assert list(out) == [7, 7, 7], (overlap, out)
