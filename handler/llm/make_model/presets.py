"""Named model shapes for `snapfn make-model`: a frozen table, nothing computed here.

A preset fixes every dimension of a synthetic checkpoint. `DensePreset` covers the Llama family
(llama, qwen2 with q/k/v bias, qwen3 with per-head q/k norms); `GlmMoeDsaPreset` covers GLM-5
(MLA attention, DSA indexer, sigmoid-routed MoE, one MTP layer). `hf_layout` turns a preset
into tensor shapes and a `config.json`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import MappingProxyType

from snapfn.snapshot.errors import BadRequest


def llama3_rope(original_max_position_embeddings: int) -> tuple[tuple[str, str | float | int], ...]:
    """Llama-3.1 RoPE scaling (factor 8) as extra `rope_parameters` keys."""
    return (
        ("rope_type", "llama3"),
        ("factor", 8.0),
        ("low_freq_factor", 1.0),
        ("high_freq_factor", 4.0),
        ("original_max_position_embeddings", original_max_position_embeddings),
    )


@dataclass(frozen=True)
class DensePreset:
    """A Llama-family decoder: GQA attention + SwiGLU MLP in every layer."""

    model_type: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: tuple[tuple[str, str | float | int], ...] = ()  # extra rope_parameters keys
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # qwen2: bias on q/k/v (not o)
    qk_norm: bool = False  # qwen3: RMSNorm over each head of q and k
    rms_norm_eps: float = 1e-5


@dataclass(frozen=True)
class GlmMoeDsaPreset:
    """GLM-5 (`glm_moe_dsa`): MLA + DSA indexer, first layers dense, then MoE, plus MTP layers."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int  # dense MLP of the first `first_k_dense_replace` layers
    moe_intermediate_size: int  # each routed expert, and each shared expert
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    first_k_dense_replace: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    indexer_pattern: str  # "F" full / "S" shared, cycled over the layers; layer 0 must be "F"
    max_position_embeddings: int
    rope_theta: float
    num_mtp_layers: int = 1
    rms_norm_eps: float = 1e-5
    model_type: str = "glm_moe_dsa"


Preset = DensePreset | GlmMoeDsaPreset

_TINY_DENSE = dict(
    vocab_size=512,
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=128,
    max_position_embeddings=2048,
)

# what glm-tiny and glm-small share: a small vocabulary and glm-tiny's routing and indexer
_TINY_GLM = dict(
    vocab_size=512,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    first_k_dense_replace=1,
    index_n_heads=4,
    indexer_pattern="FS",
    max_position_embeddings=4096,
    rope_theta=1000000.0,
)

_GLM_SMALL = GlmMoeDsaPreset(
    **_TINY_GLM,
    hidden_size=256,
    num_layers=3,
    num_heads=8,
    q_lora_rank=128,
    kv_lora_rank=512,
    qk_nope_head_dim=64,
    qk_rope_head_dim=64,
    v_head_dim=64,
    intermediate_size=512,
    moe_intermediate_size=64,
    index_head_dim=128,
    index_topk=8,
)

