"""`config.json` and `generation_config.json` for a preset, as transformers 5.24 writes them.

Keys follow what `save_pretrained` writes for each `model_type` (transformers 5 spells RoPE as
`rope_parameters`, the dtype as `dtype`). For GLM-5 we add what real checkpoints carry and
transformers does not model (`num_nextn_predict_layers`, `scoring_func`, `topk_method`), and
leave out `layer_types` / `mlp_layer_types`: 5.24 derives both from `num_hidden_layers` and
`first_k_dense_replace`, and 5.17 rejects the "indexed_attention" layer type 5.24 writes.
For fp8, the DeepSeek/GLM `quantization_config`.
"""

from __future__ import annotations

from typing import Any

from snapfn.handler.llm.make_model.hf_layout import ARCHITECTURES, FP8_BLOCK, indexer_types
from snapfn.handler.llm.make_model.presets import DensePreset, GlmMoeDsaPreset, Preset


def config_json(
    preset: Preset,
    num_layers: int,
    dtype: str,
    *,
    bos_token_id: int,
    eos_token_id: int,
    modules_to_not_convert: list[str],
) -> dict[str, Any]:
    """The `config.json` dict; `modules_to_not_convert` is used when `dtype == "fp8"`."""
    config = {
        "architectures": [ARCHITECTURES[preset.model_type]],
        "attention_dropout": 0.0,
        "bos_token_id": bos_token_id,
        "dtype": "float32" if dtype == "fp32" else "bfloat16",
        "eos_token_id": eos_token_id,
        "hidden_act": "silu",
        "hidden_size": preset.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": preset.intermediate_size,
        "max_position_embeddings": preset.max_position_embeddings,
        "model_type": preset.model_type,
        "num_attention_heads": preset.num_heads,
        "num_hidden_layers": num_layers,
        "pad_token_id": None,
        "rms_norm_eps": preset.rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": preset.rope_theta},
        "use_cache": True,
        "vocab_size": preset.vocab_size,
    }
    if isinstance(preset, GlmMoeDsaPreset):
        config.update(_glm_fields(preset, num_layers))
    else:
        config.update(_dense_fields(preset, num_layers))
    if dtype == "fp8":
        config["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
            "modules_to_not_convert": modules_to_not_convert,
        }
    return config


def generation_config_json(bos_token_id: int, eos_token_ids: list[int]) -> dict[str, Any]:
    return {"bos_token_id": bos_token_id, "eos_token_id": eos_token_ids}


def _dense_fields(p: DensePreset, num_layers: int) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "num_key_value_heads": p.num_kv_heads,
        "tie_word_embeddings": p.tie_word_embeddings,
    }
    if p.rope_scaling:
        fields["rope_parameters"] = {"rope_theta": p.rope_theta, **dict(p.rope_scaling)}
    if p.model_type == "llama":
        fields.update(attention_bias=p.attention_bias, mlp_bias=False, pretraining_tp=1)
    if p.model_type != "qwen2":  # Qwen2Config has no head_dim: hidden_size // num_heads
        fields["head_dim"] = p.head_dim
    if p.model_type == "qwen3":
        fields["attention_bias"] = p.attention_bias
    if p.model_type in ("qwen2", "qwen3"):
        fields.update(
            layer_types=["full_attention"] * num_layers,
            max_window_layers=num_layers,
            sliding_window=None,
            use_sliding_window=False,
        )
    return fields


def _glm_fields(p: GlmMoeDsaPreset, num_layers: int) -> dict[str, Any]:
    return {
        "attention_bias": False,
        "first_k_dense_replace": min(p.first_k_dense_replace, num_layers),
        "head_dim": p.qk_rope_head_dim,  # transformers points head_dim at the RoPE slice
        "index_head_dim": p.index_head_dim,
        "index_n_heads": p.index_n_heads,
        "index_topk": p.index_topk,
        "indexer_types": indexer_types(p, num_layers),
        "kv_lora_rank": p.kv_lora_rank,
        "mlp_bias": False,
        "moe_intermediate_size": p.moe_intermediate_size,
        "n_group": p.n_group,
        "n_routed_experts": p.n_routed_experts,
        "n_shared_experts": p.n_shared_experts,
        "norm_topk_prob": p.norm_topk_prob,
        "num_experts_per_tok": p.num_experts_per_tok,
        "num_key_value_heads": p.num_heads,
        "num_nextn_predict_layers": p.num_mtp_layers,
        "output_router_logits": False,
        "q_lora_rank": p.q_lora_rank,
        "qk_head_dim": p.qk_nope_head_dim + p.qk_rope_head_dim,
        "qk_nope_head_dim": p.qk_nope_head_dim,
        "qk_rope_head_dim": p.qk_rope_head_dim,
        "routed_scaling_factor": p.routed_scaling_factor,
        "scoring_func": "sigmoid",
        "tie_word_embeddings": False,
        "topk_group": p.topk_group,
        "topk_method": "noaux_tc",
        "v_head_dim": p.v_head_dim,
    }
