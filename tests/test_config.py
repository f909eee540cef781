"""config.json parsing: transformers 4.x and 5.x spellings, and clear refusals."""

from __future__ import annotations

import pytest

from snapfn.handler.llm.config import ModelConfig
from snapfn.snapshot.errors import UnsupportedModel

BASE = {
    "model_type": "llama",
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "torch_dtype": "bfloat16",
}
LLAMA3 = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def test_transformers4_and_5_rope_spellings_agree():
    v4 = ModelConfig.from_hf(
        {**BASE, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **LLAMA3}}
    )
    v5 = ModelConfig.from_hf(
        {**BASE, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3}}
    )
    old = ModelConfig.from_hf(
        {**BASE, "rope_theta": 500000.0, "rope_scaling": {"type": "llama3", **LLAMA3}}
    )
    assert v4.rope == v5.rope == old.rope
    assert v5.rope.theta == 500000.0 and v5.rope.rope_type == "llama3"
    assert v5.head_dim == 16 and v5.dtype.is_floating_point


def test_dtype_from_v5_dtype_key():
    cfg = ModelConfig.from_hf({**BASE, "dtype": "float32"})
    assert cfg.torch_dtype == "float32"


@pytest.mark.parametrize(
    "update, message",
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
        ({"rope_scaling": {"rope_type": "longrope"}}, "rope type 'longrope'"),
        ({"quantization_config": {"quant_method": "awq"}}, "quant_method 'awq'"),
        (
            {"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}},
            "weight_block_size",
        ),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"torch_dtype": "int8"}, "dtype 'int8'"),
        (
            {
                "model_type": "qwen2",
                "use_sliding_window": True,
                "sliding_window": "8",
                "max_window_layers": 0,
            },
            "sliding_window to be a positive integer, got '8'",
        ),
        ({"model_type": "mistral", "sliding_window": 0}, "positive integer, got 0"),
    ],
)
def test_unsupported_options_are_refused_by_name(update, message):
    with pytest.raises(UnsupportedModel, match=message):
        ModelConfig.from_hf({**BASE, **update})


GLM = {
    **BASE,
    "model_type": "glm_moe_dsa",
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 8,
    "index_n_heads": 2,
    "index_head_dim": 16,
    "index_topk": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
}


@pytest.mark.parametrize(
    "update, dense",
    [
        ({"first_k_dense_replace": 1}, 1),
        ({"first_k_dense_replace": 5}, 2),  # transformers caps it at the layers
        ({"first_k_dense_replace": 0, "mlp_layer_types": ["dense", "sparse"]}, 1),
        ({"first_k_dense_replace": 1, "mlp_layer_types": ["sparse", "sparse"]}, 0),
    ],
)
def test_glm_dense_layers_follow_mlp_layer_types_where_listed(update, dense):
    assert ModelConfig.from_hf({**GLM, **update}).moe.first_k_dense_replace == dense


@pytest.mark.parametrize(
    "types", [["sparse", "dense"], ["dense"], ["dense", "moe"], "dense,sparse"]
)
def test_glm_mlp_layer_types_other_than_dense_then_sparse_are_refused(types):
    with pytest.raises(UnsupportedModel, match="mlp_layer_types must list 2 layers, the dense"):
        ModelConfig.from_hf({**GLM, "mlp_layer_types": types})


def test_glm_indexer_types_must_start_full():
    glm = {**GLM, "indexer_types": ["shared", "full"]}
    with pytest.raises(UnsupportedModel, match="indexer_types\\[0\\] must be 'full'"):
        ModelConfig.from_hf(glm)
    cfg = ModelConfig.from_hf({**glm, "indexer_types": ["full", "shared"]})
    assert cfg.arch == "glm_moe_dsa" and cfg.dsa.indexer_types == ("full", "shared")


@pytest.mark.parametrize(
    "update, window",
    [
        ({"model_type": "mistral", "sliding_window": 4096}, 4096),
        ({"model_type": "mistral", "sliding_window": None}, None),
        ({"model_type": "qwen2", "use_sliding_window": False, "sliding_window": 64}, None),
        (
            {
                "model_type": "qwen3",
                "use_sliding_window": True,
                "sliding_window": 64,
                "max_window_layers": 1,
            },
            64,
        ),
        # transformers: layers from max_window_layers (28) on slide, and the model has fewer
        ({"model_type": "qwen3", "use_sliding_window": True, "sliding_window": 64}, None),
        ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": None}, None),
        ({"model_type": "llama"}, None),
    ],
)
def test_a_sliding_window_is_kept_where_it_is_on(update, window):
    assert ModelConfig.from_hf({**BASE, **update}).sliding_window == window


@pytest.mark.parametrize(
    "model_type, bias, qkv, o_proj",
    [
        ("llama", True, True, True),
        ("qwen3", True, True, True),
        ("qwen2", None, True, False),  # transformers' Qwen2: q/k/v biased, o_proj not
        ("llama", None, False, False),
        ("mistral", None, False, False),
    ],
)
def test_which_attention_projections_carry_biases(model_type, bias, qkv, o_proj):
    raw = {**BASE, "model_type": model_type}
    if bias is not None:
        raw["attention_bias"] = bias
    cfg = ModelConfig.from_hf(raw)
    assert (cfg.attention_bias, cfg.o_proj_bias) == (qkv, o_proj)


@pytest.mark.parametrize(
    "keys, want",
    [
        ({}, "FFFFF"),  # transformers' defaults: every layer runs its indexer
        ({"index_topk_pattern": "FSFSS"}, "FSFSS"),
        ({"index_topk_pattern": ["full", "shared", "full", "full", "shared"]}, "FSFFS"),
        ({"index_topk_freq": 2, "index_skip_topk_offset": 1}, "FSFSF"),
        ({"index_topk_freq": 3}, "FFSSF"),  # offset 2: layer i full when (i - 1) % 3 == 0
        ({"indexer_types": ["full"] * 5, "index_topk_pattern": "FSSSS"}, "FFFFF"),  # listed wins
    ],
)
def test_glm_indexer_kinds_follow_transformers_rules(keys, want):
    kinds = ModelConfig.from_hf({**GLM, "num_hidden_layers": 5, **keys}).dsa.indexer_types
    assert "".join(k[0].upper() for k in kinds) == want


@pytest.mark.parametrize("pattern", ["FSX", "SFFFF"])
def test_a_glm_indexer_pattern_it_cannot_run_is_refused_in_one_line(pattern):
    with pytest.raises(UnsupportedModel) as err:
        ModelConfig.from_hf({**GLM, "num_hidden_layers": 5, "index_topk_pattern": pattern})
    assert "\n" not in str(err.value)
