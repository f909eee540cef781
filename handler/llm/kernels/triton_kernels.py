"""Triton kernels of our own, each matching a torch reference op of the engine.

| kernel | reference (the oracle) |
| --- | --- |
| `rms_norm` | `models.layers.RMSNorm.forward`: float32 statistics, cast back, then times weight |
| `add_rms_norm` | `h = x + residual` (in the input dtype), then `rms_norm(h)`; returns both |
| `dequantize_fp8_block` | `quant.dequantize_fp8_block`: `q.float() * scale_inv[n//128, k//128]` in `dtype` |

NOTE: this module imports triton at import time; only `triton_backend` imports it, lazily,
because `import triton` takes seconds and the package must stay importable without it.
`TRITON_INTERPRET=1` must be set before this module is first imported for the kernels to run
on CPU tensors (triton decides interpreted or compiled when `@triton.jit` runs).

Nothing here is autotuned yet: launch parameters are fixed (see docs/kernels.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant import FP8_BLOCK, FP8_DTYPE, scale_shape


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    sum_ptr,
    weight_ptr,
    out_ptr,
    num_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # one program per row of `[M, num_cols]` contiguous tensors
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    offsets = row * num_cols + cols
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + offsets, mask=mask, other=0.0)
        # rounded to the input dtype, as `x + residual` is in torch
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + offsets, x, mask=mask)
    xf = x.to(tl.float32)
    mean_square = tl.sum(xf * xf, axis=0) / num_cols
    normed = (xf * tl.rsqrt(mean_square + eps)).to(x_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    # the product of two values of <= 16-bit dtypes is exact in float32: one rounding, as torch
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


def _launch_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    _check_device(x, weight, residual)
    num_cols = x.shape[-1]
    if weight.shape != (num_cols,):
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match x [..., {num_cols}]")
    rows = x.reshape(-1, num_cols).contiguous()  # [M, H]
    out = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    total = None
    if residual is not None:
        residual = residual.reshape(-1, num_cols).contiguous()
        total = torch.empty_like(rows)
    _rms_norm_kernel[(rows.shape[0],)](
        rows,
        residual if residual is not None else rows,  # unread without a residual
        total if total is not None else rows,  # unwritten without a residual
        weight.contiguous(),
        out,
        num_cols,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=triton.next_power_of_2(num_cols),
    )
    return out.view(x.shape), None if total is None else total.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of `x [..., H]` with `weight [H]`, as `layers.RMSNorm`."""
    out, _ = _launch_rms_norm(x, None, weight, eps)
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`h = x + residual` then `rms_norm(h)`, in one pass: returns `(rms_norm(h), h)`."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"residual {tuple(residual.shape)} {residual.dtype} does not match "
            f"x {tuple(x.shape)} {x.dtype}"
        )
    out, total = _launch_rms_norm(x, residual, weight, eps)
    assert total is not None
    return out, total


@triton.jit
def _dequant_fp8_block_kernel(
    q_ptr,
    scale_ptr,
    out_ptr,
    n,
    k,
    num_n_blocks,
    num_k_blocks,
    BLOCK: tl.constexpr,
):
    # one program per (matrix, n block, k block) of `[B, n, k]` contiguous weights
    matrix = tl.program_id(0).to(tl.int64)
    n_block = tl.program_id(1)
    k_block = tl.program_id(2)
    rows = n_block * BLOCK + tl.arange(0, BLOCK)
    cols = k_block * BLOCK + tl.arange(0, BLOCK)
    mask = (rows[:, None] < n) & (cols[None, :] < k)  # edge blocks are partial
    offsets = matrix * n * k + rows[:, None].to(tl.int64) * k + cols[None, :]
    q = tl.load(q_ptr + offsets, mask=mask, other=0.0)
    scale = tl.load(scale_ptr + (matrix * num_n_blocks + n_block) * num_k_blocks + k_block)
    out = q.to(tl.float32) * scale.to(tl.float32)
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_fp8_block(
    q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype, block: int = FP8_BLOCK
) -> torch.Tensor:
    """`q [..., N, K]` fp8 e4m3 times its block scales `scale_inv [..., ceil(N/b), ceil(K/b)]`,
    in `dtype`: the same values as `quant.dequantize_fp8_block`."""
    _check_device(q, scale_inv)
    if q.dtype != FP8_DTYPE:
        raise ValueError(f"expected a {FP8_DTYPE} weight, got {q.dtype}")
    n, k = q.shape[-2:]
    nb, kb = scale_shape((n, k), block)
    if tuple(scale_inv.shape) != (*q.shape[:-2], nb, kb):
        raise ValueError(
            f"weight_scale_inv shape {tuple(scale_inv.shape)} does not match fp8 weight "
            f"{tuple(q.shape)}: expected [..., {nb}, {kb}] for {block}x{block} blocks"
        )
    matrices = q.reshape(-1, n, k).contiguous()  # [B, N, K]
    scales = scale_inv.reshape(-1, nb, kb).contiguous()  # [B, nb, kb]
    out = torch.empty(matrices.shape, dtype=dtype, device=q.device)
    if out.numel():
        grid = (matrices.shape[0], nb, kb)
        _dequant_fp8_block_kernel[grid](matrices, scales, out, n, k, nb, kb, BLOCK=block)
    return out.view(q.shape)


def _check_device(*tensors: torch.Tensor | None) -> None:
    """Compiled kernels need CUDA tensors; the interpreter runs on CPU tensors."""
    if triton.knobs.runtime.interpret:
        return
    for t in tensors:
        if t is not None and not t.is_cuda:
            raise ValueError(
                f"triton kernels need CUDA tensors, got one on {t.device} "
                "(set TRITON_INTERPRET=1 before importing triton to run them on CPU)"
            )
