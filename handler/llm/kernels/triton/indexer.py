"""The DSA indexer's scoring in Triton: decode (`torch_ref._topk_decode`'s scores) and prefill
(`torch_ref.index_scores_one_seq`'s).

    picked = indexer_topk_decode(q, weights, k_cache, page_table, seq_lens, topk, scale)
    scores = index_scores_prefill(q, weights, k, q_offset, scale)   # one request's chunk

Per request, every cached key `l` scores `sum_h weights[h] * relu(scale * q[h] . k[l])`; the
`topk` best keys are then picked as the reference does (`torch_ref.select_topk`: stable sort,
earlier key first among equals, -1 past the request's keys). The reference gathers the whole
page row (the graph bucket's width) and multiplies it; here one program per (request, block of
positions) reads only the pages that hold the request's keys and writes their scores (-inf past
the request's last key). Fixed grid, no host sync: capturable in decode graphs.

The block of positions (`BLOCK_L`) and the warps are autotuned on GPUs once per (indexer
heads, head dim, page size, dtypes), never per batch or row width, with triton's results cache
on (`triton.kernels.autotuned`); the interpreter runs `INTERPRETED_BLOCK_L` = 32 positions.

Prefill: one program per (block of queries, block of keys) sums `weights[t, h] * relu(scale *
q[t, h] . k[l])` over the heads in registers; the reference materialises the `[q, Hi, L]`
float32 scores (twice: the products, then their relu) before it sums them. A key block wholly
after the block's last query is written -inf without being read. Both kernels multiply 16-bit
queries and keys on tensor cores with float32 sums (their products are exact in float32, as in
the reference's float32 matmul), float32 ones in IEEE float32 (`dot_acc`), so the scores
differ from the reference's only in the order of the sums.

NOTE: imports triton at import time, like kernels.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from snapfn.handler.llm.kernels.torch_ref import select_topk
from snapfn.handler.llm.kernels.triton.kernels import (
    _check_device,
    autotuned,
    dot_acc,
    dot_in_fp32,
    tuned_or_fixed,
)

INTERPRETED_BLOCK_L = 32  # positions per program under the interpreter (the tuned one on GPUs)


@triton.jit
def _index_scores_kernel(
    q_ptr,  # [B, Hi, Di]
    weights_ptr,  # [B, Hi] float32
    k_ptr,  # [P, S, Di]
    page_table_ptr,  # [B, W]
    seq_lens_ptr,  # [B]
    out_ptr,  # [B, W*S] float32
    scale,
    stride_qb,
    stride_qh,
    stride_wb,
    stride_kp,
    stride_ks,
    stride_pt,
    num_heads,
    head_dim,
    width_tokens,
    PAGE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    b = tl.program_id(0)
    block = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    pos = block * BLOCK_L + tl.arange(0, BLOCK_L)
    in_row = pos < width_tokens
    valid = in_row & (pos < seq_len)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    q_offsets = b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + dims[None, :]
    q_mask = (heads[:, None] < num_heads) & (dims[None, :] < head_dim)
    q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0)  # [H, D]
    w_offsets = b.to(tl.int64) * stride_wb + heads
    w = tl.load(weights_ptr + w_offsets, mask=heads < num_heads, other=0.0).to(tl.float32)
    page_offsets = b.to(tl.int64) * stride_pt + pos // PAGE
    pages = tl.load(page_table_ptr + page_offsets, mask=valid, other=0).to(tl.int64)
    k_offsets = pages[:, None] * stride_kp + (pos % PAGE)[:, None] * stride_ks + dims[None, :]
    k_mask = valid[:, None] & (dims[None, :] < head_dim)
    k = tl.load(k_ptr + k_offsets, mask=k_mask, other=0.0)  # [L, D]
    scores = dot_acc(tl.zeros((BLOCK_H, BLOCK_L), tl.float32), q, tl.trans(k), DOT_FP32) * scale
    scores = tl.maximum(scores, 0.0)
    index = tl.sum(w[:, None] * scores, axis=0)  # [L]
    index = tl.where(valid, index, float("-inf"))
    tl.store(out_ptr + b.to(tl.int64) * width_tokens + pos, index, mask=in_row)


_index_scores_tuned = autotuned(
    _index_scores_kernel,
    [
        triton.Config({"BLOCK_L": block}, num_warps=warps)
        for block, warps in ((16, 2), (32, 4), (64, 4), (64, 8), (128, 8))
    ],
    key=["num_heads", "head_dim", "PAGE"],
)


def index_scores_decode(
    q: torch.Tensor,  # [B, Hi, Di] rotated indexer queries
    weights: torch.Tensor,  # [B, Hi] float32
    k_cache: torch.Tensor,  # [P, S, Di]
    page_table: torch.Tensor,  # [B, W] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
) -> torch.Tensor:  # [B, W*S] float32, -inf past each request's keys
    _check_device(q, weights, k_cache, page_table, seq_lens)
    b, num_heads, head_dim = q.shape
    page = k_cache.shape[1]
    width_tokens = page_table.shape[1] * page
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("the last dim of q and of the key cache must be contiguous")
    weights = weights.float().contiguous()
    out = torch.empty(b, width_tokens, dtype=torch.float32, device=q.device)
    if b and width_tokens:
        kernel, fixed = tuned_or_fixed(_index_scores_tuned, BLOCK_L=INTERPRETED_BLOCK_L)
        kernel[lambda meta: (b, triton.cdiv(width_tokens, meta["BLOCK_L"]))](
            q, weights, k_cache, page_table, seq_lens, out, scale,
            q.stride(0), q.stride(1), weights.stride(0), k_cache.stride(0), k_cache.stride(1),
            page_table.stride(0), num_heads, head_dim, width_tokens,
            PAGE=page, DOT_FP32=dot_in_fp32(q.dtype) or q.dtype != k_cache.dtype,
            BLOCK_H=max(16, triton.next_power_of_2(num_heads)),
            BLOCK_D=max(16, triton.next_power_of_2(head_dim)), **fixed,
        )  # fmt: skip
    return out


def indexer_topk_decode(
    q, weights, k_cache, page_table, seq_lens, topk: int, scale: float, select: bool = False
):
    """`[B, topk]` int32 key positions per request (see the module docstring); `select`: picked
    by `select_topk_decode` where the row fits it, else (and by default) by the reference."""
    scores = index_scores_decode(q, weights, k_cache, page_table, seq_lens, scale)
    if select and select_width(scores.shape[1], topk) <= SELECT_MAX_WIDTH:
        return select_topk_decode(scores, seq_lens, topk)
    return select_topk(scores, seq_lens, topk)


# NOTE: a row is sorted in one program's registers: 8192 int64 keys over 8 warps, 32 a thread
SELECT_MAX_WIDTH = 8192


def select_width(width: int, topk: int) -> int:
    """The sorted row's length for `width` scores and `topk` picks: a power of two."""
    return triton.next_power_of_2(max(width, topk, 2))


