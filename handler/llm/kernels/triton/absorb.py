"""MLA's absorbed products for a few tokens in Triton, reading `kv_b` as it is stored (FP8
block-scaled, or 16-bit): what `torch_ref.absorb_query` / `expand_output` compute as two
cuBLAS bmms over a dense copy of `kv_b` in q's dtype.

    q_latent = absorb_query(q, kv_b, kv_b_scale_inv, rope)    # [T, H, R]: W_k^T q_nope per head
    out = expand_output(out_latent, kv_b, kv_b_scale_inv, nope)  # [T, H, Dv]: W_v o per head

`kv_b` is `[H * (Dn + Dv), R]`: per head, `W_k` (`Dn` rows) over `W_v` (`Dv` rows), with
128x128 block scales when FP8. On the H200 the two bmms took 24 us of a GLM-5-shaped batch-1
step (two layers, the profile recorded in commit 07522b8), about 2.4 TB/s over the 59 MB bf16 copy; an FP8
`kv_b` is half those bytes. Each program here reads one tile of one head's `W_k` or `W_v` once
at its stored width, dequantizes it in float32 and applies it to every token of the batch in
one tensor-core product (`tl.dot` over a `MAX_TOKENS`-row tile, TF32: a 16-bit q is exact in
it and the dequantized weight keeps 10 bits, where the bmms round `kv_b` to q's dtype; float32
inputs take a float32 dot), summed in float32. Meant for decode batches (`MAX_TOKENS` rows at
most); longer ones keep the bmms.

Measured on the H200 (2026-12-01, `bench/probes/absorb_probe.py`,
bench/results/2026-12-01-h200-steady-glm5-mla-absorb-v1): the first form, a program
per token that re-read its head's tile from L2, was 10.8 us against the bmms' 11.6 at one
token but 42 us against 12.6 at eight; hence the one tile for all tokens.

NOTE: a tile's columns never cross a 128-wide scale block (its width divides 128), so each of
its rows takes one scale. Imports triton at import time, like kernels.py;
`TRITON_INTERPRET=1` before the first import runs it on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from snapfn.handler.llm.kernels.triton.kernels import _check_device, autotuned, tuned_or_fixed
from snapfn.handler.llm.weights.quant import FP8_BLOCK

MAX_TOKENS = 16  # rows the kernels take; longer batches keep the bmms


@triton.jit(do_not_specialize=["tokens"])  # one compile for every batch size
def _absorb_kernel(
    q_ptr,  # [T, H, Dn + Dr]
    w_ptr,  # [H * (Dn + Dv), R]
    s_ptr,  # [rows / 128, R / 128] float32, when SCALED
    out_ptr,  # [T, H, R]
    tokens,
    stride_qt,
    stride_qh,
    stride_w,
    stride_s,
    stride_ot,
    stride_oh,
    NOPE: tl.constexpr,
    HEAD_ROWS: tl.constexpr,  # Dn + Dv
    R: tl.constexpr,
    SCALED: tl.constexpr,
    IEEE: tl.constexpr,  # float32 inputs: a float32 dot, else TF32 (16-bit q is exact in it)
    BLOCK_T: tl.constexpr,  # MAX_TOKENS: every token of the batch in one tile
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,  # divides 128: one scale column
):
    h, rb = tl.program_id(0), tl.program_id(1)
    t = tl.arange(0, BLOCK_T)
    t_ok = t < tokens
    cols = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    col_ok = cols < R
    acc = tl.zeros([BLOCK_T, BLOCK_R], dtype=tl.float32)
    for d0 in tl.static_range(0, NOPE, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        d_ok = d < NOPE
        rows = h * HEAD_ROWS + d
        mask = d_ok[:, None] & col_ok[None, :]
        w = tl.load(w_ptr + rows[:, None] * stride_w + cols[None, :], mask=mask, other=0.0)
        w = w.to(tl.float32)
        if SCALED:
            s_row = s_ptr + (rows // 128) * stride_s + (rb * BLOCK_R) // 128
            s = tl.load(s_row, mask=d_ok, other=0.0)
            w = w * s[:, None]
        x_at = q_ptr + t[:, None] * stride_qt + h * stride_qh + d[None, :]
        x = tl.load(x_at, mask=t_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        if IEEE:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w, input_precision="tf32")
    out = out_ptr + t[:, None] * stride_ot + h * stride_oh + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["tokens"])
def _expand_kernel(
    o_ptr,  # [T, H, R]
    w_ptr,  # [H * (Dn + Dv), R]
    s_ptr,
    out_ptr,  # [T, H, Dv]
    tokens,
    stride_ot,
    stride_oh,
    stride_w,
    stride_s,
    stride_yt,
    stride_yh,
    NOPE: tl.constexpr,
    HEAD_ROWS: tl.constexpr,
    DV: tl.constexpr,
    R: tl.constexpr,
    SCALED: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_R: tl.constexpr,  # divides 128: one scale column
):
    h, vb = tl.program_id(0), tl.program_id(1)
    t = tl.arange(0, BLOCK_T)
    t_ok = t < tokens
    v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = v < DV
    rows = h * HEAD_ROWS + NOPE + v
    acc = tl.zeros([BLOCK_T, BLOCK_V], dtype=tl.float32)
    for r0 in tl.static_range(0, R, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_ok = r < R
        mask = v_ok[:, None] & r_ok[None, :]
        w = tl.load(w_ptr + rows[:, None] * stride_w + r[None, :], mask=mask, other=0.0)
        w = w.to(tl.float32)
        if SCALED:
            s = tl.load(s_ptr + (rows // 128) * stride_s + r0 // 128, mask=v_ok, other=0.0)
            w = w * s[:, None]
        x_at = o_ptr + t[:, None] * stride_ot + h * stride_oh + r[None, :]
        x = tl.load(x_at, mask=t_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)
        if IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w), input_precision="tf32")
    out = out_ptr + t[:, None] * stride_yt + h * stride_yh + v[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & v_ok[None, :])


# NOTE: keyed by the model's widths and kv_b's kind only; the token count is a runtime argument
_absorb_tuned = autotuned(
    _absorb_kernel,
    [
        triton.Config({"BLOCK_D": d, "BLOCK_R": r}, num_warps=w)
        for d, r, w in ((64, 64, 4), (32, 64, 4), (64, 32, 4), (64, 128, 4), (32, 128, 8))
    ],
    key=["NOPE", "HEAD_ROWS", "R", "SCALED"],  # IEEE follows q's dtype, which triton keys on
)
_expand_tuned = autotuned(
    _expand_kernel,
    [
        triton.Config({"BLOCK_V": v, "BLOCK_R": r}, num_warps=w)
        for v, r, w in ((32, 128, 4), (16, 128, 4), (64, 64, 4), (32, 64, 4), (64, 128, 8))
    ],
    key=["NOPE", "HEAD_ROWS", "DV", "R", "SCALED"],
)


def takes(tokens: int, kv_b: torch.Tensor, kv_b_scale_inv: torch.Tensor | None) -> bool:
    """Whether these kernels run a product of `tokens` rows: few enough, and an FP8 `kv_b`
    scaled in 128x128 blocks or a 16-bit one."""
    if tokens > MAX_TOKENS:
        return False
    if kv_b_scale_inv is None:
        return kv_b.dtype in (torch.bfloat16, torch.float16, torch.float32)
    return FP8_BLOCK == 128 and kv_b.element_size() == 1


def absorb_query(
    q: torch.Tensor,  # [T, H, Dn + Dr]
    kv_b: torch.Tensor,  # [H * (Dn + Dv), R]
    kv_b_scale_inv: torch.Tensor | None,
    rope: int,
    config: triton.Config | None = None,
) -> torch.Tensor:  # [T, H, R] in q's dtype
    """Each head's `W_k^T q_nope` (`torch_ref.absorb_query`'s first output). `config` runs
    one config untuned (probes)."""
    _check_device(q, kv_b, kv_b_scale_inv)
    q = q if q.stride(-1) == 1 else q.contiguous()
    tokens, heads = q.shape[:2]
    nope, rank = q.shape[2] - rope, kv_b.shape[1]
    out = torch.empty(tokens, heads, rank, dtype=q.dtype, device=q.device)
    if tokens:
        scale = kv_b_scale_inv if kv_b_scale_inv is not None else kv_b  # unread when unscaled
        kernel, fixed = tuned_or_fixed(_absorb_tuned, config, BLOCK_D=64, BLOCK_R=64)
        grid = lambda meta: (heads, triton.cdiv(rank, meta["BLOCK_R"]))  # noqa: E731
        kernel[grid](
            q,
            kv_b,
            scale,
            out,
            tokens,
            q.stride(0),
            q.stride(1),
            kv_b.stride(0),
            scale.stride(0),
            out.stride(0),
            out.stride(1),
            NOPE=nope,
            HEAD_ROWS=kv_b.shape[0] // heads,
            R=rank,
            SCALED=kv_b_scale_inv is not None,
            IEEE=q.dtype == torch.float32,
            BLOCK_T=MAX_TOKENS,
            **fixed,
        )
    return out


def expand_output(
    out_latent: torch.Tensor,  # [T, H, R]
    kv_b: torch.Tensor,  # [H * (Dn + Dv), R]
    kv_b_scale_inv: torch.Tensor | None,
    nope: int,
    config: triton.Config | None = None,
) -> torch.Tensor:  # [T, H, Dv] in out_latent's dtype
    """Each head's `W_v o` (`torch_ref.expand_output`). `config` runs one config untuned
    (probes)."""
    _check_device(out_latent, kv_b, kv_b_scale_inv)
    out_latent = out_latent if out_latent.stride(-1) == 1 else out_latent.contiguous()
    tokens, heads, rank = out_latent.shape
    head_rows = kv_b.shape[0] // heads
    dv = head_rows - nope
    out = torch.empty(tokens, heads, dv, dtype=out_latent.dtype, device=out_latent.device)
    if tokens:
        scale = kv_b_scale_inv if kv_b_scale_inv is not None else kv_b
        kernel, fixed = tuned_or_fixed(_expand_tuned, config, BLOCK_V=32, BLOCK_R=128)
        grid = lambda meta: (heads, triton.cdiv(dv, meta["BLOCK_V"]))  # noqa: E731
        kernel[grid](
            out_latent,
            kv_b,
            scale,
            out,
            tokens,
            out_latent.stride(0),
            out_latent.stride(1),
            kv_b.stride(0),
            scale.stride(0),
            out.stride(0),
            out.stride(1),
            NOPE=nope,
            HEAD_ROWS=head_rows,
            DV=dv,
            R=rank,
            SCALED=kv_b_scale_inv is not None,
            IEEE=out_latent.dtype == torch.float32,
            BLOCK_T=MAX_TOKENS,
            **fixed,
        )
    return out
