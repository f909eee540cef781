"""Sampling beyond plain greedy (`engine/sampler.py` through `Engine`): penalties against
transformers' and vLLM's formulas, logit biases, top-k logprob alternatives, prompt logprobs
against transformers' logits, and the plain path unchanged beside them."""

from __future__ import annotations

import pytest
import torch

from snapfn.handler.llm.engine.request import SamplingParams
from snapfn.handler.llm.engine.sampler import shape_logits, top_logprobs
from snapfn.snapshot.errors import BadRequest

from parity import greedy, hf_logits, hf_model, our_engine, random_prompts


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return our_engine(tiny_llama_dir)


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    return hf_model(tiny_llama_dir)


def params(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def test_repetition_penalty_matches_transformers(engine, hf):
    (prompt,) = random_prompts(256, [6], seed=21)
    ours = engine.generate([prompt], params(16, repetition_penalty=1.8))[0].token_ids
    x = torch.tensor([prompt])
    with torch.inference_mode():
        theirs = hf.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=16,
            min_new_tokens=16,
            do_sample=False,
            repetition_penalty=1.8,
            pad_token_id=0,
            eos_token_id=None,
        )[0, len(prompt) :].tolist()
    assert list(ours) == theirs
    assert list(ours) != list(engine.generate([prompt], greedy(16))[0].token_ids)


def test_presence_and_frequency_penalties_follow_vllm():
    row = torch.tensor([2.0, -1.0, 0.5, 3.0, 0.0])
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0)
    shaped = shape_logits(row, p, prompt_ids=[4], output_ids=[0, 0, 1])
    # repetition over prompt + output (0, 1, 4): > 0 divided, <= 0 multiplied; then the
    # output's counts (0: twice, 1: once) times frequency, and presence where present
    expected = torch.tensor([2.0 / 2 - 0.25 * 2 - 0.5, -1.0 * 2 - 0.25 - 0.5, 0.5, 3.0, 0.0 * 2])
    assert torch.allclose(shaped, expected)
    assert torch.equal(row, torch.tensor([2.0, -1.0, 0.5, 3.0, 0.0]))  # not in place
    bias = SamplingParams(logit_bias=((2, 10.0), (3, -5.0)))
    assert torch.allclose(shape_logits(row, bias, [], []), row + torch.tensor([0, 0, 10, -5, 0]))


def test_frequency_penalty_stops_repeats_in_the_engine(engine):
    (prompt,) = random_prompts(256, [5], seed=22)
    plain = engine.generate([prompt], greedy(40))[0].token_ids
    assert len(set(plain)) < len(plain)  # a tiny random model repeats itself
    penalised = engine.generate([prompt], params(40, frequency_penalty=2.0, presence_penalty=2.0))
    tokens = penalised[0].token_ids
    assert len(set(tokens)) > len(set(plain))


def test_logit_bias_forces_a_token(engine):
    (prompt,) = random_prompts(256, [5], seed=23)
    out = engine.generate([prompt], params(5, logit_bias=((77, 100.0),)))[0]
    assert out.token_ids == (77,) * 5
    with pytest.raises(BadRequest, match="logit_bias token ids out of range"):
        engine.add_request(prompt, params(1, logit_bias=((256, 1.0),)))


def test_top_logprobs_are_the_raw_distributions_best(engine, hf):
    (prompt,) = random_prompts(256, [7], seed=24)
    engine_id = engine.add_request(prompt, params(4, top_logprobs=5))
    outs = []
    while engine.has_work():
        outs += [o for o in engine.step() if o.request_id == engine_id]
    tokens = [t for o in outs for t in o.new_token_ids]
    tops = [top for o in outs for top in o.new_top_logprobs]
    assert len(tops) == 4 and all(len(top) == 5 for top in tops)
    expected = torch.log_softmax(hf_logits(hf, prompt + tokens)[len(prompt) - 1 :], dim=-1)
    for i, top in enumerate(tops):
        ids = [t for t, _ in top]
        assert ids[0] == tokens[i]  # greedy: the chosen token is the most likely
        want_values, _ = torch.topk(expected[i], 5)
        assert torch.allclose(torch.tensor([lp for _, lp in top]), want_values, atol=1e-4)
        assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
    assert top_logprobs(torch.tensor([0.0, -1.0]), 0) == ()