PRESETS: MappingProxyType[str, Preset] = MappingProxyType(
    {
        "tiny": DensePreset(
            "llama", **_TINY_DENSE, rope_theta=500000.0, rope_scaling=llama3_rope(256)
        ),
        "small": DensePreset(
            "llama",
            vocab_size=16384,
            hidden_size=768,
            num_layers=12,
            num_heads=12,
            num_kv_heads=4,
            head_dim=64,
            intermediate_size=2048,
            max_position_embeddings=8192,
            rope_theta=500000.0,
        ),
        "8b": DensePreset(  # Llama-3-8B / 3.1-8B
            "llama",
            vocab_size=128256,
            hidden_size=4096,
            num_layers=32,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=14336,
            max_position_embeddings=131072,
            rope_theta=500000.0,
            rope_scaling=llama3_rope(8192),
        ),
        "qwen3-tiny": DensePreset(
            "qwen3",
            **{**_TINY_DENSE, "head_dim": 32},  # qwen3 heads need not divide hidden_size
            rope_theta=1000000.0,
            tie_word_embeddings=True,
            qk_norm=True,
            rms_norm_eps=1e-6,
        ),
        "qwen2-tiny": DensePreset(
            "qwen2",
            **_TINY_DENSE,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
            attention_bias=True,
            rms_norm_eps=1e-6,
        ),
        "glm-tiny": GlmMoeDsaPreset(
            **_TINY_GLM,
            hidden_size=64,
            num_layers=4,
            num_heads=4,
            q_lora_rank=96,
            kv_lora_rank=32,
            qk_nope_head_dim=32,
            qk_rope_head_dim=16,
            v_head_dim=32,
            intermediate_size=192,
            moe_intermediate_size=48,
            index_head_dim=32,
            index_topk=4,
        ),
        # glm-tiny's routing, wider: the latent widths of GLM-5's MLA (kv_lora_rank 512, rope
        # 64), which flashinfer's MLA kernels are built for, and heads and an indexer to match:
        # the whole-model check of that backend
        "glm-small": _GLM_SMALL,
        # GLM-5's routing (256 experts, top 8, one group) at glm-small's widths: on CPU, how far
        # bf16 rounding alone moves an MoE model's greedy tokens (routing near-ties flip), for
        # bench/probes/model_parity.py --ref-dtype float32
        "glm-route": replace(
            _GLM_SMALL,
            vocab_size=8192,
            hidden_size=512,
            num_layers=2,
            n_routed_experts=256,
            num_experts_per_tok=8,
            n_group=1,
            index_topk=512,
        ),
        "glm5-reduced": GlmMoeDsaPreset(  # GLM-5 per-layer shapes, 1 dense + 3 MoE layers + MTP
            vocab_size=154880,
            hidden_size=6144,
            num_layers=4,
            num_heads=64,
            q_lora_rank=2048,
            kv_lora_rank=512,
            qk_nope_head_dim=192,
            qk_rope_head_dim=64,
            v_head_dim=256,
            intermediate_size=12288,
            moe_intermediate_size=2048,
            n_routed_experts=256,
            n_shared_experts=1,
            num_experts_per_tok=8,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            first_k_dense_replace=1,
            index_n_heads=32,
            index_head_dim=128,
            index_topk=2048,
            indexer_pattern="F",
            max_position_embeddings=202752,
            rope_theta=1000000.0,
        ),
    }
)

DEFAULT_PRESET_OF_ARCH = MappingProxyType(
    {"llama": "tiny", "qwen2": "qwen2-tiny", "qwen3": "qwen3-tiny", "glm_moe_dsa": "glm-tiny"}
)


def with_experts(preset: Preset, experts: int | None) -> Preset:
    """`preset` with `experts` routed experts per MoE layer (None: its own count), every other
    dimension kept: a checkpoint of a MoE model's layer shapes at a size one disk holds."""
    if experts is None:
        return preset
    if not isinstance(preset, GlmMoeDsaPreset):
        raise BadRequest(f"--experts applies to glm_moe_dsa presets, not {preset.model_type}")
    if experts < preset.num_experts_per_tok or experts % preset.n_group:
        raise BadRequest(
            f"experts must be at least num_experts_per_tok ({preset.num_experts_per_tok}) and "
            f"a multiple of n_group ({preset.n_group}), got {experts}"
        )
    return replace(preset, n_routed_experts=experts)


def list_presets() -> list[str]:
    """Preset names, in table order."""
    return list(PRESETS)


def list_archs() -> list[str]:
    """Architectures (`model_type` values) that some preset has."""
    return list(DEFAULT_PRESET_OF_ARCH)


def get_preset(name: str) -> Preset:
    """The preset called `name`; `BadRequest` naming the known presets otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise BadRequest(f"unknown preset {name!r} (known: {', '.join(PRESETS)})") from None