@triton.jit
def _select_topk_kernel(scores_ptr, seq_lens_ptr, out_ptr, width, topk, N: tl.constexpr):
    # one program per request. A request with at most topk keys takes them all, in order; else
    # its row's scores are made int64 keys that order as (score, -position) (unique, so the sort
    # needs no stability), sorted descending in registers
    b = tl.program_id(0).to(tl.int64)
    pos = tl.arange(0, N)
    seq_len = tl.load(seq_lens_ptr + b)
    if seq_len <= topk:
        picked = pos.to(tl.int64)
    else:
        score = tl.load(scores_ptr + b * width + pos, mask=pos < width, other=float("-inf"))
        score = tl.where(score == 0.0, 0.0, score)  # -0.0 ties with 0.0, as in float compares
        bits = score.to(tl.int32, bitcast=True)
        ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # float order as int32 order
        low = 0xFFFFFFFF - pos.to(tl.int64)  # the earlier position, the larger key
        key = tl.sort((ordered.to(tl.int64) << 32) | low, descending=True)
        picked = 0xFFFFFFFF - (key & 0xFFFFFFFF)
    picked = tl.where(picked < seq_len, picked, -1)
    tl.store(out_ptr + b * topk + pos, picked.to(tl.int32), mask=pos < topk)


_select_topk_tuned = autotuned(
    _select_topk_kernel, [triton.Config({}, num_warps=w) for w in (4, 8, 16)], key=["N"]
)


