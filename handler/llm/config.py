"""Model configuration read from a Hugging Face `config.json`, frozen once built.

`ModelConfig.from_hf(dict)` accepts what transformers 4.x and 5.x write: `rope_theta` +
`rope_scaling` (4.x) or `rope_parameters` (5.x). Anything we do not implement — an unknown
`model_type`, a RoPE type, a quantization method — is refused with an `UnsupportedModel` error
that names the field, never silently ignored. A sliding attention window (Mistral's
`sliding_window`, Qwen's `use_sliding_window`) is kept as `sliding_window`, and the engine serves
at most that many tokens of context: within it, windowed attention is full causal attention
(transformers masks only keys `sliding_window` or more positions back), so the outputs are the
checkpoint's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from snapfn.snapshot.errors import CheckpointError, UnsupportedModel

LLAMA_FAMILY = {"llama": "llama", "qwen2": "llama", "qwen3": "llama", "mistral": "llama"}
ARCH_OF_MODEL_TYPE = {**LLAMA_FAMILY, "glm_moe_dsa": "glm_moe_dsa"}
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "yarn")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RopeConfig:
    """RoPE parameters, normalised from `rope_scaling`/`rope_theta` or `rope_parameters`."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0  # 0 = unset (transformers: None)
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None  # yarn's cos/sin scale; None: from factor and mscale
    truncate: bool = True  # yarn: round the correction range's ends outwards


@dataclass(frozen=True)
class QuantConfig:
    """FP8 block quantization as DeepSeek-V3/GLM-5 checkpoints declare it."""

    method: str = "fp8"
    block_size: tuple[int, int] = (128, 128)
    modules_to_not_convert: tuple[str, ...] = ()


@dataclass(frozen=True)
class MLAConfig:
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class DSAConfig:
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    indexer_types: tuple[str, ...]  # per layer: "full" or "shared"


@dataclass(frozen=True)
class MoEConfig:
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    first_k_dense_replace: int


@dataclass(frozen=True)
class ModelConfig:
    """Everything the engine needs to build a model. Immutable; run-time values live in plans."""

    arch: str  # "llama" | "glm_moe_dsa"
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections' biases
    o_proj_bias: bool = False  # the attention output's (Llama's and Qwen3's attention_bias)
    mlp_bias: bool = False  # gate/up/down biases (Llama's mlp_bias: no other modeling reads it)
    sliding_window: int | None = None  # the context the engine serves is capped at it
    qk_norm: bool = False
    torch_dtype: str = "bfloat16"
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    quant: QuantConfig | None = None
    mla: MLAConfig | None = None
    dsa: DSAConfig | None = None
    moe: MoEConfig | None = None
    num_mtp_layers: int = 0
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.torch_dtype]

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise CheckpointError(
                f"{model_dir}: no config.json (expected a Hugging Face model folder)"
            )
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc
        return cls.from_hf(raw)

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type")
        arch = ARCH_OF_MODEL_TYPE.get(model_type or "")
        if arch is None:
            supported = ", ".join(sorted(ARCH_OF_MODEL_TYPE))
            raise UnsupportedModel(
                f"model_type {model_type!r} is not supported (supported: {supported})"
            )
        _refuse_unsupported_options(raw)
        common = _common_fields(raw, arch)
        if arch == "glm_moe_dsa":
            return cls(**common, **_glm_fields(raw))
        return cls(**common)


def _get(raw: dict[str, Any], key: str, default: Any = None) -> Any:
    value = raw.get(key, default)
    return default if value is None else value


def _sliding_window(raw: dict[str, Any]) -> int | None:
    """The attention window some or all layers use, or None (full attention everywhere), as
    transformers' modeling reads it: Qwen turns it on with `use_sliding_window`; Mistral's
    `sliding_window` is on unless null (its modeling reads no `use_sliding_window`); Llama's
    and GLM's modeling has no window, whatever config.json holds."""
    window = raw.get("sliding_window")
    if raw.get("model_type") in ("qwen2", "qwen3"):
        # transformers: no window without a size, and one only where a layer slides
        on = (
            bool(raw.get("use_sliding_window"))
            and window is not None
            and "sliding_attention" in _qwen_layer_types(raw)
        )
    else:
        on = raw.get("model_type") == "mistral" and window is not None
    if not on:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise UnsupportedModel(
            f"a sliding attention window needs sliding_window to be a positive integer, got "
            f"{window!r}"
        )
    return window


def _qwen_layer_types(raw: dict[str, Any]) -> list[str]:
    """Qwen's per-layer attention kinds: `layer_types` where listed, else (transformers' rule)
    the layers from `max_window_layers` on slide."""
    listed = raw.get("layer_types")
    if isinstance(listed, list):
        return listed
    num_layers = int(raw["num_hidden_layers"])
    first = _get(raw, "max_window_layers", 28)
    if isinstance(first, bool) or not isinstance(first, int):
        raise UnsupportedModel(f"max_window_layers must be an integer, got {first!r:.40}")
    return ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]


