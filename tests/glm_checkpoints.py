"""Tiny random GLM-5 (`glm_moe_dsa`) checkpoints for the parity tests: fp32, FP8 and with MTP.

Hugging Face initialises weights at std 0.02 and the router bias at zero, which leaves
attention near uniform and routing near arbitrary; `randomize_` gives every tensor a scale at
which a wrong op order, a lost bias or a wrong top-k would show in the logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from snapfn.handler.llm.weights.quant import dequantize_fp8_block, quantize_fp8_block

TINY_GLM = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
    q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
    n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
    routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
    index_topk=5, index_head_dim=32, index_n_heads=8, indexer_types=["full", "shared", "full", "shared"],
    max_position_embeddings=512, eos_token_id=None, bos_token_id=None, dtype="float32",
)  # fmt: skip
NOT_QUANTIZED = ("lm_head", "mlp.gate", "indexer.weights_proj")
WEIGHTS = "model.safetensors"


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Unit-scale activations: weights ~ N(0, fan_in^-1), norms ~ 1 ± 0.1, biases ~ N(0, 0.1)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g)
        if p.numel() == 0:  # a module of size 0 (n_shared_experts=0)
            continue
        if name.endswith("embed_tokens.weight"):
            p.copy_(noise)
        elif p.ndim == 1:
            p.copy_(noise * 0.1 + (0.0 if name.endswith("bias") else 1.0))
        else:
            p.copy_(noise * p.shape[-1] ** -0.5)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # HF inits it to zeros
            b.copy_(torch.randn(b.shape, generator=g) * 0.2)


def save_tiny_glm(path: Path, seed: int = 0, **overrides) -> Path:
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    torch.manual_seed(seed)
    model = GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**{**TINY_GLM, **overrides})).eval()
    randomize_(model, seed)
    model.save_pretrained(path, safe_serialization=True)
    return path


def _is_quantized(name: str, tensor: torch.Tensor, not_quantized: tuple[str, ...]) -> bool:
    module = name.removesuffix(".weight")
    if tensor.ndim != 2 or not name.endswith(".weight") or "embed_tokens" in name:
        return False
    return not any(module == p or module.endswith(f".{p}") for p in not_quantized)


def write_fp8_pair(
    src: Path, fp8_dir: Path, dequant_dir: Path, not_quantized: tuple[str, ...] = NOT_QUANTIZED
) -> tuple[Path, Path]:
    """An FP8 copy of `src` (the modules `not_quantized` names kept as they were) and an fp32
    copy holding exactly its dequantized weights."""
    tensors = load_file(src / WEIGHTS)
    fp8, dequant = {}, {}
    for name, t in tensors.items():
        if not _is_quantized(name, t, not_quantized):
            fp8[name] = dequant[name] = t
            continue
        q, scale_inv = quantize_fp8_block(t)
        fp8[name], fp8[f"{name}_scale_inv"] = q, scale_inv
        dequant[name] = dequantize_fp8_block(q, scale_inv, torch.float32)
    config = json.loads((src / "config.json").read_text())
    _write(dequant_dir, dequant, config)
    config["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [128, 128], "modules_to_not_convert": list(not_quantized),
    }  # fmt: skip
    _write(fp8_dir, fp8, config)
    return fp8_dir, dequant_dir


def mtp_tensors(
    tensors: dict[str, torch.Tensor], num_layers: int, seed: int
) -> dict[str, torch.Tensor]:
    """An MTP layer at index `num_layers`: layer 2's tensors (full indexer, MoE) re-drawn, plus
    `eh_proj`, `enorm`, `hnorm`, `shared_head.norm` and copies of the embedding and head."""
    g = torch.Generator().manual_seed(seed)
    src, dst = "model.layers.2.", f"model.layers.{num_layers}."
    out = {
        dst + n.removeprefix(src): torch.randn(t.shape, generator=g) * t.std()
        for n, t in tensors.items()
        if n.startswith(src)
    }
    hidden = tensors["model.norm.weight"].shape[0]
    out[dst + "eh_proj.weight"] = (
        torch.randn(hidden, 2 * hidden, generator=g) * (2 * hidden) ** -0.5
    )
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        out[f"{dst}{norm}.weight"] = 1 + 0.1 * torch.randn(hidden, generator=g)
    out[dst + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    out[dst + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    return out  # fmt: skip


def write_with_mtp(src: Path, dst: Path, drop: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Copy `src` adding one MTP layer (minus the tensors in `drop`); returns the MTP tensors."""
    tensors = load_file(src / WEIGHTS)
    config = json.loads((src / "config.json").read_text())
    extra = mtp_tensors(tensors, config["num_hidden_layers"], seed=7)
    config["num_nextn_predict_layers"] = 1
    _write(dst, {**tensors, **{n: t for n, t in extra.items() if n not in drop}}, config)
    return extra


def _write(path: Path, tensors: dict[str, torch.Tensor], config: dict) -> None:
    path.mkdir(parents=True, exist_ok=True)
    save_file(
        {n: t.contiguous() for n, t in tensors.items()}, path / WEIGHTS, metadata={"format": "pt"}
    )
    (path / "config.json").write_text(json.dumps(config, indent=2))