def select_topk_decode(scores: torch.Tensor, seq_lens: torch.Tensor, topk: int) -> torch.Tensor:
    """`torch_ref.select_topk` in one launch, for rows of up to `SELECT_MAX_WIDTH` scores: the
    same picks (a request's keys in order where they all fit, else highest first, the earlier
    key first among equals; -1 past the keys), where the reference pads, sorts every row with a
    stable radix sort, slices and masks. A request whose keys all fit sorts nothing."""
    _check_device(scores, seq_lens)
    rows, width = scores.shape
    n = select_width(width, topk)
    if n > SELECT_MAX_WIDTH:
        raise ValueError(f"rows of {width} scores and topk {topk} exceed {SELECT_MAX_WIDTH}")
    out = torch.empty(rows, topk, dtype=torch.int32, device=scores.device)
    if rows:
        kernel, fixed = tuned_or_fixed(_select_topk_tuned, num_warps=4)
        kernel[(rows,)](scores.float().contiguous(), seq_lens, out, width, topk, N=n, **fixed)
    return out


@triton.jit
def _index_scores_prefill_kernel(
    q_ptr,  # [T, Hi, Di]
    weights_ptr,  # [T, Hi] float32
    k_ptr,  # [L, Di]
    out_ptr,  # [T, L] float32
    scale,
    stride_qt,
    stride_qh,
    stride_wt,
    stride_kl,
    num_tokens,
    num_keys,
    q_offset,
    num_heads,
    head_dim,
    DOT_FP32: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    keys = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    dims = tl.arange(0, BLOCK_D)
    token_mask = tokens < num_tokens
    positions = q_offset + tokens  # each query's own position: it sees keys up to it
    visible = (keys[None, :] <= positions[:, None]) & (keys[None, :] < num_keys)
    index = tl.zeros((BLOCK_Q, BLOCK_L), dtype=tl.float32)
    zeros = tl.zeros((BLOCK_Q, BLOCK_L), dtype=tl.float32)
    last = q_offset + tl.minimum(tl.program_id(0) * BLOCK_Q + BLOCK_Q, num_tokens) - 1
    if tl.program_id(1) * BLOCK_L <= last:  # else every key of the block is in the future
        k_mask = (keys[:, None] < num_keys) & (dims[None, :] < head_dim)
        k_offsets = keys.to(tl.int64)[:, None] * stride_kl + dims[None, :]
        k = tl.load(k_ptr + k_offsets, mask=k_mask, other=0.0)  # [L, D]
        q_mask = token_mask[:, None] & (dims[None, :] < head_dim)
        for h in range(0, num_heads):
            q_offsets = tokens.to(tl.int64)[:, None] * stride_qt + h * stride_qh + dims[None, :]
            q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0)  # [Q, D]
            scores = dot_acc(zeros, q, tl.trans(k), DOT_FP32) * scale  # [Q, L]
            w = tl.load(
                weights_ptr + tokens.to(tl.int64) * stride_wt + h, mask=token_mask, other=0.0
            )
            index += w.to(tl.float32)[:, None] * tl.maximum(scores, 0.0)
    index = tl.where(visible, index, float("-inf"))
    out_offsets = tokens.to(tl.int64)[:, None] * num_keys + keys[None, :]
    out_mask = token_mask[:, None] & (keys[None, :] < num_keys)
    tl.store(out_ptr + out_offsets, index, mask=out_mask)


_index_scores_prefill_tuned = autotuned(
    _index_scores_prefill_kernel,
    [
        triton.Config({"BLOCK_Q": bq, "BLOCK_L": bl}, num_warps=warps)
        for bq, bl, warps in ((16, 64, 4), (32, 64, 4), (32, 128, 8), (64, 64, 8), (64, 128, 8))
    ],
    key=["num_heads", "head_dim"],
)


