"""FP8 block quantization (DeepSeek-V3 / GLM-5 layout).

Wire format, as in the checkpoints: a weight `W [N, K]` is stored as `float8_e4m3fn` with a
`weight_scale_inv [ceil(N/128), ceil(K/128)]` float32 tensor beside it; the real weight is
`W_fp8[n, k] * weight_scale_inv[n // 128, k // 128]`. Edge blocks are partial.
"""

from __future__ import annotations

import torch

FP8_BLOCK = 128
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def scale_shape(weight_shape: tuple[int, ...], block: int = FP8_BLOCK) -> tuple[int, int]:
    """Shape of `weight_scale_inv` for a 2-D weight of `weight_shape`."""
    n, k = weight_shape[-2:]
    return (-(-n // block), -(-k // block))


def _expand_scale(scale_inv: torch.Tensor, n: int, k: int, block: int) -> torch.Tensor:
    # [nb, kb] -> [n, k], each scale covering its block (edge blocks cut to size)
    return scale_inv.repeat_interleave(block, dim=-2)[..., :n, :].repeat_interleave(block, dim=-1)[
        ..., :k
    ]


def quantize_fp8_block(
    weight: torch.Tensor, block: int = FP8_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `weight [..., N, K]` to (fp8 weight, float32 scale_inv [..., ceil(N/b), ceil(K/b)])."""
    *lead, n, k = weight.shape
    nb, kb = scale_shape((n, k), block)
    w = weight.float()
    padded = torch.zeros(*lead, nb * block, kb * block, dtype=torch.float32, device=w.device)
    padded[..., :n, :k] = w
    blocks = padded.view(*lead, nb, block, kb, block)
    amax = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12)  # [..., nb, kb]
    scale_inv = amax / FP8_MAX
    q = (w / _expand_scale(scale_inv, n, k, block)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale_inv.to(torch.float32)


def dequantize_fp8_block(
    q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype, block: int = FP8_BLOCK
) -> torch.Tensor:
    """Inverse of `quantize_fp8_block`: returns `q * scale_inv` (block-expanded) in `dtype`."""
    n, k = q.shape[-2:]
    expected = scale_shape((n, k), block)
    if tuple(scale_inv.shape[-2:]) != expected:
        raise ValueError(
            f"weight_scale_inv shape {tuple(scale_inv.shape)} does not match fp8 weight "
            f"{tuple(q.shape)}: expected [..., {expected[0]}, {expected[1]}] for {block}x{block} blocks"
        )
    return (q.float() * _expand_scale(scale_inv.float(), n, k, block)).to(dtype)