def _refuse_unsupported_options(raw: dict[str, Any]) -> None:
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):  # transformers' ACT2FN: "swish" is SiLU
        raise UnsupportedModel(f"hidden_act {act!r} is not supported (only 'silu')")


def _attention_biases(raw: dict[str, Any]) -> dict[str, bool]:
    """Which attention projections carry biases, as transformers' modeling builds them: Qwen2
    always q/k/v (its `attention_bias` is not read), Mistral never (nor read), Llama and Qwen3
    q/k/v/o with `attention_bias`, GLM its latent and output projections with it (`mla.py`)."""
    model_type = raw.get("model_type")
    if model_type == "qwen2":
        return {"attention_bias": True, "o_proj_bias": False}
    if model_type == "mistral":
        return {"attention_bias": False, "o_proj_bias": False}
    bias = bool(_get(raw, "attention_bias", False))
    return {"attention_bias": bias, "o_proj_bias": bias and model_type in ("llama", "qwen3")}


def _common_fields(raw: dict[str, Any], arch: str) -> dict[str, Any]:
    hidden = int(raw["hidden_size"])
    num_heads = int(raw["num_attention_heads"])
    head_dim = _get(raw, "head_dim", hidden // num_heads)
    return dict(
        arch=arch,
        model_type=raw["model_type"],
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(_get(raw, "num_key_value_heads", num_heads)),
        head_dim=int(head_dim),
        rms_norm_eps=float(_get(raw, "rms_norm_eps", 1e-6)),
        rope=parse_rope(raw),
        max_position_embeddings=int(_get(raw, "max_position_embeddings", 4096)),
        tie_word_embeddings=bool(_get(raw, "tie_word_embeddings", False)),
        **_attention_biases(raw),
        mlp_bias=raw.get("model_type") == "llama" and bool(_get(raw, "mlp_bias", False)),
        sliding_window=_sliding_window(raw),
        qk_norm=raw.get("model_type") == "qwen3",
        torch_dtype=_parse_dtype(raw),
        eos_token_ids=_as_ids(raw.get("eos_token_id")),
        bos_token_id=raw.get("bos_token_id"),
        quant=parse_quant(raw.get("quantization_config")),
        raw=raw,
    )


def _glm_fields(raw: dict[str, Any]) -> dict[str, Any]:
    num_layers = int(raw["num_hidden_layers"])
    indexer_types = raw.get("indexer_types") or _indexer_pattern(raw, num_layers)
    if len(indexer_types) != num_layers or set(indexer_types) - {"full", "shared"}:
        raise UnsupportedModel(
            f"indexer_types must list 'full'/'shared' per layer, got {indexer_types}"
        )
    if indexer_types[0] != "full":
        raise UnsupportedModel(
            "indexer_types[0] must be 'full': shared layers reuse a full layer's top-k"
        )
    n_routed = int(raw["n_routed_experts"])
    n_group = int(_get(raw, "n_group", 1))
    if n_routed % n_group:
        raise UnsupportedModel(f"n_routed_experts={n_routed} is not divisible by n_group={n_group}")
    return dict(
        mla=MLAConfig(
            q_lora_rank=int(raw["q_lora_rank"]),
            kv_lora_rank=int(raw["kv_lora_rank"]),
            qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
            qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
            v_head_dim=int(raw["v_head_dim"]),
        ),
        dsa=DSAConfig(
            index_n_heads=int(raw["index_n_heads"]),
            index_head_dim=int(raw["index_head_dim"]),
            index_topk=int(raw["index_topk"]),
            indexer_types=tuple(indexer_types),
        ),
        moe=MoEConfig(
            n_routed_experts=n_routed,
            n_shared_experts=int(_get(raw, "n_shared_experts", 1)),
            num_experts_per_tok=int(raw["num_experts_per_tok"]),
            moe_intermediate_size=int(raw["moe_intermediate_size"]),
            n_group=n_group,
            topk_group=int(_get(raw, "topk_group", 1)),
            routed_scaling_factor=float(_get(raw, "routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(_get(raw, "norm_topk_prob", True)),
            first_k_dense_replace=_dense_layers(raw, num_layers),
        ),
        num_mtp_layers=int(_get(raw, "num_nextn_predict_layers", 0)),
    )


def _indexer_pattern(raw: dict[str, Any], num_layers: int) -> list[str]:
    """GLM's indexer kinds where `indexer_types` is not listed, as transformers derives them:
    `index_topk_pattern` ("FSSF…", or a list), else layer i is full when
    `max(i - index_skip_topk_offset + 1, 0) % index_topk_freq == 0` (defaults 2 and 1: all)."""
    pattern = raw.get("index_topk_pattern")
    if isinstance(pattern, str):
        kinds = {"F": "full", "S": "shared"}
        if set(pattern) - set(kinds):
            raise UnsupportedModel(f"index_topk_pattern must be F/S letters, got {pattern!r:.80}")
        return [kinds[c] for c in pattern]
    if pattern is not None:
        return list(pattern) if isinstance(pattern, list) else [pattern]
    freq, offset = _get(raw, "index_topk_freq", 1), _get(raw, "index_skip_topk_offset", 2)
    if any(isinstance(v, bool) or not isinstance(v, int) for v in (freq, offset)):
        raise UnsupportedModel(
            f"index_topk_freq and index_skip_topk_offset must be integers, got {freq!r:.20}, "
            f"{offset!r:.20}"
        )
    freq = max(freq, 1)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)]


def _dense_layers(raw: dict[str, Any], num_layers: int) -> int:
    """How many leading layers run a dense MLP, the rest MoE: transformers' `mlp_layer_types`
    where config.json lists it (its modeling follows that list, whatever
    `first_k_dense_replace` says), else `first_k_dense_replace`."""
    declared = raw.get("mlp_layer_types")
    if declared is None:
        return min(int(_get(raw, "first_k_dense_replace", 0)), num_layers)
    kinds = list(declared) if isinstance(declared, list) else []
    dense = next((i for i, kind in enumerate(kinds) if kind != "dense"), len(kinds))
    if len(kinds) != num_layers or kinds[dense:] != ["sparse"] * (num_layers - dense):
        raise UnsupportedModel(
            f"mlp_layer_types must list {num_layers} layers, the dense ones first and then "
            f"sparse, got {declared!r}"
        )
    return dense


def parse_rope(raw: dict[str, Any]) -> RopeConfig:
    """Normalise transformers 4.x (`rope_theta`, `rope_scaling`) and 5.x (`rope_parameters`) as
    transformers 5 reads them: `rope_scaling`, where set, is taken whole over `rope_parameters`;
    `rope_theta` from the dict, else the top level; a scaled type's
    `original_max_position_embeddings` from the top level (Phi-3's place), else the dict, else
    `max_position_embeddings`."""
    params = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
    theta = _get(params, "rope_theta", _get(raw, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "dynamic":
        # NOTE: dynamic NTK rescales only past max_position_embeddings, which the engine never
        # serves (Engine.max_model_len); up to there its frequencies are the default ones
        rope_type = "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModel(
            f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)}, dynamic)"
        )
    original = None
    if rope_type in ("llama3", "yarn"):
        original = _get(
            raw,
            "original_max_position_embeddings",
            _get(params, "original_max_position_embeddings", raw.get("max_position_embeddings")),
        )
    factor = params.get("factor")
    if factor is None and rope_type == "yarn" and original:  # DeepSeek-V3's way of saying it
        factor = _get(raw, "max_position_embeddings", original) / original
    attention_factor = params.get("attention_factor")
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(1.0 if factor is None else factor),
        low_freq_factor=float(_get(params, "low_freq_factor", 1.0)),
        high_freq_factor=float(_get(params, "high_freq_factor", 4.0)),
        original_max_position_embeddings=None if original is None else int(original),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=float(params.get("mscale") or 0.0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        attention_factor=None if attention_factor is None else float(attention_factor),
        truncate=bool(params.get("truncate", True)),
    )


def parse_quant(qc: dict[str, Any] | None) -> QuantConfig | None:
    """Accept FP8 128x128 block quantization; refuse every other scheme by name."""
    if not qc:
        return None
    method = qc.get("quant_method")
    if method != "fp8":
        raise UnsupportedModel(
            f"quantization_config.quant_method {method!r} is not supported (only 'fp8')"
        )
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise UnsupportedModel(f"quantization_config.fmt {fmt!r} is not supported (only 'e4m3')")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise UnsupportedModel("quantization_config.activation_scheme must be 'dynamic'")
    block = tuple(qc.get("weight_block_size") or ())
    if block != (128, 128):
        raise UnsupportedModel(
            f"quantization_config.weight_block_size {list(block)} is not supported (only [128, 128])"
        )
    return QuantConfig(
        block_size=(128, 128),
        modules_to_not_convert=tuple(qc.get("modules_to_not_convert") or ()),
    )


def _parse_dtype(raw: dict[str, Any]) -> str:
    name = raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"
    if name not in DTYPES:
        raise UnsupportedModel(f"dtype {name!r} is not supported (supported: {', '.join(DTYPES)})")
    return name


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
