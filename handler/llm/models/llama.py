"""Llama family: Llama 3, Qwen2 (q/k/v bias), Qwen3 (per-head q/k RMSNorm); GQA, RoPE, SwiGLU.

Parameter names equal the Hugging Face checkpoint names (`model.layers.{i}.self_attn.o_proj…`),
except two fused projections, each filled from the checkpoint's parts (`CausalLM.fused_linear`):
`self_attn.qkv_proj` (q_proj | k_proj | v_proj) and `mlp.gate_up_proj` (gate_proj | up_proj): one
GEMM each where a decode step would run three and two small ones. The residual stream is kept
apart from the layers' outputs so that each residual add runs inside the next norm, and the norm
inside the projection after it (`RMSNorm.add_linear`: `Backend.add_norm_linear`, one kernel for
a decode step's row on the triton backend, SwiGLU's activation included for gate | up).
"""

from __future__ import annotations

import torch
from torch import nn

from snapfn.handler.llm.engine.batch import ForwardBatch
from snapfn.handler.llm.engine.kv_pool import KVBufferSpec, KVPool
from snapfn.handler.llm.models.base import CausalLM
from snapfn.handler.llm.models.layers import Rotary
from snapfn.handler.llm.models.mlp import SwiGLUMLP
from snapfn.handler.llm.weights.sharding import local_kv_heads, validate_head_split


class LlamaAttention(nn.Module):
    def __init__(self, model: LlamaForCausalLM, prefix: str, layer_id: int) -> None:
        super().__init__()
        cfg, par = model.config, model.parallel
        validate_head_split(cfg.num_heads, cfg.num_kv_heads, par)
        self.layer_id = layer_id
        self.num_heads = cfg.num_heads // par.tp_size
        self.num_kv_heads = local_kv_heads(cfg.num_kv_heads, par)
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.backend = model.backend
        hd, bias = cfg.head_dim, cfg.attention_bias
        self.rows = [self.num_heads * hd, self.num_kv_heads * hd, self.num_kv_heads * hd]
        parts = list(zip(("q_proj", "k_proj", "v_proj"), self.rows, strict=True))
        self.qkv_proj = model.fused_linear(prefix, "qkv_proj", parts, cfg.hidden_size, bias)
        self.o_proj = model.row_linear(
            f"{prefix}.o_proj", self.num_heads * hd, cfg.hidden_size, cfg.o_proj_bias
        )
        if cfg.qk_norm:
            self.q_norm = model.norm(hd)
            self.k_norm = model.norm(hd)

    def forward(self, h, residual, norm, cos, sin, rotary: Rotary, batch: ForwardBatch, kv: KVPool):
        """`norm` of `h + residual` projected to q | k | v, attended, projected out: returns
        `(out, h + residual)`."""
        qkv, residual = norm.add_linear(h, residual, self.qkv_proj)
        t = qkv.shape[0]
        q, k, v = qkv.split(self.rows, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        k_cache, v_cache = kv.layer("k", self.layer_id), kv.layer("v", self.layer_id)
        q = self.backend.rope_store_kv(
            q, k, v, cos, sin, rotary.interleaved, k_cache, v_cache, batch
        )
        out = self.backend.paged_attention(q, k_cache, v_cache, batch, self.scale)
        return self.o_proj(out.reshape(t, -1)), residual


class LlamaDecoderLayer(nn.Module):
    def __init__(self, model: LlamaForCausalLM, layer_id: int) -> None:
        super().__init__()
        prefix = f"model.layers.{layer_id}"
        self.input_layernorm = model.norm(model.config.hidden_size)
        self.self_attn = LlamaAttention(model, f"{prefix}.self_attn", layer_id)
        self.post_attention_layernorm = model.norm(model.config.hidden_size)
        self.mlp = SwiGLUMLP(model, f"{prefix}.mlp", model.config.intermediate_size)

    def forward(self, h, residual, cos, sin, rotary, batch, kv):
        """`h`: the last layer's output, not yet added to `residual` (None before the first
        layer, where `h` is the embedding). Returns this layer's output and the residual."""
        h, residual = self.self_attn(h, residual, self.input_layernorm, cos, sin, rotary, batch, kv)
        return self.mlp.norm_forward(h, residual, self.post_attention_layernorm)


class LlamaModel(nn.Module):
    def __init__(self, model: LlamaForCausalLM) -> None:
        super().__init__()
        cfg = model.config
        self.embed_tokens = model.embedding()
        self.layers = nn.ModuleList(LlamaDecoderLayer(model, i) for i in range(cfg.num_layers))
        self.norm = model.norm(cfg.hidden_size)


class LlamaForCausalLM(CausalLM):
    not_loaded = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)

    def __init__(self, config, backend, *, dtype, device, parallel=None) -> None:
        super().__init__(config, backend, dtype=dtype, device=device, parallel=parallel)
        self.rotary = Rotary(config.rope, config.head_dim, config.max_position_embeddings, device)
        self.model = LlamaModel(self)
        self.add_lm_head()

    def kv_buffer_specs(self) -> list[KVBufferSpec]:
        cfg = self.config
        shape = (local_kv_heads(cfg.num_kv_heads, self.parallel), cfg.head_dim)
        return [KVBufferSpec("k", cfg.num_layers, shape), KVBufferSpec("v", cfg.num_layers, shape)]

    def forward(self, batch: ForwardBatch, kv: KVPool) -> torch.Tensor:
        h = self.embed(batch.input_ids)
        cos, sin = self.rotary.cos_sin(batch.positions, h.dtype)
        residual = None
        for layer in self.model.layers:
            h, residual = layer(h, residual, cos, sin, self.rotary, batch, kv)
        return self.final_logits(h, batch, residual)
