"""Llama family: Llama 3, Qwen2 (q/k/v bias), Qwen3 (per-head q/k RMSNorm); GQA, RoPE, SwiGLU.

Parameter names equal the Hugging Face checkpoint names (`model.layers.{i}.self_attn.q_proj…`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..engine.batch import ForwardBatch
from ..engine.kv_pool import KVBufferSpec, KVPool
from .base import CausalLM
from .layers import Rotary


class LlamaAttention(nn.Module):
    def __init__(self, model: LlamaForCausalLM, prefix: str, layer_id: int) -> None:
        super().__init__()
        cfg, par = model.config, model.parallel
        if cfg.num_heads % par.tp_size or cfg.num_kv_heads % par.tp_size:
            raise ValueError(
                f"heads {cfg.num_heads}/{cfg.num_kv_heads} not divisible by tp={par.tp_size}"
            )
        self.layer_id = layer_id
        self.num_heads = cfg.num_heads // par.tp_size
        self.num_kv_heads = cfg.num_kv_heads // par.tp_size
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.backend = model.backend
        hd, bias = cfg.head_dim, cfg.attention_bias
        self.q_proj = model.linear(f"{prefix}.q_proj", cfg.hidden_size, self.num_heads * hd, bias)
        self.k_proj = model.linear(
            f"{prefix}.k_proj", cfg.hidden_size, self.num_kv_heads * hd, bias
        )
        self.v_proj = model.linear(
            f"{prefix}.v_proj", cfg.hidden_size, self.num_kv_heads * hd, bias
        )
        self.o_proj = model.linear(f"{prefix}.o_proj", self.num_heads * hd, cfg.hidden_size)
        if cfg.qk_norm:
            self.q_norm = model.norm(hd)
            self.k_norm = model.norm(hd)

    def forward(self, x, cos, sin, rotary: Rotary, batch: ForwardBatch, kv: KVPool):
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary.apply(q, cos, sin), rotary.apply(k, cos, sin)
        k_cache, v_cache = kv.layer("k", self.layer_id), kv.layer("v", self.layer_id)
        self.backend.store_kv(k_cache, k, batch)
        self.backend.store_kv(v_cache, v, batch)
        out = self.backend.paged_attention(q, k_cache, v_cache, batch, self.scale)
        return self.o_proj(out.reshape(t, -1))


class LlamaMLP(nn.Module):
    def __init__(self, model: LlamaForCausalLM, prefix: str) -> None:
        super().__init__()
        cfg, tp = model.config, model.parallel.tp_size
        inter = cfg.intermediate_size // tp
        self.gate_proj = model.linear(f"{prefix}.gate_proj", cfg.hidden_size, inter)
        self.up_proj = model.linear(f"{prefix}.up_proj", cfg.hidden_size, inter)
        self.down_proj = model.linear(f"{prefix}.down_proj", inter, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, model: LlamaForCausalLM, layer_id: int) -> None:
        super().__init__()
        prefix = f"model.layers.{layer_id}"
        self.input_layernorm = model.norm(model.config.hidden_size)
        self.self_attn = LlamaAttention(model, f"{prefix}.self_attn", layer_id)
        self.post_attention_layernorm = model.norm(model.config.hidden_size)
        self.mlp = LlamaMLP(model, f"{prefix}.mlp")

    def forward(self, h, cos, sin, rotary, batch, kv):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, rotary, batch, kv)
        return h + self.mlp(self.post_attention_layernorm(h))


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
        shape = (cfg.num_kv_heads // self.parallel.tp_size, cfg.head_dim)
        return [KVBufferSpec("k", cfg.num_layers, shape), KVBufferSpec("v", cfg.num_layers, shape)]

    def forward(self, batch: ForwardBatch, kv: KVPool) -> torch.Tensor:
        h = F.embedding(batch.input_ids, self.model.embed_tokens.weight)
        cos, sin = self.rotary.cos_sin(batch.positions, h.dtype)
        for layer in self.model.layers:
            h = layer(h, cos, sin, self.rotary, batch, kv)
        return self.final_logits(h, batch)
