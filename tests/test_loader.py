"""The coverage check: every checkpoint tensor used, every parameter filled, FP8 pairs whole."""

from __future__ import annotations

import pytest
import torch

from snapfn.snapshot.errors import CheckpointError

from ckpt_edit import copy_with, fp8_quantize_checkpoint
from conftest import save_tiny
from parity import hf_logits, hf_model, our_engine, our_prefill_logits, random_prompts


def test_missing_tensor_is_named(tiny_llama_dir, tmp_path):
    name = "model.layers.1.mlp.up_proj.weight"
    bad = copy_with(tiny_llama_dir, tmp_path / "m", drop=[name])
    with pytest.raises(CheckpointError, match="not filled.*model.layers.1.mlp.up_proj.weight"):
        our_engine(bad)


def test_extra_tensor_is_named(tiny_llama_dir, tmp_path):
    bad = copy_with(
        tiny_llama_dir, tmp_path / "m", add={"model.layers.0.mlp.extra.weight": torch.zeros(2)}
    )
    with pytest.raises(CheckpointError, match="does not use: model.layers.0.mlp.extra.weight"):
        our_engine(bad)


def test_wrong_shape_is_named(tiny_llama_dir, tmp_path):
    name = "model.layers.0.self_attn.o_proj.weight"
    bad = copy_with(tiny_llama_dir, tmp_path / "m", add={name: torch.zeros(3, 3)})
    with pytest.raises(CheckpointError, match=f"{name}: shape"):
        our_engine(bad)


@pytest.fixture(scope="module")
def fp8_pair(tiny_llama_dir, tmp_path_factory):
    return fp8_quantize_checkpoint(tiny_llama_dir, tmp_path_factory.mktemp("fp8"))


def test_fp8_matches_dequantized_reference(fp8_pair):
    fp8_dir, deq_dir = fp8_pair
    (ids,) = random_prompts(256, [19], seed=4)
    engine = our_engine(fp8_dir)
    qkv = engine.model.model.layers[0].self_attn.qkv_proj  # tiny heads: FP8 parts kept apart
    assert qkv.parts["q_proj"].weight.dtype == torch.float8_e4m3fn
    ours = our_prefill_logits(engine, ids, 6)
    torch.testing.assert_close(ours, hf_logits(hf_model(deq_dir), ids), atol=2e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def fp8_aligned_pair(tmp_path_factory):
    """A llama whose q, k, v, gate and up rows are whole 128-row blocks: fused FP8 weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    src = save_tiny(
        tmp_path_factory,
        "llama128",
        5,
        LlamaConfig,
        LlamaForCausalLM,
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=256,
        tie_word_embeddings=False,
    )
    return fp8_quantize_checkpoint(src, tmp_path_factory.mktemp("fp8-128"))


def test_fp8_fused_projections_match_dequantized_reference(fp8_aligned_pair):
    fp8_dir, deq_dir = fp8_aligned_pair
    (ids,) = random_prompts(256, [19], seed=5)
    engine = our_engine(fp8_dir)
    layer = engine.model.model.layers[1]
    for fused, rows in ((layer.self_attn.qkv_proj, 384), (layer.mlp.gate_up_proj, 512)):
        assert fused.weight.dtype == torch.float8_e4m3fn and fused.weight.shape[0] == rows
        assert fused.weight_scale_inv.shape[0] == rows // 128
    ours = our_prefill_logits(engine, ids, 6)
    torch.testing.assert_close(ours, hf_logits(hf_model(deq_dir), ids), atol=2e-4, rtol=1e-4)


def test_missing_fused_part_is_named_as_in_the_checkpoint(fp8_aligned_pair, tmp_path):
    name = "model.layers.0.self_attn.k_proj.weight_scale_inv"
    bad = copy_with(fp8_aligned_pair[0], tmp_path / "m", drop=[name])
    with pytest.raises(CheckpointError, match="without weight_scale_inv"):
        our_engine(bad)
    name = "model.layers.0.self_attn.v_proj.weight"
    bad = copy_with(fp8_aligned_pair[1], tmp_path / "d", drop=[name])
    with pytest.raises(CheckpointError, match=f"not filled by the checkpoint: {name}"):
        our_engine(bad)


def test_missing_scale_is_named(fp8_pair, tmp_path):
    name = "model.layers.0.mlp.down_proj.weight_scale_inv"
    bad = copy_with(fp8_pair[0], tmp_path / "m", drop=[name])
    with pytest.raises(
        CheckpointError, match="without weight_scale_inv: model.layers.0.mlp.down_proj.weight"
    ):
        our_engine(bad)


def test_orphan_scale_is_named(tiny_llama_dir, tmp_path):
    name = "model.layers.0.mlp.down_proj.weight_scale_inv"
    bad = copy_with(tiny_llama_dir, tmp_path / "m", add={name: torch.ones(1, 1)})
    with pytest.raises(CheckpointError, match=f"without an FP8 weight: {name}"):
        our_engine(bad)


def test_fp8_where_model_expects_dense_is_refused(fp8_pair, tmp_path):
    # declaring a quantized module as not-converted must not silently run on raw fp8 bytes
    bad = copy_with(
        fp8_pair[0],
        tmp_path / "m",
        config_update={
            "quantization_config": {
                "quant_method": "fp8",
                "weight_block_size": [128, 128],
                "modules_to_not_convert": ["lm_head", "o_proj"],
            }
        },
    )
    with pytest.raises(
        CheckpointError,
        match="FP8 in the checkpoint but dense in the model: model.layers.0.self_attn.o_proj.weight",
    ):
        our_engine(bad)


def test_missing_index_shard_is_named(tiny_llama_dir, tmp_path):
    import json
    import shutil

    d = shutil.copytree(tiny_llama_dir, tmp_path / "m")
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    names = json.loads(
        json.dumps(
            list(
                __import__("safetensors")
                .safe_open(d / "model-00001-of-00002.safetensors", "pt")
                .keys()
            )
        )
    )
    weight_map = {n: "model-00001-of-00002.safetensors" for n in names}
    weight_map[names[0]] = "model-00002-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    with pytest.raises(
        CheckpointError, match="model-00002-of-00002.safetensors listed in the index is missing"
    ):
        our_engine(d)
