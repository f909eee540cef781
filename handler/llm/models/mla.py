"""GLM-5 attention: multi-head latent attention (MLA) with DeepSeek sparse attention (DSA).

MLA caches one latent per token, `kv_a_layernorm(latent) | rope(k_rope)` (`R + Dr` values,
buffer "latent"), and expands it into per-head `k_nope | v` with `kv_b_proj` when attending.
The DSA indexer (on "full" layers) scores every cached key for every query with its own small
heads and keys (buffer "index_k") and keeps the `index_topk` best; attention then sees only
those. "shared" layers reuse the top-k of the last full layer of the same step.

Numerics follow Hugging Face's `modeling_glm_moe_dsa`: both RoPEs are interleaved, the q/kv
latent norms use eps 1e-6 (not `rms_norm_eps`), the indexer key norm is a LayerNorm with bias,
and `weights_proj` runs in float32 (`_keep_in_fp32_modules`).

The projections of the layer's input `x` are one: `fused_qkv_a_proj` stacks `q_a_proj`,
`kv_a_proj_with_mqa` and (on full layers, without biases) the indexer's `wk`
(`CausalLM.fused_linear`, each FP8 part on a 128-row scale block of its own): at batch 1 one
GEMV instead of three short ones (sglang fuses the first two the same way). So are those of
the query latent: `fused_q_b_proj` stacks `q_b_proj` and (on full layers) the indexer's
`wq_b`, neither with a bias in any checkpoint, with `q_a_layernorm` run inside that projection
(`RMSNorm.add_linear`: one GEMV at batch 1 where a norm launch and two GEMVs ran; commit 3489ec1).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from snapfn.handler.llm.config import ModelConfig
from snapfn.handler.llm.engine.batch import ForwardBatch
from snapfn.handler.llm.engine.kv_pool import KVPool
from snapfn.handler.llm.models.base import CausalLM
from snapfn.handler.llm.models.layers import RMSNorm, Rotary

LATENT_NORM_EPS = 1e-6  # HF builds q_a_layernorm/kv_a_layernorm/k_norm with their default eps


def mla_softmax_scale(config: ModelConfig) -> float:
    """`qk_head_dim^-0.5`, times `yarn_get_mscale(factor, mscale_all_dim)^2` when HF applies it."""
    mla, rope = config.mla, config.rope
    scale = (mla.qk_nope_head_dim + mla.qk_rope_head_dim) ** -0.5
    if rope.rope_type != "default" and rope.mscale_all_dim and rope.factor > 1:
        mscale = 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0
        scale *= mscale * mscale
    return scale


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias, filled by the loader (the indexer's `k_norm`)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(
            torch.empty(dim, dtype=dtype, device=device), requires_grad=False
        )
        self.bias = nn.Parameter(torch.empty(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class DSAIndexer(nn.Module):
    """Per-query top-k key selection; writes this layer's indexer keys to `index_k[slot]`.
    The attention's fused projections compute its `wq_b`, and its `wk` where `fused_wk` (else
    this module has `wk`)."""

    def __init__(self, model: CausalLM, prefix: str, slot: int, fused_wk: bool) -> None:
        super().__init__()
        cfg, dsa = model.config, model.config.dsa
        self.slot = slot
        self.num_heads, self.head_dim = dsa.index_n_heads, dsa.index_head_dim
        self.rope_dim = cfg.mla.qk_rope_head_dim
        self.topk = dsa.index_topk
        self.softmax_scale = dsa.index_head_dim**-0.5
        self.backend = model.backend
        if not fused_wk:
            self.wk = model.linear(f"{prefix}.wk", cfg.hidden_size, self.head_dim)
        self.k_norm = LayerNorm(self.head_dim, LATENT_NORM_EPS, model.dtype, model.device)
        self.weights_proj = model.linear(
            f"{prefix}.weights_proj", cfg.hidden_size, self.num_heads, dtype=torch.float32
        )

    def forward(self, x, q_proj, k_proj, cos, sin, rotary: Rotary, batch, kv: KVPool):
        """`x [T, H]`, `q_proj`: `wq_b` of the normed query latent, and `k_proj`: `wk(x)` when
        the attention's fused projection computed it (else None) -> top-k key positions
        `[T, index_topk]` int32."""
        t, rope = x.shape[0], self.backend.rope_part
        if k_proj is None:
            k_proj = self.wk(x)
        # the first rope_dim dims of each query and key rotated: rope(q_rot) | q_pass
        q = q_proj.view(t, self.num_heads, self.head_dim)
        q = rope(q, cos, sin, rotary.interleaved, 0)  # [T, Hi, Di]
        cache, norm = kv.layer("index_k", self.slot), self.k_norm  # rope(k_norm(k)) cached
        self.backend.layer_norm_rope_store(
            cache, k_proj, norm.weight, norm.bias, norm.eps, cos, sin, rotary.interleaved, batch
        )
        weights = self.weights_proj(x) * self.num_heads**-0.5  # [T, Hi] float32: a float32 module
        return self.backend.dsa_topk(q, weights, cache, batch, self.topk, self.softmax_scale)


class MLAttention(nn.Module):
    """MLA + DSA for one layer. `index_slot` is its "index_k" layer; None on shared layers."""

    def __init__(self, model: CausalLM, prefix: str, layer_id: int, index_slot: int | None):
        super().__init__()
        cfg, mla, tp = model.config, model.config.mla, model.parallel.tp_size
        if cfg.num_heads % tp:
            raise ValueError(f"num_attention_heads={cfg.num_heads} not divisible by tp={tp}")
        self.layer_id = layer_id
        self.num_heads = cfg.num_heads // tp
        self.nope_dim, self.rope_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim
        self.kv_rank = mla.kv_lora_rank
        self.scale = mla_softmax_scale(cfg)
        self.backend = model.backend
        qk_dim, bias = self.nope_dim + self.rope_dim, cfg.attention_bias
        latent_dim = self.kv_rank + self.rope_dim
        parts = [("q_a_proj", mla.q_lora_rank), ("kv_a_proj_with_mqa", latent_dim)]
        q_parts = [("q_b_proj", self.num_heads * qk_dim)]
        if index_slot is not None:
            q_parts.append(("indexer.wq_b", cfg.dsa.index_n_heads * cfg.dsa.index_head_dim))
        fused_wk = index_slot is not None and not bias  # wk has no bias to stack
        if fused_wk:
            parts.append(("indexer.wk", cfg.dsa.index_head_dim))
        self.fused_qkv_a_proj = model.fused_linear(
            prefix, "fused_qkv_a_proj", parts, cfg.hidden_size, bias, pad_fp8=True
        )
        self.q_a_layernorm = RMSNorm(
            mla.q_lora_rank, LATENT_NORM_EPS, model.dtype, model.device, model.backend
        )
        self.fused_q_b_proj = model.fused_linear(
            prefix, "fused_q_b_proj", q_parts, mla.q_lora_rank, pad_fp8=True
        )
        self.kv_a_layernorm = RMSNorm(
            self.kv_rank, LATENT_NORM_EPS, model.dtype, model.device, model.backend
        )
        kv_b_out = self.num_heads * (self.nope_dim + mla.v_head_dim)
        self.kv_b_proj = model.linear(f"{prefix}.kv_b_proj", self.kv_rank, kv_b_out)
        self.o_proj = model.row_linear(
            f"{prefix}.o_proj", self.num_heads * mla.v_head_dim, cfg.hidden_size, bias
        )
        if index_slot is not None:
            self.indexer = DSAIndexer(model, f"{prefix}.indexer", index_slot, fused_wk)

    def forward(self, x, cos, sin, rotary: Rotary, batch: ForwardBatch, kv: KVPool, prev_topk):
        """`x [T, H]` -> (output `[T, H]`, top-k `[T, index_topk]` for the next shared layer)."""
        t, proj = x.shape[0], self.fused_qkv_a_proj
        out = proj(x)  # q_a | kv_a (| wk), each at its span
        q_a, kv_a, k_proj = (
            out[..., slice(*proj.part_spans[p])] if p in proj.part_spans else None
            for p in ("q_a_proj", "kv_a_proj_with_mqa", "indexer.wk")
        )
        # q_b | wq_b of the normed query latent (the norm inside the GEMV at batch 1)
        q_all, _ = self.q_a_layernorm.add_linear(q_a, None, self.fused_q_b_proj)
        spans = self.fused_q_b_proj.part_spans
        q = q_all[..., slice(*spans["q_b_proj"])].view(t, self.num_heads, -1)
        q_index = q_all[..., slice(*spans["indexer.wq_b"])] if "indexer.wq_b" in spans else None
        cache = kv.layer("latent", self.layer_id)
        norm = self.kv_a_layernorm  # the latent: norm(c) | rope(k_rope), into the cache
        self.backend.norm_rope_store(
            cache, kv_a, norm.weight, norm.eps, cos, sin, rotary.interleaved, batch
        )
        if hasattr(self, "indexer"):
            topk = self.indexer(x, q_index, k_proj, cos, sin, rotary, batch, kv)
        else:
            assert prev_topk is not None, "config guarantees layer 0 is a full indexer layer"
            topk = prev_topk
        q = self.backend.rope_part(q, cos, sin, rotary.interleaved, self.nope_dim)  # q_nope | rope
        w = self.kv_b_proj
        out = self.backend.mla_attention(
            q, cache, w.weight, w.weight_scale_inv, batch, self.scale, topk
        )
        return self.o_proj(out.reshape(t, -1)), topk
