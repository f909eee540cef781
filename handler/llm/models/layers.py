"""Building blocks shared by the models: Linear (bf16/fp32 or FP8 block), RMSNorm, RoPE.

Parameters are created empty on the target device and filled by the loader; a parameter the
loader never fills is a coverage error, so uninitialised memory never reaches a forward pass.
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from snapfn.handler.llm.config import QuantConfig, RopeConfig
from snapfn.handler.llm.kernels.base import Backend
from snapfn.handler.llm.kernels.torch_ref import rms_norm, silu_mul
from snapfn.handler.llm.weights.quant import FP8_DTYPE, scale_shape


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def is_quantized(module_name: str, quant: QuantConfig | None) -> bool:
    """Whether the Linear at `module_name` holds FP8 weights under `quant`.

    `lm_head` never does; otherwise a module is excluded when any `modules_to_not_convert`
    entry equals it, is a dotted component run inside it, or matches it as a regex.
    """
    if quant is None or module_name.endswith("lm_head"):
        return False
    for pattern in quant.modules_to_not_convert:
        if pattern == module_name or f".{pattern}." in f".{module_name}.":
            return False
        if re.fullmatch(pattern, module_name):
            return False
    return True


class Linear(nn.Module):
    """`y = x W^T (+ b)` through the backend; W is `dtype` or FP8 with `weight_scale_inv`. A
    float32 module (`dtype=torch.float32`: Hugging Face's `_keep_in_fp32_modules`) computes in
    float32 whatever x's dtype: `Backend.linear` upcasts x for a float32 W, and an FP8 W is
    given x in float32, so that it is dequantized into float32."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        backend: Backend,
        *,
        bias: bool = False,
        fp8: bool = False,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.backend = backend
        self.weight = _param((out_features, in_features), FP8_DTYPE if fp8 else dtype, device)
        self.weight_scale_inv = (
            _param(scale_shape((out_features, in_features)), torch.float32, device) if fp8 else None
        )
        self.bias = _param((out_features,), dtype, device) if bias else None
        self.float32_fp8 = fp8 and dtype == torch.float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.float32_fp8:
            x = x.float()
        return self.backend.linear(x, self.weight, self.bias, self.weight_scale_inv)


class RMSNorm(nn.Module):
    """`rms_norm` with its weight; through `backend.rms_norm` when given one (the model's)."""

    def __init__(
        self,
        dim: int,
        eps: float,
        dtype: torch.dtype,
        device: torch.device | str,
        backend: Backend | None = None,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param((dim,), dtype, device)
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend is None:
            return rms_norm(x, self.weight, self.eps)
        return self.backend.rms_norm(x, self.weight, self.eps)

    def add(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream's step: `h = x + residual`, returned with its norm as
        `(norm(h), h)` (`Backend.add_rms_norm`, one kernel on the triton backend);
        `residual=None` (before the first layer): `(norm(x), x)`."""
        if residual is None:
            return self(x), x
        if self.backend is None:
            total = x + residual
            return self(total), total
        return self.backend.add_rms_norm(x, residual, self.weight, self.eps)

    def add_linear(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        linear: nn.Module,
        swiglu: bool = False,
        float_out: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`add`, then `linear` of the norm, then (`swiglu`) SwiGLU's activation of a fused
        gate | up: `(out, h)`; `float_out`: `out` as float32 (the logits). Through
        `Backend.add_norm_linear`, one kernel for a decode step's one row on the triton
        backend, where `linear` is one `Linear`."""
        if self.backend is not None and isinstance(linear, Linear):
            return self.backend.add_norm_linear(
                x,
                residual,
                self.weight,
                self.eps,
                linear.weight,
                linear.bias,
                linear.weight_scale_inv,
                swiglu,
                float_out,
            )
        normed, h = self.add(x, residual)
        out = linear(normed)
        if swiglu:
            out = silu_mul(out) if self.backend is None else self.backend.silu_mul(out)
        return (out.float() if float_out else out), h


def rope_inv_freq(rope: RopeConfig, dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies `[dim/2]` and the attention scaling factor, per RoPE type."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.rope_type == "llama3":
        return _llama3_scale(inv_freq, rope), 1.0
    if rope.rope_type == "yarn":
        return _yarn(rope, dim, max_positions)
    return inv_freq, 1.0


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    old_ctx = rope.original_max_position_embeddings or 8192
    low_wavelen = old_ctx / rope.low_freq_factor
    high_wavelen = old_ctx / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_ctx / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(rope: RopeConfig, dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    base, factor = rope.theta, rope.factor
    old_ctx = rope.original_max_position_embeddings or max_positions

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rope.attention_factor is not None:
        attention_factor = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        attention_factor = mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim)
    else:
        attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, attention_factor


# the largest cos | sin table `Rotary` keeps (GLM-5: 202752 positions x 32 frequencies x 2 x 2
# bytes, 26 MB; the 8B llama's 131072 x 64: 34 MB); a longer one is computed per step instead
ROPE_TABLE_MAX_BYTES = 64 << 20


class Rotary(nn.Module):
    """A model's RoPE: each step's cos/sin from the inverse frequencies, and its layout
    (`interleaved` or half-split), which the backend's RoPE ops (`rope_store_kv`,
    `rope_part`) apply. The cos/sin of every position below `max_positions` are computed once
    per dtype, at the first step (warmup, before graph capture), by the same float32 ops a step
    would run: a step gathers its rows, two kernels instead of eight (sglang and vLLM keep
    such a cache too). The engine never runs a position at or past `max_positions`."""

    def __init__(
        self,
        rope: RopeConfig,
        dim: int,
        max_positions: int,
        device: torch.device | str,
        interleaved: bool = False,
    ) -> None:
        super().__init__()
        inv_freq, attention_scaling = rope_inv_freq(rope, dim, max_positions)
        self.interleaved = interleaved
        self.max_positions = max_positions
        self.attention_scaling = attention_scaling
        self.inv_freq = inv_freq.to(device)
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor] | None] = {}

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(cos, sin)` `[T, dim/2]` in `dtype` for `positions [T]`."""
        if dtype not in self._tables:
            size = self.max_positions * self.inv_freq.numel() * 2 * dtype.itemsize
            self._tables[dtype] = None  # too long to keep: computed per step
            if size <= ROPE_TABLE_MAX_BYTES:
                every = torch.arange(self.max_positions, device=self.inv_freq.device)
                self._tables[dtype] = self._computed(every, dtype)
        table = self._tables[dtype]
        if table is None:
            return self._computed(positions, dtype)
        return table[0][positions], table[1][positions]

    def _computed(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, dim/2]
        cos = (freqs.cos() * self.attention_scaling).to(dtype)
        sin = (freqs.sin() * self.attention_scaling).to(dtype)
        return cos, sin
