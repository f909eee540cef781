"""A preset as a Hugging Face checkpoint: tensor names and shapes, storage dtypes, config.json.

Tensor names are exactly those transformers 5.24 `save_pretrained` writes (checked in tests
against a model built from our own config.json). GLM-5 extras transformers does not model:
routed experts are saved one tensor per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`,
transformers fuses them on load), and the `num_mtp_layers` MTP layers sit at indices
`num_layers..`: a full MoE decoder layer (indexer included) plus `eh_proj`, `enorm`, `hnorm`
and `shared_head.norm`.

No torch here: the CLI lists presets and sizes without paying for `import torch`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from snapfn.handler.llm.make_model.presets import DensePreset, GlmMoeDsaPreset, Preset
from snapfn.snapshot.errors import BadRequest

STORAGE_DTYPES = ("bf16", "fp8", "fp32")
DTYPE_BYTES = {"F32": 4, "BF16": 2, "F8_E4M3": 1}  # safetensors dtype codes
FP8_BLOCK = 128  # == quant.FP8_BLOCK; the writer checks every scale's size against this plan
EMBED_STD = 0.02
ROUTER_BIAS_STD = 0.01
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "glm_moe_dsa": "GlmMoeDsaForCausalLM",
}


@dataclass(frozen=True)
class TensorSpec:
    """One logical tensor and how to fill it: `fill` if set, else normal(0, `std`)."""

    name: str
    shape: tuple[int, ...]
    std: float = 0.0
    fill: float | None = None
    fp32: bool = False  # stored float32 whatever the checkpoint dtype (the MoE router)
    quantize: bool = False  # block-quantized to fp8 (+ `weight_scale_inv`) under dtype fp8


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as stored in a shard."""

    name: str
    dtype: str  # safetensors code: "BF16", "F32", "F8_E4M3"
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


def resolve_num_layers(preset: Preset, num_layers: int | None) -> int:
    layers = preset.num_layers if num_layers is None else num_layers
    if layers < 1:
        raise BadRequest(f"num_layers must be at least 1, got {layers}")
    return layers


def tensor_specs(preset: Preset, num_layers: int) -> list[TensorSpec]:
    """Every tensor of the checkpoint, in writing order: embeddings, layers, final norm, head."""
    h, vocab = preset.hidden_size, preset.vocab_size
    if isinstance(preset, GlmMoeDsaPreset):
        total_layers = num_layers + preset.num_mtp_layers
        layers = [_glm_layer(preset, i, num_layers) for i in range(total_layers)]
        tied = False
    else:
        layers = [_dense_layer(preset, f"model.layers.{i}") for i in range(num_layers)]
        tied = preset.tie_word_embeddings
    specs = [TensorSpec("model.embed_tokens.weight", (vocab, h), std=EMBED_STD)]
    specs += [spec for layer in layers for spec in layer]
    specs.append(_norm("model.norm", h))
    if not tied:
        specs.append(_linear("lm_head", vocab, h, quantize=False))
    return specs