@pytest.mark.parametrize("chunk", [64, 3])  # one prefill step, and chunked across steps
def test_prompt_logprobs_match_transformers(tiny_llama_dir, hf, chunk):
    engine = our_engine(tiny_llama_dir, max_tokens=chunk)
    (prompt,) = random_prompts(256, [9], seed=25)
    result = None
    rid = engine.add_request(prompt, params(2, prompt_logprobs=3))
    outs = []
    while engine.has_work():
        outs += [o for o in engine.step() if o.request_id == rid]
    result = outs[0]
    assert len(result.prompt_logprobs) == len(prompt) == len(result.prompt_top_logprobs)
    assert result.prompt_logprobs[0] is None and result.prompt_top_logprobs[0] is None
    expected = torch.log_softmax(hf_logits(hf, prompt), dim=-1)
    for i in range(1, len(prompt)):
        assert result.prompt_logprobs[i] == pytest.approx(
            expected[i - 1, prompt[i]].item(), abs=1e-4
        )
        assert len(result.prompt_top_logprobs[i]) == 3
    assert all(not o.prompt_logprobs for o in outs[1:])
    plain = engine.generate([prompt], greedy(2))[0].token_ids
    assert tuple(t for o in outs for t in o.new_token_ids) == plain


def test_plain_requests_beside_penalised_ones_are_unchanged(engine):
    a, b = random_prompts(256, [6, 8], seed=26)
    solo = engine.generate([a], greedy(10))[0].token_ids
    mixed = engine.generate(
        [a, b, a], [greedy(10), params(10, repetition_penalty=1.5, top_logprobs=2), greedy(10)]
    )
    assert mixed[0].token_ids == mixed[2].token_ids == solo


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(top_logprobs=21), "top_logprobs"),
        (dict(prompt_logprobs=-1), "prompt_logprobs"),
        (dict(logit_bias=((1, 101.0),)), "logit_bias"),
        (dict(temperature=2.5), "temperature"),
    ],
)
def test_out_of_range_values_are_refused(bad, says):
    with pytest.raises(BadRequest, match=says):
        SamplingParams(**bad).validate()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none here)")
def test_on_cuda_plain_rows_keep_the_kernel_and_graphs_beside_the_reference_path(tiny_llama_dir):
    """The triton backend's greedy picks, decode graphs and overlapped decode for plain greedy
    rows, the reference path for penalised and top-logprob rows in the same batches."""
    from snapfn.handler.llm.build import EngineOptions, build_engine
    from snapfn.handler.llm.engine.engine import SchedulerConfig

    def cuda_engine(backend: str, graphs: bool):
        opts = EngineOptions(
            device="cuda",
            dtype="float32",
            backend=backend,
            num_pages=256,
            scheduler=SchedulerConfig(page_size=4, max_num_batched_tokens=256),
        )
        engine = build_engine(tiny_llama_dir, opts).engine
        if graphs:
            engine.capture_graphs([1, 2, 4], max_seq_len=128)
        return engine

    prompts = random_prompts(256, [6, 9, 5], seed=27)
    shaped = params(12, repetition_penalty=1.5, frequency_penalty=0.5, top_logprobs=4)
    fast = cuda_engine("triton", graphs=True)
    solo = [fast.generate([p], greedy(12))[0] for p in prompts]
    assert fast.overlapped_steps > 0 and fast.graphs.stats.replays > 0
    mixed = fast.generate(prompts, [greedy(12), shaped, greedy(12)])
    assert mixed[0].token_ids == solo[0].token_ids and mixed[2].token_ids == solo[2].token_ids
    eager = cuda_engine("torch", graphs=False).generate([prompts[1]], shaped)[0]
    assert mixed[1].token_ids == eager.token_ids
    assert mixed[1].token_ids != solo[1].token_ids
    assert fast.graphs.stats.eager_fallbacks == 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_penalty_near_zero_still_samples(engine, temperature):
    """A repetition penalty of 1e-300 divides a positive logit past float32's range: clamped
    to its largest finite value, the row still samples (an inf in it would make every
    probability NaN, and the draw fail)."""
    logits = torch.tensor([3.0, -1.0, 0.5, 2.0])
    p = SamplingParams(repetition_penalty=1e-300)
    shaped = shape_logits(logits, p, prompt_ids=[0, 2], output_ids=[])
    assert torch.isfinite(shaped).all() and int(shaped.argmax()) == 0
    (prompt,) = random_prompts(256, [6], seed=12)
    sampled = SamplingParams(
        max_new_tokens=4,
        ignore_eos=True,
        repetition_penalty=1e-300,
        temperature=temperature,
        seed=3,
    )
    (out,) = engine.generate([prompt], sampled)
    assert len(out.token_ids) == 4
