"""GLM-5 (`glm_moe_dsa`): MLA + DSA attention, sigmoid-routed MoE, multi-token-prediction layers.

Parameter names equal the Hugging Face checkpoint names, with two mappings (`map_weight`):
- routed experts are stacked: `model.layers.{i}.mlp.experts.{e}.gate_proj.weight(_scale_inv)`
  fills row `e - first_local_expert` of `model.layers.{i}.mlp.experts.gate(_scale_inv)`;
- MTP layers: `model.layers.{num_layers + j}.X` fills `mtp.{j}.X`. They are always loaded
  and coverage-checked; their `embed_tokens` and `shared_head.head`, when present, are copies
  of the main model's (DeepSeek-V3 shares them) and are not loaded. A checkpoint that holds
  none of a declared MTP layer's tensors (transformers saves GLM without them) is built without
  it (`mtp_layers_held`, `build.as_held`).

KV cache per token: "latent" on every layer (`kv_lora_rank + qk_rope_head_dim`) and "index_k"
(`index_head_dim`) on the "full" indexer layers only, stored densely: full layer `i` uses
`index_k` layer `index_slots[i]`.

The MTP layers run only for speculative decoding (`use_draft_layers`, `engine/speculative.py`);
then they are cached too, after the main layers in both buffers. `draft_forward` runs MTP layer
`j` DeepSeek-V3's way (vLLM's `deepseek_mtp.py`): at position `p` it reads the main model's
hidden state there after the final norm and the embedding of token `p + 1` (zero at position
0, as vLLM's), `eh_proj(enorm(embedding) | hnorm(hidden))` through its decoder layer, and
`lm_head(shared_head.norm(...))` gives the logits of token `p + 2`. A further draft step reads
the layer's own output (before `shared_head.norm`) as its hidden state.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from snapfn.handler.llm.config import ModelConfig
from snapfn.handler.llm.engine.batch import ForwardBatch
from snapfn.handler.llm.engine.kv_pool import KVBufferSpec, KVPool
from snapfn.handler.llm.models.base import CausalLM, WeightTarget
from snapfn.handler.llm.models.expert_exchange import make_exchange
from snapfn.handler.llm.models.layers import Rotary
from snapfn.handler.llm.models.mla import MLAttention
from snapfn.handler.llm.models.mlp import SwiGLUMLP
from snapfn.handler.llm.models.moe import MoE
from snapfn.handler.llm.models.tensor_parallel import gather_vocab
from snapfn.handler.llm.weights.sharding import local_expert_range
from snapfn.snapshot.errors import UnsupportedModel

EXPERT_WEIGHT = re.compile(
    r"(?P<prefix>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\.weight(?P<scale>_scale_inv)?"
)
FUSED_EXPERTS = re.compile(r".+\.mlp\.experts\.(gate_up_proj|down_proj)(_scale_inv)?")
LAYER_PREFIX = re.compile(r"model\.layers\.(\d+)\.")
MTP_SHARED_COPIES = r"model\.layers\.\d+\.(embed_tokens|shared_head\.head)\.weight"
MTP_PARAMETER = re.compile(r"mtp\.(\d+)\.")


def mtp_layers_held(config: ModelConfig, names: Iterable[str]) -> int:
    """How many of the MTP layers config.json declares are held, counted from the first:
    `names` are a checkpoint's tensors (`model.layers.{num_layers + j}.…`) or a restore
    layout's parameters (`mtp.{j}.…`). transformers saves a GLM without them, whatever
    `num_nextn_predict_layers` says; the model is then built without them."""
    held = set()
    for name in names:
        match = MTP_PARAMETER.match(param_name(name, config.num_layers))
        if match is not None:
            held.add(int(match[1]))
    count = 0
    while count < config.num_mtp_layers and count in held:
        count += 1
    return count


def index_slots(indexer_types: tuple[str, ...]) -> tuple[int | None, ...]:
    """Per layer, its "index_k" cache layer: full layers numbered in order, None for shared."""
    slots, num_full = [], 0
    for kind in indexer_types:
        slots.append(num_full if kind == "full" else None)
        num_full += kind == "full"
    return tuple(slots)


class GlmDecoderLayer(nn.Module):
    def __init__(
        self, model: GlmMoeDsaForCausalLM, layer_id: int, index_slot: int | None, dense: bool
    ) -> None:
        super().__init__()
        cfg, prefix = model.config, f"model.layers.{layer_id}"
        self.input_layernorm = model.norm(cfg.hidden_size)
        self.self_attn = MLAttention(model, f"{prefix}.self_attn", layer_id, index_slot)
        self.post_attention_layernorm = model.norm(cfg.hidden_size)
        self.mlp = (
            SwiGLUMLP(model, f"{prefix}.mlp", cfg.intermediate_size)
            if dense
            else MoE(model, f"{prefix}.mlp", model.local_experts, model.exchange)
        )

    def forward(self, h, residual, cos, sin, rotary, batch, kv, prev_topk):
        """`h [T, H]`: the last layer's output, not yet added to `residual` (None before the
        first layer, where `h` is the embedding). Returns (this layer's output, the residual,
        this step's top-k `[T, index_topk]` for shared layers)."""
        x, residual = self.input_layernorm.add(h, residual)
        attn, topk = self.self_attn(x, cos, sin, rotary, batch, kv, prev_topk)
        if isinstance(self.mlp, SwiGLUMLP):  # the norm runs inside gate | up's GEMV
            out, residual = self.mlp.norm_forward(attn, residual, self.post_attention_layernorm)
            return out, residual, topk
        x, residual = self.post_attention_layernorm.add(attn, residual)
        return self.mlp(x), residual, topk


class SharedHead(nn.Module):
    def __init__(self, model: GlmMoeDsaForCausalLM) -> None:
        super().__init__()
        self.norm = model.norm(model.config.hidden_size)


class MTPLayer(GlmDecoderLayer):
    """MTP layer `j`: an MoE decoder layer with a full indexer, fed `eh_proj(enorm(embedding)
    | hnorm(hidden))`. Its cache layers follow the main layers' (allocated only when the model
    runs its MTP layers: `GlmMoeDsaForCausalLM.use_draft_layers`)."""

    def __init__(self, model: GlmMoeDsaForCausalLM, j: int) -> None:
        cfg = model.config
        layer_id, num_full = cfg.num_layers + j, sum(s is not None for s in model.index_slots)
        super().__init__(model, layer_id, index_slot=num_full + j, dense=False)
        h = cfg.hidden_size
        self.eh_proj = model.linear(f"model.layers.{layer_id}.eh_proj", 2 * h, h)
        self.enorm = model.norm(h)
        self.hnorm = model.norm(h)
        self.shared_head = SharedHead(model)


class GlmModel(nn.Module):
    def __init__(self, model: GlmMoeDsaForCausalLM) -> None:
        super().__init__()
        cfg = model.config
        self.embed_tokens = model.embedding()
        first_moe = cfg.moe.first_k_dense_replace
        self.layers = nn.ModuleList(
            GlmDecoderLayer(model, i, model.index_slots[i], dense=i < first_moe)
            for i in range(cfg.num_layers)
        )
        self.norm = model.norm(cfg.hidden_size)


class GlmMoeDsaForCausalLM(CausalLM):
    def __init__(self, config, backend, *, dtype, device, parallel=None) -> None:
        super().__init__(config, backend, dtype=dtype, device=device, parallel=parallel)
        mla = config.mla
        self.local_experts = local_expert_range(config.moe.n_routed_experts, self.parallel)
        # how tokens meet other ep ranks' experts, shared by the MoE layers; None at ep 1
        self.exchange = make_exchange(self.parallel, config.moe.n_routed_experts)
        self.index_slots = index_slots(config.dsa.indexer_types)
        self.rotary = Rotary(
            config.rope,
            mla.qk_rope_head_dim,
            config.max_position_embeddings,
            device,
            interleaved=True,
        )
        self.model = GlmModel(self)
        self.mtp = nn.ModuleList(MTPLayer(self, j) for j in range(config.num_mtp_layers))
        self.not_loaded = (MTP_SHARED_COPIES,) if config.num_mtp_layers else ()
        self.add_lm_head()
        self.lockstep = getattr(self.exchange, "lockstep", False)

    def use_draft_layers(self) -> None:
        declared = int(self.config.raw.get("num_nextn_predict_layers") or 0)
        if not self.config.num_mtp_layers and declared:
            raise UnsupportedModel(
                "speculative decoding drafts with the model's MTP layers, and this checkpoint "
                f"declares {declared} (num_nextn_predict_layers) but holds none of their weights "
                "(transformers saves GLM without them): set SNAPFN_SPECULATIVE_TOKENS=0"
            )
        if not self.config.num_mtp_layers:
            super().use_draft_layers()  # refused: nothing to draft with
        self.num_draft_layers = self.config.num_mtp_layers

    def kv_buffer_specs(self) -> list[KVBufferSpec]:
        cfg, drafts = self.config, self.num_draft_layers
        num_full = sum(s is not None for s in self.index_slots)
        latent_dim = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
        return [
            KVBufferSpec("latent", cfg.num_layers + drafts, (latent_dim,)),
            KVBufferSpec("index_k", num_full + drafts, (cfg.dsa.index_head_dim,)),
        ]

    def forward(self, batch: ForwardBatch, kv: KVPool) -> torch.Tensor:
        h, residual = self._decode_layers(batch, kv)
        return self.final_logits(h, batch, residual)

    def forward_hidden(self, batch: ForwardBatch, kv: KVPool) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`'s logits (the same) and the hidden states `[T, H]` after the final norm,
        which the MTP layer reads."""
        h, residual = self._decode_layers(batch, kv)
        hidden, total = self.model.norm.add(h, residual)
        return self.final_logits(total, batch), hidden

    def draft_forward(
        self, batch: ForwardBatch, kv: KVPool, hidden: torch.Tensor, layer: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP layer `layer` over `batch`, whose token at position `p` is token `p + 1`, with
        `hidden [T, H]` the state at `p` (see the module docstring) -> (logits of token `p + 2`
        at `batch.logits_indices`, the layer's output `[T, H]` a next draft step reads)."""
        mtp = self.mtp[layer]
        emb = self.embed(batch.input_ids)  # [T, H]
        emb = emb.masked_fill(batch.positions.eq(0)[:, None], 0.0)
        x = mtp.eh_proj(torch.cat([mtp.enorm(emb), mtp.hnorm(hidden)], dim=-1))
        cos, sin = self.rotary.cos_sin(batch.positions, x.dtype)
        out, residual, _ = mtp(x, None, cos, sin, self.rotary, batch, kv, None)
        h = out + residual
        keep = h if batch.all_logits else h[batch.logits_indices]
        if self.config.tie_word_embeddings:
            logits = F.linear(mtp.shared_head.norm(keep), self.model.embed_tokens.weight).float()
        else:
            logits = mtp.shared_head.norm.add_linear(keep, None, self.lm_head, float_out=True)[0]
        return gather_vocab(logits, self.parallel, self.config.vocab_size), h

    def _decode_layers(self, batch: ForwardBatch, kv: KVPool) -> tuple[torch.Tensor, torch.Tensor]:
        """The main layers over `batch`: the last one's output and the residual, not yet added."""
        h = self.embed(batch.input_ids)  # [T, H]
        cos, sin = self.rotary.cos_sin(batch.positions, h.dtype)  # [T, Dr/2]
        topk = None  # the last full indexer layer's selection, reused by shared layers
        residual = None  # kept apart so that each residual add runs inside the next norm
        for layer in self.model.layers:
            h, residual, topk = layer(h, residual, cos, sin, self.rotary, batch, kv, topk)
        return h, residual

    def idle_forward(self) -> None:
        like = self.model.embed_tokens.weight
        for moe in self._moe_layers():
            moe.idle(like)

    def _moe_layers(self) -> list[MoE]:
        """The MoE blocks a forward runs, in its order (not the MTP layers')."""
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, MoE)]

    def map_weight(self, name: str) -> WeightTarget | None:
        expert = EXPERT_WEIGHT.fullmatch(self.param_name(name))
        if expert is None:
            if FUSED_EXPERTS.fullmatch(name):
                raise UnsupportedModel(
                    f"{name}: experts saved fused, all in one tensor (transformers' "
                    "save_pretrained(save_original_format=False)); snapfn reads them one "
                    "tensor an expert: save with save_original_format=True (the default)"
                )
            return super().map_weight(name)
        param = f"{expert['prefix']}.{expert['proj']}{expert['scale'] or ''}"
        index = int(expert["expert"])
        if param not in self._param_names() or index >= self.config.moe.n_routed_experts:
            return None
        # NOTE: another ep rank's expert gets an out-of-range row here; the loader drops it
        # (`shard_tensor` returns None) before it touches the target.
        return WeightTarget(param, index - self.local_experts.start)

    def param_name(self, name: str) -> str:
        """The parameter checkpoint tensor `name` fills (module-level `param_name`)."""
        return param_name(name, self.config.num_layers)


def param_name(name: str, num_layers: int) -> str:
    """`model.layers.{num_layers + j}.X` -> `mtp.{j}.X`; other names unchanged."""
    match = LAYER_PREFIX.match(name)
    if match is None or int(match[1]) < num_layers:
        return name
    return f"mtp.{int(match[1]) - num_layers}.{name[match.end() :]}"