def index_scores_prefill(
    q: torch.Tensor,  # [T, Hi, Di] one request's rotated indexer queries, positions q_offset..
    weights: torch.Tensor,  # [T, Hi] float32
    k: torch.Tensor,  # [L, Di] the request's keys, position order (L >= q_offset + T)
    q_offset: int,
    scale: float,
) -> torch.Tensor:  # [T, L] float32, -inf at keys after each query
    """`torch_ref.index_scores_one_seq`: `sum_h weights[t, h] * relu(scale * q[t, h] . k[l])`
    for every query `t` of one request's chunk and key `l` up to its position."""
    _check_device(q, weights, k)
    num_tokens, num_heads, head_dim = q.shape
    num_keys = k.shape[0]
    if k.shape[1] != head_dim or weights.shape != (num_tokens, num_heads):
        raise ValueError(
            f"q {tuple(q.shape)}, weights {tuple(weights.shape)} and k {tuple(k.shape)} do not "
            "line up"
        )
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("the last dim of q and of k must be contiguous")
    weights = weights.float().contiguous()
    out = torch.empty(num_tokens, num_keys, dtype=torch.float32, device=q.device)
    if num_tokens and num_keys:
        kernel, fixed = tuned_or_fixed(_index_scores_prefill_tuned, BLOCK_Q=16, BLOCK_L=32)

        def grid(meta):
            return (
                triton.cdiv(num_tokens, meta["BLOCK_Q"]),
                triton.cdiv(num_keys, meta["BLOCK_L"]),
            )

        kernel[grid](
            q, weights, k, out, scale, q.stride(0), q.stride(1), weights.stride(0), k.stride(0),
            num_tokens, num_keys, q_offset, num_heads, head_dim,
            DOT_FP32=dot_in_fp32(q.dtype) or q.dtype != k.dtype,
            BLOCK_D=max(16, triton.next_power_of_2(head_dim)), **fixed,
        )  # fmt: skip
    return out


@triton.jit
def _fill_kv_indices_kernel(
    kv_indices_ptr,  # [>= total keys] int32
    topk_ptr,  # [T, topk] int32 key positions within the request, -1 = none
    page_table_ptr,  # [T, W] int32, row strides stride_pt
    kv_indptr_ptr,  # [T+1] int32
    topk,
    stride_pt,
    PAGE: tl.constexpr,
    N: tl.constexpr,
):
    # one program per query row: its selected keys' cache slots, compacted in selection order
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, N)
    pos = tl.load(topk_ptr + t * topk + j, mask=j < topk, other=-1)
    valid = pos >= 0
    start = tl.load(kv_indptr_ptr + t)
    count = tl.load(kv_indptr_ptr + t + 1) - start
    rank = tl.cumsum(valid.to(tl.int32), axis=0)  # 1-based among the row's selected keys
    valid = valid & (rank <= count)
    pos = tl.where(valid, pos, 0)
    page = tl.load(page_table_ptr + t * stride_pt + pos // PAGE, mask=valid, other=0)
    slot = page.to(tl.int64) * PAGE + pos % PAGE
    tl.store(kv_indices_ptr + start + rank - 1, slot.to(tl.int32), mask=valid)


_fill_kv_indices_tuned = autotuned(
    _fill_kv_indices_kernel, [triton.Config({}, num_warps=w) for w in (4, 8)], key=["N", "PAGE"]
)


def fill_kv_indices(kv_indices, topk_indices, page_table, kv_indptr, page_size: int) -> None:
    """`flashinfer.mla.fill_kv_indices` (its reference: the same contract) in one launch, where
    the reference runs about a dozen small torch kernels per layer: each row's selected keys
    as cache slots from `kv_indptr[t]` on, cut at the row's planned count. Leaves the unwritten
    elements as they were (the reference writes its cut keys into `kv_indices`' last element,
    which no row reads)."""
    _check_device(kv_indices, topk_indices, page_table, kv_indptr)
    rows, topk = topk_indices.shape
    if page_table.shape[0] != rows or kv_indptr.shape[0] != rows + 1:
        raise ValueError(
            f"{rows} top-k rows need as many page-table rows and {rows + 1} kv_indptr entries, "
            f"got {page_table.shape[0]} and {kv_indptr.shape[0]}"
        )
    if page_table.stride(-1) != 1:
        page_table = page_table.contiguous()
    if rows:
        kernel, fixed = tuned_or_fixed(_fill_kv_indices_tuned, num_warps=4)
        kernel[(rows,)](
            kv_indices,
            topk_indices.contiguous(),
            page_table,
            kv_indptr,
            topk,
            page_table.stride(0),
            PAGE=page_size,
            N=triton.next_power_of_2(max(topk, 2)),
            **fixed,
        )
