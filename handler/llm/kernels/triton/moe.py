"""Routed experts in Triton without a host sync, matching `TorchBackend.moe` (bf16 / fp32
weights, or FP8 with 128x128 block scales).

    out = fused_moe(x, experts, topk_ids, topk_weights)      # [T, H], this rank's share

The reference loops over the experts hit (`.tolist()`: a host sync, so decode graphs cannot
capture it) and gathers each one's tokens. Here every shape is fixed by `T`, `k` and the number
of local experts:

1. `align_by_expert` (torch ops, no sync): the `T*k` (token, slot) pairs sorted by local expert,
   each expert's run padded to a multiple of `BLOCK_M` (`block_m_for`: 16 rows for decode-sized
   batches, 64 for prefill-sized ones); pairs routed to another ep rank dropped.
   Out: `pair_of_row [max_rows]` (pair id, or `T*k` = padding) and `expert_of_block
   [max_blocks]` (-1 = unused block).
2. `_gate_up_kernel`: per (row block, column block of I): `silu(x @ gate_e.T) * (x @ up_e.T)`
   for the block's expert, in float32, stored once rounded to `x`'s dtype (as the reference).
3. `_down_kernel`: per (row block, column block of H): `act @ down_e.T` times the pair's router
   weight, stored at the pair's row of `[T*k, H]` (each pair once); summed over `k` in torch.

FP8 experts: each weight tile is dequantized in the kernel (times its block's scale, rounded to
`x`'s dtype, as the reference's `dequantize_fp8_block`) before the multiply. A tile lies within
one 128x128 scale block (`BLOCK_N` and `BLOCK_K` divide 128), so it has one scale.
Multiplies run on tensor cores in `x`'s dtype with float32 sums (cuBLAS's way, which the
reference's bf16 matmuls take); float32 inputs, and the interpreter, multiply in IEEE float32.

Both kernels are autotuned on GPUs (`MOE_CONFIGS`: `BLOCK_N`, `BLOCK_K`, warps, stages), once
per (hidden, intermediate, `BLOCK_M`, dtypes), with triton's results cache on, so the choice
lands in the snapshot (`triton.kernels.autotuned`); under the interpreter they run untuned with
`INTERPRETED_TILE` (64 columns by 128 inputs, the fixed tile before autotuning).
NOTE: imports triton at import time, like triton_kernels.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from snapfn.handler.llm.kernels.base import ExpertWeights
from snapfn.handler.llm.kernels.triton.kernels import (
    _check_device,
    autotuned,
    dot_acc,
    dot_in_fp32,
    lane_sums,
    tuned_or_fixed,
)

# NOTE: `BLOCK_M` is not tuned: `align_by_expert` pads each expert's rows to it before the
# launch. 16 rows waste the least on padding when experts get a few pairs each (decode); 64
# read each expert's weights a quarter as often when they get many (prefill)
DECODE_BLOCK_M, PREFILL_BLOCK_M = 16, 64
# NOTE: before commit 24cec6d the kernels ran 16 x 32 x 32 tiles multiplied in IEEE float32 on
# CUDA cores, with a scale gathered per element: 7 ms of a GLM-5-shaped decode step of 8 ms (the
# profile recorded in 24cec6d); its fixed 16 x 64 x 128 tiles on tensor cores are the
# interpreter's now
INTERPRETED_TILE = {"BLOCK_N": 64, "BLOCK_K": 128}
# tiles within one 128x128 scale block (BLOCK_N, BLOCK_K divide 128), warps, pipeline depth; a
# config that does not fit the GPU (shared memory) is timed as infinitely slow and never chosen
MOE_CONFIGS = [
    triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=warps, num_stages=stages)
    for n, k, warps, stages in (
        (32, 128, 4, 3),
        (64, 128, 4, 3),
        (64, 128, 4, 4),
        (128, 128, 8, 3),
        (64, 64, 4, 4),
        (128, 64, 8, 4),
    )
]


def block_m_for(num_pairs: int, num_local: int) -> int:
    """Rows per tile: 16 while the local experts average at most 16 (token, slot) pairs each,
    else 64. A function of the batch's token count and the model, so fixed per graph bucket
    (pairs of other ep ranks are counted too: a coarse choice)."""
    return DECODE_BLOCK_M if num_pairs <= DECODE_BLOCK_M * num_local else PREFILL_BLOCK_M


def align_by_expert(
    topk_ids: torch.Tensor,  # [T, k] global expert ids
    first_expert: int,
    num_local: int,
    block_m: int = DECODE_BLOCK_M,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair_of_row [max_rows], expert_of_block [max_blocks]); see the module docstring."""
    device = topk_ids.device
    num_pairs = topk_ids.numel()
    local = topk_ids.flatten().long() - first_expert  # [P]
    on_rank = (local >= 0) & (local < num_local)
    bucket = torch.where(on_rank, local, num_local)  # other ranks' pairs: one extra bucket
    counts = torch.zeros(num_local + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    padded = (counts[:num_local] + block_m - 1) // block_m * block_m  # [E]
    row_start = torch.cumsum(padded, 0) - padded  # [E] exclusive
    pair_start = torch.cumsum(counts, 0) - counts  # [E + 1] within the sorted pairs
    pairs = torch.arange(num_pairs, device=device)
    order = torch.argsort(bucket * num_pairs + pairs)  # by expert, then pair: stable
    sorted_bucket = bucket[order]
    rank_in_expert = torch.arange(num_pairs, device=device) - pair_start[sorted_bucket]
    max_rows = num_pairs + num_local * (block_m - 1)
    max_rows = (max_rows + block_m - 1) // block_m * block_m
    dest = row_start[sorted_bucket.clamp_max(num_local - 1)] + rank_in_expert
    dest = torch.where(sorted_bucket < num_local, dest, max_rows)  # off-rank: dropped
    pair_of_row = torch.full((max_rows + 1,), num_pairs, dtype=torch.long, device=device)
    pair_of_row.scatter_(0, dest, order)
    pair_of_row = pair_of_row[:max_rows]
    block_starts = torch.arange(0, max_rows, block_m, device=device)
    ends = torch.cumsum(padded, 0)  # [E]
    expert_of_block = torch.searchsorted(ends, block_starts, right=True)  # [blocks]
    expert_of_block = torch.where(expert_of_block < num_local, expert_of_block, -1)
    return pair_of_row.to(torch.int32), expert_of_block.to(torch.int32)


@triton.jit
def _weight_tile(
    w_ptr, scale_ptr, expert, col0, k0, cols, k, num_out, num_in, dtype, FP8: tl.constexpr
):
    """`[BLOCK_K, BLOCK_N]` tile in `dtype` of expert `expert`'s `[num_out, num_in]` weight at
    output columns `cols` (from `col0`) and inputs `k` (from `k0`), zero outside it; FP8: times
    its 128x128 block's scale and rounded to `dtype`, as the reference's `dequantize_fp8_block`
    (the tile lies in one block)."""
    mask = (cols[None, :] < num_out) & (k[:, None] < num_in)
    offsets = expert.to(tl.int64) * num_out * num_in + cols[None, :].to(tl.int64) * num_in
    w = tl.load(w_ptr + offsets + k[:, None], mask=mask, other=0.0)
    if FP8:
        num_in_blocks = tl.cdiv(num_in, 128)
        block = expert.to(tl.int64) * tl.cdiv(num_out, 128) * num_in_blocks
        scale = tl.load(scale_ptr + block + (col0 // 128) * num_in_blocks + k0 // 128)
        w = w.to(tl.float32) * scale
    return w.to(dtype)


# NOTE: `num_pairs` is not specialised on (triton would compile one variant for multiples of
# 16 and one for the rest): a prefill length whose parity warmup did not run would otherwise
# compile in a request, after a restore
@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up_kernel(
    x_ptr,  # [T, H]
    gate_ptr,  # [E, I, H]
    up_ptr,  # [E, I, H]
    gate_scale_ptr,  # [E, ceil(I/128), ceil(H/128)] when FP8
    up_scale_ptr,
    act_ptr,  # [max_rows, I]
    pair_of_row_ptr,
    expert_of_block_ptr,
    num_pairs,
    hidden,
    inter,
    TOPK: tl.constexpr,
    FP8: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tl.static_assert(128 % BLOCK_N == 0 and 128 % BLOCK_K == 0)  # a tile in one scale block
    block = tl.program_id(0)
    col_block = tl.program_id(1)
    expert = tl.load(expert_of_block_ptr + block)
    if expert >= 0:
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        pairs = tl.load(pair_of_row_ptr + rows)
        live = pairs < num_pairs
        tokens = tl.where(live, pairs // TOPK, 0).to(tl.int64)
        col0 = col_block * BLOCK_N
        cols = col0 + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        dtype = act_ptr.dtype.element_ty
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k = k0 + ks
            x = tl.load(
                x_ptr + tokens[:, None] * hidden + k[None, :],
                mask=live[:, None] & (k[None, :] < hidden),
                other=0.0,
            ).to(dtype)
            gate = _weight_tile(
                gate_ptr, gate_scale_ptr, expert, col0, k0, cols, k, inter, hidden, dtype, FP8
            )
            up = _weight_tile(
                up_ptr, up_scale_ptr, expert, col0, k0, cols, k, inter, hidden, dtype, FP8
            )
            acc_gate = dot_acc(acc_gate, x, gate, DOT_FP32)
            acc_up = dot_acc(acc_up, x, up, DOT_FP32)
        # the reference rounds each projection to x's dtype before silu(gate) * up
        gate_r = acc_gate.to(dtype).to(tl.float32)
        up_r = acc_up.to(dtype).to(tl.float32)
        silu = (gate_r / (1.0 + tl.exp(-gate_r))).to(dtype).to(tl.float32)
        act = silu * up_r
        out_offsets = rows[:, None].to(tl.int64) * inter + cols[None, :]
        tl.store(act_ptr + out_offsets, act.to(dtype), mask=live[:, None] & (cols[None, :] < inter))


@triton.jit(do_not_specialize=["num_pairs"])
def _down_kernel(
    act_ptr,  # [max_rows, I]
    down_ptr,  # [E, H, I]
    down_scale_ptr,  # [E, ceil(H/128), ceil(I/128)] when FP8
    weights_ptr,  # [T*k] router weights
    out_ptr,  # [T*k, H] float32
    pair_of_row_ptr,
    expert_of_block_ptr,
    num_pairs,
    hidden,
    inter,
    ROUND_PRODUCT: tl.constexpr,
    FP8: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tl.static_assert(128 % BLOCK_N == 0 and 128 % BLOCK_K == 0)  # a tile in one scale block
    block = tl.program_id(0)
    col_block = tl.program_id(1)
    expert = tl.load(expert_of_block_ptr + block)
    if expert >= 0:
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        pairs = tl.load(pair_of_row_ptr + rows)
        live = pairs < num_pairs
        col0 = col_block * BLOCK_N
        cols = col0 + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        dtype = act_ptr.dtype.element_ty
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            k = k0 + ks
            act = tl.load(
                act_ptr + rows[:, None].to(tl.int64) * inter + k[None, :],
                mask=live[:, None] & (k[None, :] < inter),
                other=0.0,
            )
            down = _weight_tile(
                down_ptr, down_scale_ptr, expert, col0, k0, cols, k, hidden, inter, dtype, FP8
            )
            acc = dot_acc(acc, act, down, DOT_FP32)
        y = acc.to(dtype).to(tl.float32)  # the reference's down projection, in x's dtype
        weight = tl.load(weights_ptr + tl.where(live, pairs, 0), mask=live, other=0.0)
        y = y * weight.to(tl.float32)[:, None]
        if ROUND_PRODUCT:  # router weights in x's dtype: the reference's product is rounded too
            y = y.to(dtype).to(tl.float32)
        out_offsets = tl.where(live, pairs, 0)[:, None].to(tl.int64) * hidden + cols[None, :]
        tl.store(out_ptr + out_offsets, y, mask=live[:, None] & (cols[None, :] < hidden))


# NOTE: the token count is not a key (it is the grid); `BLOCK_M` is, from `block_m_for`. The
# timing runs need no restore: `_down_kernel` stores (never adds) each pair's row, the same
# values each run
_gate_up_tuned = autotuned(_gate_up_kernel, MOE_CONFIGS, key=["hidden", "inter", "BLOCK_M"])
_down_tuned = autotuned(_down_kernel, MOE_CONFIGS, key=["hidden", "inter", "BLOCK_M"])


def fused_moe(
    x: torch.Tensor,  # [T, H]
    experts: ExpertWeights,
    topk_ids: torch.Tensor,  # [T, k] global expert ids
    topk_weights: torch.Tensor,  # [T, k]
    config: triton.Config | None = None,  # default: tuned (interpreter: INTERPRETED_TILE)
) -> torch.Tensor:  # [T, H] in x's dtype: this rank's experts' contributions
    _check_device(x, experts.gate, topk_ids, topk_weights)
    fp8 = experts.gate_scale_inv is not None
    num_tokens, hidden = x.shape
    topk = topk_ids.shape[1]
    inter = experts.gate.shape[1]
    num_pairs = num_tokens * topk
    out = torch.zeros(num_pairs, hidden, dtype=torch.float32, device=x.device)
    if num_pairs and experts.num_local:
        block_m = block_m_for(num_pairs, experts.num_local)
        pair_of_row, expert_of_block = align_by_expert(
            topk_ids, experts.first_expert, experts.num_local, block_m
        )
        act = torch.empty(pair_of_row.numel(), inter, dtype=x.dtype, device=x.device)
        blocks = expert_of_block.numel()
        x = x.contiguous()
        gate, up, down = (w.contiguous() for w in (experts.gate, experts.up, experts.down))
        scales = [experts.gate_scale_inv, experts.up_scale_inv, experts.down_scale_inv]
        gate_s, up_s, down_s = (s.contiguous() if fp8 else gate for s in scales)  # unread
        gate_up_kernel, gate_up_tile = tuned_or_fixed(_gate_up_tuned, config, **INTERPRETED_TILE)
        gate_up_kernel[lambda meta: (blocks, triton.cdiv(inter, meta["BLOCK_N"]))](
            x, gate, up, gate_s, up_s, act, pair_of_row, expert_of_block, num_pairs, hidden,
            inter, TOPK=topk, FP8=fp8, DOT_FP32=dot_in_fp32(x.dtype), BLOCK_M=block_m,
            **gate_up_tile,
        )  # fmt: skip
        weights = topk_weights.reshape(-1).contiguous()
        down_kernel, down_tile = tuned_or_fixed(_down_tuned, config, **INTERPRETED_TILE)
        down_kernel[lambda meta: (blocks, triton.cdiv(hidden, meta["BLOCK_N"]))](
            act, down, down_s, weights, out, pair_of_row, expert_of_block, num_pairs, hidden,
            inter, ROUND_PRODUCT=torch.promote_types(x.dtype, weights.dtype) != torch.float32,
            FP8=fp8, DOT_FP32=dot_in_fp32(x.dtype), BLOCK_M=block_m, **down_tile,
        )  # fmt: skip
    return out.view(num_tokens, topk, hidden).sum(dim=1).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# One token (a batch-1 decode step): its `k` experts as matrix-vector products, no sorting.


@triton.jit
def _scaled_row(x, scale_ptr, expert, col0, ks, k_mask, num_out, num_in, SCALED: tl.constexpr):
    """`x` (float32, inputs `ks`) times each input's 128x128 block scale for output columns
    from `col0` of expert `expert`'s `[num_out, num_in]` weight (BLOCK_N divides 128: the
    columns share one scale row); unscaled for 16-bit weights."""
    if SCALED:
        num_in_blocks = tl.cdiv(num_in, 128)
        row = (expert.to(tl.int64) * tl.cdiv(num_out, 128) + col0 // 128) * num_in_blocks
        return x * tl.load(scale_ptr + row + ks // 128, mask=k_mask, other=0.0)
    return x


@triton.jit
def _gate_up_gemv_kernel(
    x_ptr,  # [T, H]
    gate_ptr,  # [E, I, H]
    up_ptr,  # [E, I, H]
    gate_scale_ptr,  # [E, ceil(I/128), ceil(H/128)] when FP8
    up_scale_ptr,
    topk_ids_ptr,  # [T * TOPK] global expert ids
    act_ptr,  # [T * TOPK, I]
    first_expert,
    num_local,
    hidden,
    inter,
    topk,
    FP8: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # one program per (slot, BLOCK_N columns of I), slots of token t at t * topk on; a slot
    # routed off this rank does nothing. The slots of a column block are neighbours in the
    # grid: tokens that picked the same expert read its tile at about the same time (from L2)
    slot = tl.program_id(0)
    x_ptr += (slot // topk).to(tl.int64) * hidden
    expert = tl.load(topk_ids_ptr + slot).to(tl.int64) - first_expert
    if (expert >= 0) & (expert < num_local):
        col0 = tl.program_id(1) * BLOCK_N
        cols = col0 + tl.arange(0, BLOCK_N)
        col_mask = cols < inter
        rows = expert * inter * hidden + cols.to(tl.int64)[:, None] * hidden  # [BLOCK_N, 1]
        LANE: tl.constexpr = min(128 // gate_ptr.dtype.element_ty.primitive_bitwidth, BLOCK_K)
        acc_gate = tl.zeros((BLOCK_N, BLOCK_K // LANE), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_K // LANE), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < hidden
            x = tl.load(x_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
            w_mask = col_mask[:, None] & k_mask[None, :]
            gate = tl.load(gate_ptr + rows + ks[None, :], mask=w_mask, other=0.0)
            up = tl.load(up_ptr + rows + ks[None, :], mask=w_mask, other=0.0)
            xg = _scaled_row(x, gate_scale_ptr, expert, col0, ks, k_mask, inter, hidden, FP8)
            xu = _scaled_row(x, up_scale_ptr, expert, col0, ks, k_mask, inter, hidden, FP8)
            acc_gate += lane_sums(gate.to(tl.float32) * xg[None, :], LANE)
            acc_up += lane_sums(up.to(tl.float32) * xu[None, :], LANE)
        # rounded where the reference rounds: each projection, silu's output, the product
        dtype = act_ptr.dtype.element_ty
        gate_r = tl.sum(acc_gate, axis=1).to(dtype).to(tl.float32)
        up_r = tl.sum(acc_up, axis=1).to(dtype).to(tl.float32)
        silu = (gate_r / (1.0 + tl.exp(-gate_r))).to(dtype).to(tl.float32)
        tl.store(act_ptr + slot * inter + cols, (silu * up_r).to(dtype), mask=col_mask)


@triton.jit
def _down_gemv_kernel(
    act_ptr,  # [T * TOPK, I]
    down_ptr,  # [E, H, I]
    down_scale_ptr,  # [E, ceil(H/128), ceil(I/128)] when FP8
    topk_ids_ptr,  # [T * TOPK]
    weights_ptr,  # [T * TOPK] router weights
    out_ptr,  # [T, H] in x's dtype
    first_expert,
    num_local,
    hidden,
    inter,
    TOPK: tl.constexpr,
    ROUND_PRODUCT: tl.constexpr,
    FP8: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # one program per (token, BLOCK_N columns of H), over the token's slots: their sum stays in
    # registers. The tokens of a column block are neighbours in the grid, as in gate | up
    token = tl.program_id(0)
    first_slot = token * TOPK
    out_ptr += token.to(tl.int64) * hidden
    col0 = tl.program_id(1) * BLOCK_N
    cols = col0 + tl.arange(0, BLOCK_N)
    col_mask = cols < hidden
    dtype = act_ptr.dtype.element_ty
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    LANE: tl.constexpr = min(128 // down_ptr.dtype.element_ty.primitive_bitwidth, BLOCK_K)
    for slot in range(first_slot, first_slot + TOPK):
        expert = tl.load(topk_ids_ptr + slot).to(tl.int64) - first_expert
        if (expert >= 0) & (expert < num_local):
            rows = expert * hidden * inter + cols.to(tl.int64)[:, None] * inter
            acc = tl.zeros((BLOCK_N, BLOCK_K // LANE), dtype=tl.float32)
            for k0 in range(0, inter, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                k_mask = ks < inter
                act = tl.load(act_ptr + slot * inter + ks, mask=k_mask, other=0.0)
                act = _scaled_row(
                    act.to(tl.float32), down_scale_ptr, expert, col0, ks, k_mask, hidden, inter, FP8
                )
                w_mask = col_mask[:, None] & k_mask[None, :]
                w = tl.load(down_ptr + rows + ks[None, :], mask=w_mask, other=0.0)
                acc += lane_sums(w.to(tl.float32) * act[None, :], LANE)
            y = tl.sum(acc, axis=1).to(dtype).to(tl.float32)  # the down projection, in x's dtype
            y = y * tl.load(weights_ptr + slot).to(tl.float32)
            if ROUND_PRODUCT:  # router weights in x's dtype: the reference rounds the product
                y = y.to(dtype).to(tl.float32)
            total += y
    tl.store(out_ptr + cols, total.to(out_ptr.dtype.element_ty), mask=col_mask)


# NOTE: (columns, K step, warps), as the dense GEMV's (`triton.gemv.GEMV_CONFIGS`); BLOCK_N
# divides 128, so a program's columns share one FP8 scale row. Not swept here on a GPU: the
# engine's tuner picks among them (the profile recorded in commit 07522b8: the experts 95 -> 80
# us a GLM-5-shaped step, with `lane_sums` and the two wide tiles below added)
MOE_GEMV_CONFIGS = [
    triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w)
    for bn, bk, w in (
        (2, 1024, 4),
        (4, 512, 4),
        (4, 1024, 4),
        (8, 512, 4),
        (8, 512, 8),
        (16, 256, 8),
        (16, 512, 8),
        # wide tiles, since `lane_sums` halved their registers (commit 07522b8)
        (8, 1024, 4),
        (16, 1024, 8),
    )
]
# a verify step's 1 + k drafts (k <= 3). NOTE: on the H200, GLM-5's FP8 experts (top 8 of 32 or
# 256) at 2 and 4 tokens took 142-289 us here against 297-539 in `fused_moe`, 1.6-2.2x faster
# (gemv_probe.py --moe, bench/results/2026-12-02-h200-mtp-l16-e32-gemv-rows, commit 40d5608)
MOE_GEMV_MAX_TOKENS = 4
MOE_GEMV_INTERPRETED = {"BLOCK_N": 16, "BLOCK_K": 64}
_gate_up_gemv_tuned = autotuned(
    _gate_up_gemv_kernel, MOE_GEMV_CONFIGS, key=["hidden", "inter", "FP8"]
)
_down_gemv_tuned = autotuned(
    _down_gemv_kernel, MOE_GEMV_CONFIGS, key=["hidden", "inter", "TOPK", "FP8"]
)


def moe_gemv(
    x: torch.Tensor,  # [T, H], T at most MOE_GEMV_MAX_TOKENS
    experts: ExpertWeights,
    topk_ids: torch.Tensor,  # [T, k] global expert ids
    topk_weights: torch.Tensor,  # [T, k]
    config: triton.Config | None = None,  # default: tuned (interpreter: MOE_GEMV_INTERPRETED)
) -> torch.Tensor:  # [T, H] in x's dtype: this rank's experts' contributions
    """`fused_moe` for a decode step's few tokens (one; or a verify step's 1 + k drafts): each
    of a token's `k` experts' SwiGLU MLP as matrix-vector products, each weight byte read once
    a token (an expert that several tokens picked is read by each, at about the same time: from
    L2 after the first). Two launches: gate | up with the activation per (slot, column block),
    then down per (token, column block) with the router-weighted sum over the token's slots in
    registers. No sorting by expert, no padding, no float32 `[T * k, H]` buffer to sum."""
    _check_device(x, experts.gate, topk_ids, topk_weights)
    tokens = x.shape[0]
    if not 0 < tokens <= MOE_GEMV_MAX_TOKENS or topk_ids.shape[0] != tokens:
        raise ValueError(
            f"moe_gemv takes 1 to {MOE_GEMV_MAX_TOKENS} tokens and their ids, got {tokens} "
            f"and {topk_ids.shape[0]}"
        )
    fp8 = experts.gate_scale_inv is not None
    hidden, inter, topk = x.shape[1], experts.gate.shape[1], topk_ids.shape[1]
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    if not experts.num_local:
        return out.zero_()
    act = torch.empty(tokens * topk, inter, dtype=x.dtype, device=x.device)
    gate, up, down = (w.contiguous() for w in (experts.gate, experts.up, experts.down))
    scales = [experts.gate_scale_inv, experts.up_scale_inv, experts.down_scale_inv]
    gate_s, up_s, down_s = (s.contiguous() if fp8 else gate for s in scales)  # unread if 16-bit
    ids = topk_ids.reshape(-1).contiguous()
    weights = topk_weights.reshape(-1).contiguous()
    local = (experts.first_expert, experts.num_local)
    gate_up, gate_up_tile = tuned_or_fixed(_gate_up_gemv_tuned, config, **MOE_GEMV_INTERPRETED)
    down_k, down_tile = tuned_or_fixed(_down_gemv_tuned, config, **MOE_GEMV_INTERPRETED)
    gate_up[lambda meta: (tokens * topk, triton.cdiv(inter, meta["BLOCK_N"]))](
        x.contiguous(), gate, up, gate_s, up_s, ids, act, *local, hidden, inter, topk, FP8=fp8,
        **gate_up_tile,
    )  # fmt: skip
    down_k[lambda meta: (tokens, triton.cdiv(hidden, meta["BLOCK_N"]))](
        act, down, down_s, ids, weights, out, *local, hidden, inter, TOPK=topk,
        ROUND_PRODUCT=torch.promote_types(x.dtype, weights.dtype) != torch.float32, FP8=fp8,
        **down_tile,
    )  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------
# The router (`torch_ref.noaux_tc_route`) in one launch.


@triton.jit
def _first_max(values, index, BIG: tl.constexpr):
    """The largest of `values` and the smallest `index` holding it (a 2-D tile)."""
    best = tl.max(tl.max(values, axis=1), axis=0)
    return best, tl.min(tl.min(tl.where(values == best, index, BIG), axis=1), axis=0)


@triton.jit
def _route_kernel(
    logits_ptr,  # [T, E] float32
    bias_ptr,  # [E] float32
    ids_ptr,  # [T, TOPK] int64
    weights_ptr,  # [T, TOPK] float32
    num_experts,
    per_group,
    num_groups,
    scaling,
    TOPK: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    NORM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # one program per token; its experts laid out [group, expert in group]
    t = tl.program_id(0).to(tl.int64)
    groups = tl.arange(0, BLOCK_G)[:, None]
    within = tl.arange(0, BLOCK_E)[None, :]
    live = (groups < num_groups) & (within < per_group)
    expert = groups * per_group + within  # [G, E/G]
    logits = tl.load(logits_ptr + t * num_experts + expert, mask=live, other=0.0)
    scores = tl.sigmoid(logits)
    choice = scores + tl.load(bias_ptr + expert, mask=live, other=0.0)
    choice = tl.where(live, choice, float("-inf"))
    # each group ranked by the sum of its two best choices (a tie for best counts twice)
    first = tl.max(choice, axis=1)
    first_at = tl.min(tl.where(choice == first[:, None], within, BLOCK_E), axis=1)
    second = tl.max(tl.where(within == first_at[:, None], float("-inf"), choice), axis=1)
    group_score = tl.where(tl.arange(0, BLOCK_G) < num_groups, first + second, float("-inf"))
    # the best TOPK_GROUP groups, the lowest index first among equals
    group_ids = tl.arange(0, BLOCK_G)
    picked = tl.zeros((BLOCK_G,), dtype=tl.int32)
    for _ in tl.static_range(TOPK_GROUP):
        left = tl.where(picked != 0, float("-inf"), group_score)
        best = tl.max(left, axis=0)
        at = tl.min(tl.where(left == best, group_ids, BLOCK_G), axis=0)
        picked = tl.where(group_ids == at, 1, picked)
    choice = tl.where(picked[:, None] != 0, choice, float("-inf"))
    # the TOPK best experts of those groups, the lowest id first among equals, best first
    slots = tl.arange(0, BLOCK_K)
    ids = tl.zeros((BLOCK_K,), dtype=tl.int64)
    weights = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for slot in tl.static_range(TOPK):
        _, at = _first_max(choice, expert, 1 << 30)
        weight = tl.sum(tl.sum(tl.where(expert == at, scores, 0.0), axis=1), axis=0)
        ids = tl.where(slots == slot, at.to(tl.int64), ids)
        weights = tl.where(slots == slot, weight, weights)
        choice = tl.where(expert == at, float("-inf"), choice)
    if NORM:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    tl.store(ids_ptr + t * TOPK + slots, ids, mask=slots < TOPK)
    tl.store(weights_ptr + t * TOPK + slots, weights * scaling, mask=slots < TOPK)


_route_tuned = autotuned(
    _route_kernel,
    [triton.Config({}, num_warps=w) for w in (1, 2, 4)],
    key=["num_experts", "num_groups", "TOPK", "TOPK_GROUP"],
)


def route(
    logits: torch.Tensor, correction_bias: torch.Tensor, moe
) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch_ref.noaux_tc_route` in one launch per batch (one program per token): the reference
    runs some fifteen small kernels. The slots come best first; among exactly equal choices
    the lower group and expert id win (the reference's `topk` leaves that open)."""
    _check_device(logits, correction_bias)
    tokens, num_experts = logits.shape
    if num_experts != moe.n_routed_experts or num_experts % moe.n_group:
        raise ValueError(
            f"router logits {tuple(logits.shape)} do not fit {moe.n_routed_experts} experts"
        )
    topk = moe.num_experts_per_tok
    ids = torch.empty(tokens, topk, dtype=torch.int64, device=logits.device)
    weights = torch.empty(tokens, topk, dtype=torch.float32, device=logits.device)
    if tokens:
        per_group = num_experts // moe.n_group
        kernel, fixed = tuned_or_fixed(_route_tuned)
        kernel[(tokens,)](
            logits.float().contiguous(), correction_bias.float().contiguous(), ids, weights,
            num_experts, per_group, moe.n_group, float(moe.routed_scaling_factor), TOPK=topk,
            TOPK_GROUP=moe.topk_group, NORM=bool(moe.norm_topk_prob),
            BLOCK_G=max(2, triton.next_power_of_2(moe.n_group)),
            BLOCK_E=max(2, triton.next_power_of_2(per_group)),
            BLOCK_K=max(2, triton.next_power_of_2(topk)), **fixed,
        )  # fmt: skip
    return ids, weights
