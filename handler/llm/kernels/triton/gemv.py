"""Decode-sized projections of dense 16-bit weights as one Triton kernel each, with the norm
before them and SwiGLU after them fused in.

At batch 1 a decode step's projections are matrix-vector products: each weight byte is read
once and used for one multiply-add, so the step costs its weight bytes over HBM bandwidth, and
every separate small kernel around the GEMVs (the residual add and RMSNorm, SwiGLU's
activation, cuBLAS's split-K reductions) adds a launch of a few microseconds inside the graph.
`gemv` reads the weight once, in full-K rows (no split-K), and takes on that work:

| flags | computes | reference (the oracle) |
| --- | --- | --- |
| — | `x @ W.T (+ b)` | `F.linear` |
| `norm_weight` | `rms_norm(x) @ W.T (+ b)` | `rms_norm` then `F.linear` |
| `norm_weight`, `residual` | `h = x + residual`; `rms_norm(h) @ W.T (+ b)`; `h` written out | `add_rms_norm` then `F.linear` |
| `swiglu` | `silu(gate) * up` of `W = gate | up`'s product, `[1, N/2]` | `silu_mul` of the above |
| `weight_scale_inv` | any of the above for an FP8 weight with 128x128 block scales | `linear` on the dequantized weight |
| a float32 weight | `x @ W.T` in float32, a float32 output (GLM-5's indexer `weights_proj`, the MoE router) | `F.linear(x.float(), W)` |

The norm's statistic is a sum over all of K that the program gathers while it walks K for the
product, so nothing runs before the weight streams: `rms_norm(h) @ W.T` is computed as
`rsqrt(mean(h^2) + eps) * ((h * norm_weight) @ W.T)`. That skips the reference's two
roundings of the normed row to the input dtype (bf16: relative 2^-9 each, the size of the
difference any two summation orders of a bf16 GEMM show); the output is rounded where the
reference rounds it (the projection, then SwiGLU's activation and its product).

An FP8 weight is read as its bytes (a fifth of what the unfused path reads: the fp8 weight, then
a dequantized bf16 copy written and read back) and scaled in registers: every column of a
program lies in one 128-row scale block (`BLOCK_N` divides 128), so the scale of a K element is
its block's, and it multiplies the input row rather than the weight tile
(`(w * s) . x = w . (s * x)`, one multiply per K element instead of one per weight). That skips
the reference's rounding of the dequantized weight to the input dtype (relative 2^-9 in bf16).

Each program owns `BLOCK_N` output columns of the one input row (`GEMV_MAX_ROWS`), and adds each
K step's products in runs of 16 bytes of weight (`triton.kernels.lane_sums`) into an
accumulator it sums once, after the loop; the block sizes and warps are autotuned per shape
(`GEMV_CONFIGS`, `GEMV_FP8_CONFIGS`), the results cached into the snapshot like the other
kernels' (`triton.kernels.autotuned`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from snapfn.handler.llm.kernels.triton.kernels import (
    _check_device,
    _sm_count,
    autotuned,
    lane_sums,
    tuned_or_fixed,
)
from snapfn.handler.llm.weights.quant import FP8_BLOCK, FP8_DTYPE, scale_shape

# NOTE: one input row. Tried on the H200 and not kept: at two to four rows the same kernel,
# each weight tile multiplied by every row, ran 1.07-2.9x slower than cuBLAS
# (bench/probes/gemv_probe.py, commit 60beb82); a kernel of its own for 2-4 rows (each tile
# loaded and converted once, its products with every row summed in `lane_sums` runs) ran
# 2.5-10x slower than the unfused kernels (FP8: `fp8_block_linear`; bf16: cuBLAS) on GLM-5's
# FP8 and the 8B's bf16 shapes, e.g. GLM-5's o_proj 165 against 68 us at 2 rows
# (bench/results/2026-12-02-h200-mtp-l16-e32-gemv-rows, commit 40d5608). A verify step's rows
# take the tile kernels; its routed experts, `moe.moe_gemv`
GEMV_MAX_ROWS = 1
# K splits (`split_count`): a product with fewer column tiles than the GPU has SMs, such as
# GLM-5's kv_a and indexer wk (N 576 and 128 over K 6144, FP8) or its float32 router and
# weights_proj (N 256 and 32), leaves SMs idle. Splitting K gives every SM about
# GEMV_PROGRAMS_PER_SM programs (what 4-warp programs fill: 64 warps an SM), each at least
# GEMV_MIN_SPLIT_K long. NOTE: on the H200 (gemv_probe.py --splits auto,1, commit d40e24b)
# the splits took 6.5 -> 5.1 us (kv_a), 4.9 -> 3.6 (wk), 5.9 -> 5.4 (router), 4.0 -> 3.6
# (weights_proj), but slowed every product that already had a tile per SM (q_a 7.9 -> 8.9,
# the shared expert's gate | up 9.9 -> 14.3): the last program's read of the partial sums
# comes after the others' atomic count, a few microseconds on kernels of 5-15
GEMV_PROGRAMS_PER_SM = 16
# NOTE: SwiGLU (`gemv(swiglu=True)`) runs in the kernel. gemv_probe.py (commit 22ad861) also
# timed the product alone with `silu_mul` after it: 58.5 us on GLM-5's dense FP8 gate | up
# against 57.1 in the kernel; both lose to the norm + `fp8_block_linear` + silu_mul (52.5), as
# the 8B's bf16 one does (65.2 against 61.7 unfused, the gemv-probe.jsonl of
# bench/results/2026-11-30-h200-steady-llama8b-attention). That tile GEMM is the lead
GEMV_MIN_SPLIT_K = 512
GEMV_MAX_SPLITS = 16


@triton.jit
def _gemv_kernel(
    x_ptr,
    residual_ptr,
    sum_ptr,
    norm_ptr,
    w_ptr,
    scale_ptr,
    bias_ptr,
    out_ptr,
    partial_ptr,
    count_ptr,
    n,
    k,
    num_k_blocks,
    eps,
    SPLIT: tl.constexpr,
    NORM: tl.constexpr,
    SCALED: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    RESIDUAL: tl.constexpr,
    SWIGLU: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROUND_TO_X: tl.constexpr,  # a float32 `out` of 16-bit weights: the product rounded to x's dtype
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # `x`, `residual`, `sum`: [k]; `w`: [n, k] (with SWIGLU, [2n, k] = gate | up); `out`: [n]
    # (all contiguous); SCALED: `w` fp8 with `scale` [ceil(rows / SCALE_BLOCK), num_k_blocks].
    # One program per BLOCK_N output columns and K split (grid axis 1), its split walked
    # BLOCK_K at a time; the products summed over K once, after the loop. SPLIT: each program
    # leaves its sums in `partial` [splits, 2n (gate | up), then a square sum per program]; the
    # last of a column block's splits to finish (`count`, one per column block, back to 0 after)
    # adds them up and finishes the block.
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    splits = tl.num_programs(1)
    per_split = tl.cdiv(tl.cdiv(k, BLOCK_K), splits) * BLOCK_K
    k_first = pid_k * per_split
    k_last = tl.minimum(k_first + per_split, k)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * k  # [BLOCK_N, 1]
    # `lane_sums` accumulators (a LANE-th of a [BLOCK_N, BLOCK_K] tile's registers)
    LANE: tl.constexpr = min(128 // w_ptr.dtype.element_ty.primitive_bitwidth, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K // LANE), dtype=tl.float32)
    if SWIGLU:
        up_rows = w_ptr + (cols + n).to(tl.int64)[:, None] * k
        acc_up = tl.zeros((BLOCK_N, BLOCK_K // LANE), dtype=tl.float32)
    if NORM:
        squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
    if SCALED:
        # this program's columns share one scale row (BLOCK_N divides SCALE_BLOCK; with SWIGLU,
        # n is a multiple of it, so the up rows' block is as aligned)
        scale_row = scale_ptr + (pid * BLOCK_N // SCALE_BLOCK) * num_k_blocks
        if SWIGLU:
            up_scale_row = scale_ptr + ((pid * BLOCK_N + n) // SCALE_BLOCK) * num_k_blocks
    for k0 in range(k_first, k_last, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < k
        x = tl.load(x_ptr + ks, mask=k_mask, other=0.0)
        if RESIDUAL:
            residual = tl.load(residual_ptr + ks, mask=k_mask, other=0.0)
            # rounded to the input dtype, as `x + residual` is in torch; the first program
            # writes the sum out (the residual stream the next layer adds to)
            x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(sum_ptr + ks, x, mask=k_mask & (pid == 0))
        xf = x.to(tl.float32)
        if NORM:
            squares += xf * xf
            xf = xf * tl.load(norm_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
        w_mask = col_mask[:, None] & k_mask[None, :]
        w = tl.load(w_rows + ks[None, :], mask=w_mask, other=0.0)
        xw = xf
        if SCALED:
            xw = xf * tl.load(scale_row + ks // SCALE_BLOCK, mask=k_mask, other=0.0)
        acc += lane_sums(w.to(tl.float32) * xw[None, :], LANE)
        if SWIGLU:
            up = tl.load(up_rows + ks[None, :], mask=w_mask, other=0.0)
            if SCALED:
                xw = xf * tl.load(up_scale_row + ks // SCALE_BLOCK, mask=k_mask, other=0.0)
            acc_up += lane_sums(up.to(tl.float32) * xw[None, :], LANE)
    out = tl.sum(acc, axis=1)  # [BLOCK_N]
    if SWIGLU:
        out_up = tl.sum(acc_up, axis=1)
    if NORM:
        square_sum = tl.sum(squares, axis=0)
    if SPLIT:
        # NOTE: the barrier puts every thread's partial stores before the count (one thread
        # adds it); the atomic's acq_rel orders them before it, and the last program's loads
        # (`.cg`: from L2, never a stale L1 line) after it
        part = partial_ptr + pid_k * 2 * n
        tl.store(part + cols, out, mask=col_mask)
        if SWIGLU:
            tl.store(part + n + cols, out_up, mask=col_mask)
        squares_at = partial_ptr + splits * 2 * n + pid * splits
        if NORM:
            tl.store(squares_at + pid_k, square_sum)
        tl.debug_barrier()
        last = tl.atomic_add(count_ptr + pid, 1, sem="acq_rel") == splits - 1
        col_mask = col_mask & last  # only the last program reads the sums and writes the block
        out = tl.zeros((BLOCK_N,), dtype=tl.float32)
        if SWIGLU:
            out_up = tl.zeros((BLOCK_N,), dtype=tl.float32)
        if NORM:
            square_sum = square_sum * 0.0
        for s in range(0, splits):
            part = partial_ptr + s * 2 * n
            out += tl.load(part + cols, mask=col_mask, other=0.0, cache_modifier=".cg")
            if SWIGLU:
                out_up += tl.load(part + n + cols, mask=col_mask, other=0.0, cache_modifier=".cg")
            if NORM:
                square_sum += tl.load(squares_at + s, mask=last, other=0.0, cache_modifier=".cg")
        tl.store(count_ptr + pid, 0, mask=last)  # ready for the next launch
    if NORM:
        inv_rms = tl.rsqrt(square_sum / k + eps)
        out = out * inv_rms
        if SWIGLU:
            out_up = out_up * inv_rms
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        if SWIGLU:
            out_up += tl.load(bias_ptr + n + cols, mask=col_mask, other=0.0).to(tl.float32)
    if SWIGLU:
        # rounded where the reference rounds: the projection's output, silu's output, the product
        gate = out.to(out_ptr.dtype.element_ty).to(tl.float32)
        act = (gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty).to(tl.float32)
        out = act * out_up.to(out_ptr.dtype.element_ty).to(tl.float32)
    if ROUND_TO_X:
        out = out.to(x_ptr.dtype.element_ty)
    tl.store(out_ptr + cols, out.to(out_ptr.dtype.element_ty), mask=col_mask)


# NOTE: (columns, K step, warps): a program's weight tile is BLOCK_N x BLOCK_K. `GEMV_CONFIGS`
# (16-bit weights): the fastest of a 16-config sweep for each of the 8B's projections on the
# H200 (bench/probes/gemv_probe.py, bench/results/2026-11-30-h200-steady-llama8b-attention); no
# pipeline depths: triton does not pipeline these loads (no tl.dot), so stages changed nothing
# in the first sweep (commit 60beb82)
_CONFIGS = {
    (bn, bk, w): triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w)
    for bn, bk, w in (
        (2, 512, 2),
        (2, 1024, 4),
        (2, 2048, 8),
        (4, 512, 4),
        (8, 512, 4),
        (8, 1024, 4),
        (16, 512, 4),
        (16, 512, 8),
        (32, 128, 4),
        (32, 256, 4),
        (8, 2048, 4),
        (8, 2048, 8),
        (16, 1024, 4),
        (16, 2048, 8),
    )
}
GEMV_CONFIGS = [
    _CONFIGS[c]
    for c in (
        (2, 512, 2),  # the 8B's down_proj
        (2, 1024, 4),
        (2, 2048, 8),  # o_proj, lm_head
        (4, 512, 4),
        (8, 512, 4),
        (16, 512, 8),  # q | k | v with the norm
        (32, 128, 4),  # gate | up with the norm and SwiGLU
    )
]
# FP8 weights (SCALED): each the fastest of a 14-config sweep on one of the GLM-5-shaped model's
# FP8 projections (`gemv_probe.py --configs fp8-wide`,
# bench/results/2026-12-01-h200-steady-glm5-lane-sums), once `lane_sums` had about halved the
# registers of the 8-16K-weight tiles (which lost everywhere at 128-155 registers a thread:
# bench/results/2026-11-30-h200-gemv-probe-glm5-fp8); 16x1024w4 was second on two shapes. Each
# config timed is one more compile at init. NOTE: tried on the H200 and not kept: loading the
# next K step's tile before multiplying its own (commit 25f2b2e: slower on every shape), and a
# tensor-core form (the row padded to 16 as a tl.dot operand, the weight tiles pipelined through
# shared memory; 1.07-2.6x slower than the FMA configs of that time on every shape:
# bench/results/2026-12-01-h200-gemv-probe-tensor-core)
GEMV_FP8_CONFIGS = [
    _CONFIGS[c]
    for c in (
        (8, 1024, 4),  # o_proj, down_proj
        (8, 2048, 4),  # gate | up with the norm and SwiGLU
        (8, 2048, 8),  # the stacked q_a | kv_a | wk
        (16, 2048, 8),  # the shared expert's gate | up
        (16, 1024, 4),
        (32, 256, 4),  # q_b_proj
    )
]
GEMV_ALL_CONFIGS = list(_CONFIGS.values())


def configs_for_weight(configs: list[triton.Config], named_args: dict, **kwargs) -> list:
    """The autotuner's `early_config_prune`: of `configs` (`GEMV_ALL_CONFIGS`), those of
    `GEMV_FP8_CONFIGS` for an FP8 weight, of `GEMV_CONFIGS` for a 16-bit one."""
    wanted = GEMV_FP8_CONFIGS if {**named_args, **kwargs}.get("SCALED") else GEMV_CONFIGS
    return [c for c in configs if any(c is w for w in wanted)]


_gemv_tuned = autotuned(
    _gemv_kernel,
    GEMV_ALL_CONFIGS,
    key=["n", "k", "NORM", "RESIDUAL", "SWIGLU", "HAS_BIAS", "SCALED", "SPLIT"],
    prune=configs_for_weight,
)
# every config's BLOCK_N divides the FP8 scale block (the kernel's SCALED path needs it)
assert all(FP8_BLOCK % c.kwargs["BLOCK_N"] == 0 for c in GEMV_FP8_CONFIGS)


def takes_fp8(weight: torch.Tensor, weight_scale_inv: torch.Tensor, swiglu: bool) -> bool:
    """Whether `gemv` takes this FP8 weight: 2-D, 128x128 block scales of its shape, and with
    `swiglu` the up half starting on a scale block (gate's rows a multiple of 128)."""
    if weight.dtype != FP8_DTYPE or weight.dim() != 2:
        return False
    if tuple(weight_scale_inv.shape) != scale_shape(tuple(weight.shape)):
        return False
    return not swiglu or weight.shape[0] % (2 * FP8_BLOCK) == 0


def split_count(n: int, k: int, weight_dtype: torch.dtype, device: torch.device) -> int:
    """How many K splits `gemv` gives an `[n, k]` product on `device` (1: none): none where
    the configs' narrowest column tile (8 for FP8 weights, 2 for others) makes a tile per SM,
    else enough for about GEMV_PROGRAMS_PER_SM programs an SM, each split at least
    GEMV_MIN_SPLIT_K long. Only on CUDA: the interpreter runs a split only when asked
    (`gemv(splits=)`)."""
    if device.type != "cuda":
        return 1
    sms, tiles = _sm_count(device), triton.cdiv(n, 8 if weight_dtype == FP8_DTYPE else 2)
    if tiles >= sms:
        return 1
    return max(1, min(sms * GEMV_PROGRAMS_PER_SM // tiles, k // GEMV_MIN_SPLIT_K, GEMV_MAX_SPLITS))


# (device, n, splits) -> (partial sums [splits * 3n] float32, counts [n] int32): a split
# product's scratch, made once (before graph capture: warmup runs each shape first) and shared
# by every call of that shape (one stream runs them one after another; counts end at 0)
_SPLIT_SCRATCH: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _split_scratch(device: torch.device, n: int, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    key = (str(device), n, splits)
    if key not in _SPLIT_SCRATCH:
        # per split: gate | up sums (2n), and a square sum for each column block (at most n)
        partial = torch.empty(splits * 3 * n, dtype=torch.float32, device=device)
        _SPLIT_SCRATCH[key] = (partial, torch.zeros(n, dtype=torch.int32, device=device))
    return _SPLIT_SCRATCH[key]


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    swiglu: bool = False,
    weight_scale_inv: torch.Tensor | None = None,
    config: triton.Config | None = None,
    splits: int | None = None,
    float_out: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`(y, h)` for `x [..., K]` (at most `GEMV_MAX_ROWS` rows) and a 16-bit `weight [N, K]`
    of x's dtype, a float32 one (then `y` is float32: x's values multiplied in float32, as
    `Backend.linear` does for a float32 module), or an FP8 one with its `weight_scale_inv`
    (`takes_fp8`): `y` as the module docstring's table gives it for the flags, `h = x +
    residual` when `residual` is given (else None). `config` runs one config untuned (probes,
    tests); `splits` sets the K splits (else `split_count`'s). `float_out`: `y` as float32,
    holding what `.float()` of the product in its own dtype would (the final logits), stored
    so by the kernel where a cast would take a launch of its own."""
    _check_device(x, weight, bias, norm_weight, residual, weight_scale_inv)
    k = x.shape[-1]
    rows = x.reshape(-1, k).contiguous()
    m = rows.shape[0]
    want_dtypes = (x.dtype, torch.float32) if weight_scale_inv is None else (FP8_DTYPE,)
    if weight.dim() != 2 or weight.shape[1] != k or weight.dtype not in want_dtypes:
        names = " or ".join(str(d) for d in want_dtypes)
        got = f"{tuple(weight.shape)} {weight.dtype}"
        raise ValueError(f"gemv needs a [N, {k}] weight of dtype {names}, got {got}")
    if weight_scale_inv is not None and not takes_fp8(weight, weight_scale_inv, swiglu):
        raise ValueError(
            f"an FP8 weight {tuple(weight.shape)} needs scales "
            f"{scale_shape(tuple(weight.shape))}, got {tuple(weight_scale_inv.shape)}"
            + (f"; with swiglu, rows a multiple of {2 * FP8_BLOCK}" if swiglu else "")
        )
    if not 0 < m <= GEMV_MAX_ROWS:
        raise ValueError(f"gemv takes 1 to {GEMV_MAX_ROWS} rows, got {m}")
    if residual is not None and (norm_weight is None or residual.shape != x.shape):
        raise ValueError("a residual needs norm_weight and x's shape")
    if norm_weight is not None and norm_weight.shape != (k,):
        raise ValueError(f"norm_weight must be [{k}], got {tuple(norm_weight.shape)}")
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    if swiglu and weight.shape[0] % 2:
        raise ValueError(
            f"a swiglu weight stacks gate | up: its rows must be even, not {weight.shape[0]}"
        )
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    if float_out and swiglu:
        raise ValueError("float_out is for a plain product (the logits), not swiglu")
    # a float32 weight (a module kept in float32) gives a float32 product, as `Backend.linear`
    product_dtype = torch.float32 if weight.dtype == torch.float32 else x.dtype
    out_dtype = torch.float32 if float_out else product_dtype
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    total = torch.empty_like(rows) if residual is not None else None
    if splits is None:
        splits = split_count(n, k, weight.dtype, x.device)
    if splits < 1:
        raise ValueError(f"splits must be at least 1, got {splits}")
    partial, counts = _split_scratch(x.device, n, splits) if splits > 1 else (out, out)
    kernel, params = tuned_or_fixed(_gemv_tuned, config, BLOCK_N=8, BLOCK_K=128)
    flags = dict(
        SPLIT=splits > 1,
        NORM=norm_weight is not None,
        SCALED=weight_scale_inv is not None,
        SCALE_BLOCK=FP8_BLOCK,
        RESIDUAL=residual is not None,
        SWIGLU=swiglu,
        HAS_BIAS=bias is not None,
        ROUND_TO_X=out_dtype != product_dtype,
    )

    def grid(meta):
        return (triton.cdiv(n, meta["BLOCK_N"]), splits)

    kernel[grid](
        rows,
        residual.reshape(-1, k).contiguous() if residual is not None else rows,  # unread
        total if total is not None else rows,  # unwritten without a residual
        norm_weight if norm_weight is not None else rows,  # unread without a norm
        weight.contiguous(),
        weight_scale_inv.contiguous() if weight_scale_inv is not None else rows,  # unread if 16-bit
        bias if bias is not None else rows,  # unread without a bias
        out,
        partial,  # unused without a split
        counts,
        n,
        k,
        triton.cdiv(k, FP8_BLOCK),
        eps,
        **flags,
        **params,
    )
    return out.view(*x.shape[:-1], n), None if total is None else total.view(x.shape)