def storage_units(specs: list[TensorSpec], dtype: str) -> list[tuple[TensorEntry, ...]]:
    """What each spec becomes on disk: one entry, or an fp8 weight and its float32 scale."""
    if dtype not in STORAGE_DTYPES:
        raise BadRequest(
            f"dtype {dtype!r} is not supported (choose from {', '.join(STORAGE_DTYPES)})"
        )
    units = []
    for spec in specs:
        if dtype == "fp8" and spec.quantize:
            n, k = spec.shape
            scale_shape = (-(-n // FP8_BLOCK), -(-k // FP8_BLOCK))
            units.append(
                (
                    TensorEntry(spec.name, "F8_E4M3", spec.shape),
                    TensorEntry(f"{spec.name}_scale_inv", "F32", scale_shape),
                )
            )
        else:
            stored = "F32" if dtype == "fp32" or spec.fp32 else "BF16"
            units.append((TensorEntry(spec.name, stored, spec.shape),))
    return units


def checkpoint_bytes(preset: Preset, dtype: str, num_layers: int | None = None) -> int:
    """Total tensor bytes of the checkpoint (headers and tokenizer not counted)."""
    specs = tensor_specs(preset, resolve_num_layers(preset, num_layers))
    return sum(entry.nbytes for unit in storage_units(specs, dtype) for entry in unit)


def indexer_types(preset: GlmMoeDsaPreset, num_layers: int) -> list[str]:
    pattern = preset.indexer_pattern
    if not pattern or set(pattern) - {"F", "S"} or pattern[0] != "F":
        raise BadRequest(f"indexer_pattern {pattern!r} must be F/S letters starting with F")
    return ["full" if pattern[i % len(pattern)] == "F" else "shared" for i in range(num_layers)]


def _linear(name: str, out_features: int, in_features: int, quantize: bool = True) -> TensorSpec:
    return TensorSpec(
        f"{name}.weight", (out_features, in_features), std=in_features**-0.5, quantize=quantize
    )


def _norm(name: str, dim: int) -> TensorSpec:
    return TensorSpec(f"{name}.weight", (dim,), fill=1.0)


def _mlp(prefix: str, hidden: int, intermediate: int) -> list[TensorSpec]:
    return [
        _linear(f"{prefix}.gate_proj", intermediate, hidden),
        _linear(f"{prefix}.up_proj", intermediate, hidden),
        _linear(f"{prefix}.down_proj", hidden, intermediate),
    ]


def _dense_layer(p: DensePreset, prefix: str) -> list[TensorSpec]:
    h, d = p.hidden_size, p.head_dim
    q_dim, kv_dim = p.num_heads * d, p.num_kv_heads * d
    attn = f"{prefix}.self_attn"
    specs = [_norm(f"{prefix}.input_layernorm", h)]
    for proj, out_features in (("q_proj", q_dim), ("k_proj", kv_dim), ("v_proj", kv_dim)):
        specs.append(_linear(f"{attn}.{proj}", out_features, h))
        if p.attention_bias:
            specs.append(TensorSpec(f"{attn}.{proj}.bias", (out_features,), std=EMBED_STD))
    specs.append(_linear(f"{attn}.o_proj", h, q_dim))
    if p.qk_norm:
        specs += [_norm(f"{attn}.q_norm", d), _norm(f"{attn}.k_norm", d)]
    specs.append(_norm(f"{prefix}.post_attention_layernorm", h))
    return specs + _mlp(f"{prefix}.mlp", h, p.intermediate_size)


def _glm_layer(p: GlmMoeDsaPreset, index: int, num_layers: int) -> list[TensorSpec]:
    prefix, h = f"model.layers.{index}", p.hidden_size
    is_mtp = index >= num_layers
    full_indexer = is_mtp or indexer_types(p, num_layers)[index] == "full"
    specs = [_norm(f"{prefix}.input_layernorm", h)]
    specs += _mla_attention(p, f"{prefix}.self_attn", full_indexer)
    specs.append(_norm(f"{prefix}.post_attention_layernorm", h))
    if index < min(p.first_k_dense_replace, num_layers):
        specs += _mlp(f"{prefix}.mlp", h, p.intermediate_size)
    else:
        specs += _moe(p, f"{prefix}.mlp")
    if is_mtp:
        specs += [
            _linear(f"{prefix}.eh_proj", h, 2 * h, quantize=False),  # [h, concat(enorm, hnorm)]
            _norm(f"{prefix}.enorm", h),
            _norm(f"{prefix}.hnorm", h),
            _norm(f"{prefix}.shared_head.norm", h),
        ]
    return specs


def _mla_attention(p: GlmMoeDsaPreset, prefix: str, full_indexer: bool) -> list[TensorSpec]:
    h, heads = p.hidden_size, p.num_heads
    qk_head_dim = p.qk_nope_head_dim + p.qk_rope_head_dim
    specs = [
        _linear(f"{prefix}.q_a_proj", p.q_lora_rank, h),
        _norm(f"{prefix}.q_a_layernorm", p.q_lora_rank),
        _linear(f"{prefix}.q_b_proj", heads * qk_head_dim, p.q_lora_rank),
        _linear(f"{prefix}.kv_a_proj_with_mqa", p.kv_lora_rank + p.qk_rope_head_dim, h),
        _norm(f"{prefix}.kv_a_layernorm", p.kv_lora_rank),
        _linear(f"{prefix}.kv_b_proj", heads * (p.qk_nope_head_dim + p.v_head_dim), p.kv_lora_rank),
        _linear(f"{prefix}.o_proj", h, heads * p.v_head_dim),
    ]
    if full_indexer:
        idx = f"{prefix}.indexer"
        specs += [
            _linear(f"{idx}.wq_b", p.index_n_heads * p.index_head_dim, p.q_lora_rank),
            _linear(f"{idx}.wk", p.index_head_dim, h),
            _norm(f"{idx}.k_norm", p.index_head_dim),  # a LayerNorm: weight and bias
            TensorSpec(f"{idx}.k_norm.bias", (p.index_head_dim,), fill=0.0),
            _linear(f"{idx}.weights_proj", p.index_n_heads, h, quantize=False),
        ]
    return specs


def _moe(p: GlmMoeDsaPreset, prefix: str) -> list[TensorSpec]:
    h, num_experts = p.hidden_size, p.n_routed_experts
    specs = [
        spec
        for e in range(num_experts)
        for spec in _mlp(f"{prefix}.experts.{e}", h, p.moe_intermediate_size)
    ]
    specs += [
        TensorSpec(f"{prefix}.gate.weight", (num_experts, h), std=h**-0.5, fp32=True),
        TensorSpec(
            f"{prefix}.gate.e_score_correction_bias", (num_experts,), std=ROUTER_BIAS_STD, fp32=True
        ),
    ]
    shared = p.moe_intermediate_size * p.n_shared_experts
    return specs + _mlp(f"{prefix}.shared_experts", h, shared)


def modules_not_converted(specs: list[TensorSpec]) -> list[str]:
    """`modules_to_not_convert` patterns: every module whose weight stays unquantized.

    Patterns drop the `model.layers.{i}.` prefix, so transformers matches them as suffixes
    (`mlp.gate` matches `model.layers.3.mlp.gate`, not `mlp.gate_proj`).
    """
    patterns = ["lm_head"]  # listed even when tied: the module exists either way
    for spec in specs:
        if spec.quantize or not spec.name.endswith(".weight"):
            continue
        pattern = re.sub(r"^model\.layers\.\d+\.", "", spec.name.removesuffix(".weight"))
        if pattern not in patterns:
            patterns.append(pattern)
    return patterns
