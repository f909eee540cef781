"""Warmup and the memory profile's dummy prefill on a model of fewer positions than a prefill
chunk (the embedded model: 256 positions, chunks of 2048 tokens by default)."""

from __future__ import annotations

import pytest
import torch

from snapfn.handler.llm.build import EngineOptions, allocate_kv, build_model
from snapfn.handler.llm.config import ModelConfig
from snapfn.handler.llm.embedded import embedded_model_dir
from snapfn.handler.llm.engine.memory import dummy_prefill
from snapfn.handler.llm.engine.warmup import warmup
from snapfn.handler.llm.weights.checkpoint import Checkpoint
from snapfn.handler.llm.weights.loader import load_weights

PAGE = 16


@pytest.fixture(scope="module")
def embedded():
    model_dir = embedded_model_dir()
    model = build_model(ModelConfig.from_dir(model_dir), EngineOptions(dtype="float32"))
    load_weights(model, Checkpoint.open(model_dir))
    return model


@torch.inference_mode()
def test_a_prefill_longer_than_the_positions_runs_as_prompts_that_fit(embedded):
    positions = embedded.config.max_position_embeddings
    kv = allocate_kv(embedded, 64, PAGE)
    tokens = 2 * positions + 88
    logits = dummy_prefill(embedded, kv, tokens, list(range(kv.pages_for(tokens))))
    # three prompts, each from position 0 in pages of its own: the two full ones read alike
    assert logits.shape[0] == 3
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)
    alone = allocate_kv(embedded, 64, PAGE)
    short = dummy_prefill(embedded, alone, 88, list(range(alone.pages_for(88))))
    torch.testing.assert_close(logits[2], short[0], rtol=1e-5, atol=1e-5)


def test_warmup_runs_a_chunk_longer_than_the_positions(embedded):
    kv = allocate_kv(embedded, 256, PAGE)
    free = kv.allocator.num_free
    shapes = warmup(embedded, kv, [1, 2], (2048,))
    assert shapes["shape_list"] == ["decode1", "decode2", "prefill2048"]
    assert kv.allocator.num_free == free
