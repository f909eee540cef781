"""The same parity checks on a CUDA device. Skipped on machines without one."""

from __future__ import annotations

import pytest
import torch

from snapfn.handler.llm.build import EngineOptions, build_engine
from snapfn.handler.llm.engine.engine import SchedulerConfig

from parity import greedy, hf_greedy, hf_logits, hf_model, random_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)"
    ),
]


def _flat(results) -> list[float]:
    """Every result's logprobs in one list (pytest.approx compares flat sequences only: it
    refuses nested ones, or on older versions compares their items exactly)."""
    return [lp for r in results for lp in r.logprobs]


def cuda_engine(model_dir, dtype="float32"):
    opts = EngineOptions(
        device="cuda", dtype=dtype, num_pages=256, scheduler=SchedulerConfig(page_size=4)
    )
    return build_engine(model_dir, opts).engine


@pytest.mark.parametrize(
    "fixture",
    [
        "tiny_llama_dir",
        "tiny_qwen2_dir",
        "tiny_qwen3_dir",
        "tiny_mistral_dir",
        "tiny_llama_bias_dir",
    ],
)
def test_cuda_greedy_matches_transformers(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    prompts = random_prompts(256, [4, 19, 11], seed=5)
    results = cuda_engine(model_dir).generate(prompts, greedy(32))
    hf = hf_model(model_dir)
    for prompt, result in zip(prompts, results, strict=True):
        assert list(result.token_ids) == hf_greedy(hf, prompt, 32)


def test_cuda_bf16_logits_close_to_fp32_reference(tiny_llama_dir):
    engine = cuda_engine(tiny_llama_dir, dtype="bfloat16")
    (ids,) = random_prompts(256, [17], seed=6)
    (result,) = engine.generate([ids], greedy(1))
    ref = torch.log_softmax(hf_logits(hf_model(tiny_llama_dir), ids)[-1], -1)
    assert result.logprobs[0] == pytest.approx(float(ref[result.token_ids[0]]), abs=5e-2)


@pytest.mark.parametrize("on_first_use", [False, True])
@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen3_dir", "tiny_llama_bias_dir"])
def test_graph_replay_matches_eager(fixture, on_first_use, request):
    model_dir = request.getfixturevalue(fixture)
    prompts = random_prompts(256, [4, 19, 11], seed=5)
    eager = cuda_engine(model_dir).generate(prompts, greedy(16))
    engine = cuda_engine(model_dir)
    stats = engine.capture_graphs([1, 2, 4], max_seq_len=256, on_first_use=on_first_use)
    if on_first_use:  # one request first: bucket 1 captured, then the three's bucket 4 (a
        # prefill replays only captured buckets: its 4 tokens ran eagerly)
        (alone,) = engine.generate(prompts[:1], greedy(16))
        assert alone.token_ids == eager[0].token_ids
        assert stats.captured_on_first_use == [1] and stats.prefill_replays == 0
    graphed = engine.generate(prompts, greedy(16))
    assert [r.token_ids for r in graphed] == [r.token_ids for r in eager]
    assert _flat(graphed) == pytest.approx(_flat(eager), abs=1e-5)
    assert stats.replays > 0 and stats.eager_fallbacks == 0
    if on_first_use:
        assert stats.captured_on_first_use == [1, 4]
    # five requests exceed the largest bucket (4): decode runs eagerly and is counted
    more = random_prompts(256, [3, 5, 7, 9, 2], seed=6)
    engine.generate(more, greedy(4))
    assert stats.eager_fallbacks > 0


def test_a_tight_pool_preempts_between_graph_replays(tiny_llama_dir):
    """KV pages taken as tokens need them (engine/scheduler.py) in a pool too small for every
    request at once: preemptions between replayed and overlapped decode steps, and the large
    pool's tokens."""
    prompts = random_prompts(256, [5, 9, 7, 6, 11, 8], seed=3)
    want = cuda_engine(tiny_llama_dir).generate(prompts, greedy(24))
    opts = EngineOptions(
        device="cuda", dtype="float32", num_pages=14, scheduler=SchedulerConfig(page_size=4)
    )
    engine = build_engine(tiny_llama_dir, opts).engine  # the longest request needs 9 pages
    stats = engine.capture_graphs([1, 2, 4, 8], max_seq_len=64)
    got = engine.generate(prompts, greedy(24))
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert _flat(got) == pytest.approx(_flat(want), abs=1e-4)
    assert engine.scheduler.num_preemptions > 0 and stats.replays > 0
    assert engine.overlapped_steps > 0 and stats.eager_fallbacks == 0
    assert engine.scheduler.num_available_pages() == 14


@pytest.mark.parametrize(
    "fixture", ["tiny_llama_dir", "tiny_qwen3_dir", "tiny_mistral_dir", "tiny_llama_bias_dir"]
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_short_prefills_through_decode_graphs_match_transformers(fixture, dtype, request):
    """Prompts of up to the largest bucket, alone and in 8-token chunks beside decodes, prefilled
    by replaying the decode graphs a row a token: transformers' greedy tokens (fp32), and the
    eager prefill's within bf16's rounding."""
    model_dir = request.getfixturevalue(fixture)
    prompts = random_prompts(256, [3, 13, 30, 7], seed=9)
    opts = EngineOptions(
        device="cuda",
        dtype=dtype,
        num_pages=256,
        scheduler=SchedulerConfig(page_size=4, max_num_batched_tokens=8),
    )
    eager = build_engine(model_dir, opts).engine.generate(prompts, greedy(12))
    engine = build_engine(model_dir, opts).engine
    stats = engine.capture_graphs([1, 2, 4, 8, 16, 32], max_seq_len=256)
    alone = [engine.generate([p], greedy(12))[0] for p in prompts]  # each in chunks of 8
    chunked = engine.generate(prompts, greedy(12))  # chunks of 8 beside decode rows
    assert stats.prefill_replays > len(prompts) and stats.eager_fallbacks == 0
    if dtype == "float32":
        hf = hf_model(model_dir)
        for prompt, one, many in zip(prompts, alone, chunked, strict=True):
            want = hf_greedy(hf, prompt, 12)
            assert list(one.token_ids) == want and list(many.token_ids) == want
    for results in (alone, chunked):  # bf16: the first token's logprob, one rounding apart
        got = [r.logprobs[0] for r in results]
        assert got == pytest.approx(
            [r.logprobs[0] for r in eager], abs=5e-2 if dtype == "bfloat16" else 1e-4
        )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_uncaptured_bucket_gives_its_replay_bit_for_bit(tiny_llama_dir, dtype):
    """A tier-0 restore (graphs captured on first use) runs a short prefill's rows eagerly over
    the bucket's static inputs (`DecodeGraphs.run_uncaptured`); the init replays them from the
    captured graph. The same kernels over the same inputs: the same logprobs, exactly, so every
    process answers its first request as the cold init does."""
    prompts = random_prompts(256, [6, 3, 13], seed=10)
    opts = EngineOptions(
        device="cuda", dtype=dtype, num_pages=256, scheduler=SchedulerConfig(page_size=4)
    )
    results = {}
    for late in (False, True):
        engine = build_engine(tiny_llama_dir, opts).engine
        stats = engine.capture_graphs([1, 2, 4, 8, 16], max_seq_len=256, on_first_use=late)
        results[late] = [engine.generate([p], greedy(1))[0] for p in prompts]
        assert stats.prefill_replays == (0 if late else len(prompts))
    for a, b in zip(results[True], results[False], strict=True):
        assert (a.token_ids, a.logprobs) == (b.token_ids, b.logprobs)
