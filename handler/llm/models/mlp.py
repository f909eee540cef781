"""The SwiGLU MLP: llama's, GLM-5's dense layers' and its shared experts'."""

from __future__ import annotations

import torch
from torch import nn

from snapfn.handler.llm.models.base import CausalLM
from snapfn.handler.llm.models.layers import RMSNorm


class SwiGLUMLP(nn.Module):
    """`down(silu(gate(x)) * up(x))`: llama's MLP, GLM-5's dense layers' and its shared experts.
    `gate_proj` and `up_proj` fill one fused `gate_up_proj` (`CausalLM.fused_linear`): one GEMM,
    and after a norm (`norm_forward`) on a decode step one GEMV with the norm before it and
    SwiGLU after it. Biased where the config says so (Llama's `mlp_bias`)."""

    def __init__(self, model: CausalLM, prefix: str, intermediate_size: int) -> None:
        super().__init__()
        hidden, inter = model.config.hidden_size, intermediate_size // model.parallel.tp_size
        parts = [("gate_proj", inter), ("up_proj", inter)]
        bias = model.config.mlp_bias
        self.gate_up_proj = model.fused_linear(prefix, "gate_up_proj", parts, hidden, bias)
        self.down_proj = model.row_linear(f"{prefix}.down_proj", inter, hidden, bias)
        self.backend = model.backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.backend.silu_mul(self.gate_up_proj(x)))

    def norm_forward(
        self, h: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MLP of `norm(h + residual)`: returns `(out, h + residual)`."""
        act, residual = norm.add_linear(h, residual, self.gate_up_proj, swiglu=True)
        return self.down_proj(act), residual
