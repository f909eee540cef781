"""Llama-family parity with Hugging Face transformers: logits and greedy generations."""

from __future__ import annotations

import pytest
import torch

from parity import (
    greedy,
    hf_greedy,
    hf_logits,
    hf_model,
    our_engine,
    our_prefill_logits,
    random_prompts,
)

ARCHS = [
    "tiny_llama_dir",
    "tiny_qwen2_dir",
    "tiny_qwen3_dir",
    "tiny_mistral_dir",
    "tiny_llama_bias_dir",
]


@pytest.mark.parametrize("fixture", ARCHS)
@pytest.mark.parametrize("chunk", [64, 5])
def test_logits_match_transformers(fixture, chunk, request):
    model_dir = request.getfixturevalue(fixture)
    (ids,) = random_prompts(256, [23])
    ours = our_prefill_logits(our_engine(model_dir), ids, chunk)
    ref = hf_logits(hf_model(model_dir), ids)
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("fixture", ARCHS)
def test_batched_greedy_matches_transformers(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    prompts = random_prompts(256, [3, 17, 9, 30], seed=1)
    # a small token budget forces chunked prefill interleaved with decode
    results = our_engine(model_dir, max_tokens=16).generate(prompts, greedy(32))
    hf = hf_model(model_dir)
    for prompt, result in zip(prompts, results, strict=True):
        assert list(result.token_ids) == hf_greedy(hf, prompt, 32)
        assert result.finish_reason == "length"


def test_logprobs_are_log_softmax_of_logits(tiny_llama_dir):
    engine = our_engine(tiny_llama_dir)
    (ids,) = random_prompts(256, [11], seed=3)
    (result,) = engine.generate([ids], greedy(1))
    ref = torch.log_softmax(hf_logits(hf_model(tiny_llama_dir), ids)[-1], -1)
    assert result.token_ids[0] == int(ref.argmax())
    assert result.logprobs[0] == pytest.approx(float(ref.max()), abs=1e-4)


@pytest.mark.parametrize("rope_type", ["default", "yarn"])
def test_rotary_table_rows_equal_the_per_step_cos_sin(monkeypatch, rope_type):
    from snapfn.handler.llm.config import RopeConfig
    from snapfn.handler.llm.models import layers

    rope = RopeConfig(theta=10000.0, rope_type=rope_type, factor=4.0, mscale_all_dim=1.0)
    positions = torch.tensor([0, 5, 4095, 17, 5])
    tabled = layers.Rotary(rope, 64, 4096, "cpu")
    cos, sin = tabled.cos_sin(positions, torch.bfloat16)
    monkeypatch.setattr(layers, "ROPE_TABLE_MAX_BYTES", 0)  # too long to keep: per step
    per_step = layers.Rotary(rope, 64, 4096, "cpu")
    want_cos, want_sin = per_step.cos_sin(positions, torch.bfloat16)
    assert per_step._tables[torch.bfloat16] is None and tabled._tables[torch.bfloat16] is not None
    assert cos.shape == (5, 32) and cos.dtype == torch.bfloat16
    # the same float32 ops, once for all positions: the rows agree to float32 rounding
    torch.testing.assert_close(cos, want_cos, atol=0, rtol=2**-8)
    torch.testing.assert_close(sin, want_sin, atol=0, rtol=2**-8)


def test_a_sliding_window_caps_the_context_served(tiny_mistral_dir):
    """Within its window Mistral's attention is full attention: the engine serves that many
    tokens at most (a longer prompt is refused, saying so; a generation ends at it)."""
    from snapfn.snapshot.errors import BadRequest

    engine = our_engine(tiny_mistral_dir)
    assert engine.model.config.sliding_window == 96 and engine.max_model_len == 96
    with pytest.raises(BadRequest, match="more than the 95 this engine accepts .*sliding"):
        engine.generate(random_prompts(256, [96]), greedy(1))
    (ids,) = random_prompts(256, [90], seed=5)
    (result,) = engine.generate([ids], greedy(32))
    assert len(result.token_ids) == 6 and result.finish_reason == "length"
    assert list(result.token_ids) == hf_greedy(hf_model(tiny_mistral_dir), ids, 6)
