"""GLM-5's sigmoid-routed MoE (its dense layers and shared experts are `mlp.SwiGLUMLP`).

The router is DeepSeek-V3's `noaux_tc`, in float32 as Hugging Face runs it
(`Backend.route`; the reference is `torch_ref.noaux_tc_route`): sigmoid scores plus
`e_score_correction_bias` choose the experts (the best `topk_group` of `n_group` groups, each
group ranked by its two best experts), while the weights are the unbiased sigmoid scores,
renormalised (`norm_topk_prob`) and scaled by `routed_scaling_factor`.

Routed experts are stacked per layer into `experts.{gate,up,down}` `[E_local, ...]` parameters
(plus `*_scale_inv` when FP8); only this ep rank's experts (`local_expert_range`) exist, and
the checkpoint's `experts.{e}.{gate,up,down}_proj` fill row `e - first_local_expert`.
"""

from __future__ import annotations

import torch
from torch import nn

from snapfn.handler.llm.kernels.base import ExpertWeights
from snapfn.handler.llm.models.base import CausalLM
from snapfn.handler.llm.models.expert_exchange import Exchange
from snapfn.handler.llm.models.layers import is_quantized
from snapfn.handler.llm.models.mlp import SwiGLUMLP
from snapfn.handler.llm.models.tensor_parallel import all_reduce_tp
from snapfn.handler.llm.weights.quant import FP8_DTYPE, scale_shape

EXPERT_PROJS = ("gate", "up", "down")


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class TopkRouter(nn.Module):
    """Group-limited top-k over sigmoid scores; float32 weights, as in the checkpoints."""

    def __init__(self, model: CausalLM) -> None:
        super().__init__()
        moe, device = model.config.moe, model.device
        self.moe = moe
        self.backend = model.backend
        self.weight = _empty(
            (moe.n_routed_experts, model.config.hidden_size), torch.float32, device
        )
        self.e_score_correction_bias = _empty((moe.n_routed_experts,), torch.float32, device)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`x [T, H]` -> (global expert ids `[T, k]`, float32 weights `[T, k]`)."""
        logits = self.backend.linear(x, self.weight)  # [T, E] float32 (a float32 W)
        return self.backend.route(logits, self.e_score_correction_bias, self.moe)


class StackedExperts(nn.Module):
    """This rank's routed experts (`experts`, global ids): `gate`/`up` `[E_local, I, H]`,
    `down` `[E_local, H, I]`."""

    def __init__(self, model: CausalLM, prefix: str, experts: range) -> None:
        super().__init__()
        cfg, par = model.config, model.parallel
        self.experts = experts
        # ep > 1 owns whole experts; ep == 1 splits every expert across tp like a dense MLP
        inter = cfg.moe.moe_intermediate_size // (1 if par.ep_size > 1 else par.tp_size)
        shapes = {
            "gate": (inter, cfg.hidden_size),
            "up": (inter, cfg.hidden_size),
            "down": (cfg.hidden_size, inter),
        }
        num_local = len(self.experts)
        for proj, shape in shapes.items():
            fp8 = is_quantized(f"{prefix}.{self.experts.start}.{proj}_proj", cfg.quant)
            weight_dtype = FP8_DTYPE if fp8 else model.dtype
            self.register_parameter(proj, _empty((num_local, *shape), weight_dtype, model.device))
            scale = (
                _empty((num_local, *scale_shape(shape)), torch.float32, model.device)
                if fp8
                else None
            )
            self.register_parameter(f"{proj}_scale_inv", scale)

    def weights(self) -> ExpertWeights:
        return ExpertWeights(
            gate=self.gate,
            up=self.up,
            down=self.down,
            gate_scale_inv=self.gate_scale_inv,
            up_scale_inv=self.up_scale_inv,
            down_scale_inv=self.down_scale_inv,
            first_expert=self.experts.start,
        )


class MoE(nn.Module):
    """Routed experts (through `backend.moe`) plus the always-on shared experts. With ep > 1
    the routed experts are spread over the ep ranks and `exchange` (`expert_exchange.py`)
    brings each token's share from the ranks that hold its experts (one exchange for all of a
    model's MoE layers: DeepEP's buffer is the model's)."""

    def __init__(
        self, model: CausalLM, prefix: str, experts: range, exchange: Exchange | None
    ) -> None:
        super().__init__()
        moe = model.config.moe
        self.backend = model.backend
        self.gate = TopkRouter(model)
        self.experts = StackedExperts(model, f"{prefix}.experts", experts)
        self.exchange = exchange
        self.parallel = model.parallel
        if moe.n_shared_experts:
            shared_size = moe.moe_intermediate_size * moe.n_shared_experts
            self.shared_experts = SwiGLUMLP(model, f"{prefix}.shared_experts", shared_size)

    def routed(self, x, topk_ids, topk_weights) -> torch.Tensor:
        """This rank's experts applied to `x [T, H]`: each row's weighted sum over those of its
        experts that live here."""
        return self.backend.moe(x, self.experts.weights(), topk_ids, topk_weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_ids, topk_weights = self.gate(x)
        if self.exchange is None:  # at tp > 1 each expert's intermediate columns: partial sums
            out = all_reduce_tp(self.routed(x, topk_ids, topk_weights), self.parallel)
        else:  # the shared experts, which every rank holds whole, are added once, after
            out = self.exchange(x, topk_ids, topk_weights, self.routed)
        if hasattr(self, "shared_experts"):
            out = out + self.shared_experts(x)
        return out

    def idle(self, like: torch.Tensor) -> None:
        """Take part in this layer's exchange with no tokens: a lock-step rank with nothing
        to run (`CausalLM.idle_forward`). `like`: a tensor of the hidden states' dtype and device."""
        k = self.gate.moe.num_experts_per_tok
        x = like.new_zeros((0, like.shape[-1]))
        ids = torch.zeros((0, k), dtype=torch.int64, device=like.device)
        self.exchange(x, ids, ids.float(), self.routed)
