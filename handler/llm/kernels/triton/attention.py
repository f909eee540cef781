"""Paged decode attention in Triton (split-KV), matching `torch_ref.decode_attention`.

    out = paged_decode_attention(q, k_cache, v_cache, page_table, seq_lens, scale)

The reference gathers every request's whole page row (`W` pages, the graph bucket's width)
before it scores; this reads only the pages that hold the request's tokens. One program per
(request, KV head, split of the row's tokens) scores the KV head's group of query heads against
`BLOCK_T` tokens at a time (gathered from their pages) on tensor cores, the group padded to 16
rows, with an online softmax in float32, and writes its partial output and log-sum-exp; a
second kernel combines each head's splits by their log-sum-exp. Probabilities are rounded to
the cache's dtype before they multiply the values, as the reference rounds them. The grid
depends on shapes only, and nothing syncs with the host, so both run inside captured CUDA
graphs; a split past a request's last token reads nothing.

The kernels' warps and pipeline depth are autotuned on GPUs once per (query heads per KV head,
head dims, dtypes), not per batch or page-row width, with triton's results cache on
(`triton.kernels.autotuned`); the interpreter runs them untuned.

NOTE: imports triton at import time, like kernels.py (see there); `TRITON_INTERPRET=1`
before the first import runs it on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from snapfn.handler.llm.kernels.triton.kernels import (
    _check_device,
    autotuned,
    dot_acc,
    dot_in_fp32,
    tuned_or_fixed,
)

TARGET_PROGRAMS = 256  # splits are added until requests x head groups x splits reaches this
MAX_SPLITS = 64  # what one combine program holds
BLOCK_T = 64  # tokens a split program scores at a time


# NOTE: the split count and blocks per split follow the batch and the page-row width, so they are
# plain arguments, not specialised on: an eager batch of a new size or width (past the graphs)
# must not compile a new variant in a request
@triton.jit(do_not_specialize=["num_splits", "blocks_per_split"])
def _decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    page_table_ptr,
    seq_lens_ptr,
    part_ptr,
    lse_ptr,
    scale,
    stride_qb,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_pt,
    num_q_heads,
    page_size,
    num_splits,
    blocks_per_split,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_T: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    t = tl.arange(0, BLOCK_T)
    heads = kv_head * GROUP + g
    q_mask = (g[:, None] < GROUP) & (d[None, :] < D)
    q_offsets = b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0)  # [G, D]
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_DV], tl.float32)
    # NOTE: a fixed trip count, a function of shapes (triton's interpreter cannot loop to a
    # loaded bound); tokens past the request's last are masked and never read
    for i in range(0, blocks_per_split):
        first = (split * blocks_per_split + i) * BLOCK_T
        # NOTE: the trip count is fixed by shapes, the work is not: a block past the
        # request's last token is skipped whole (a branch, no loads, no products)
        if first < seq_len:
            tok = first + t  # [T] positions in the request
            valid = tok < seq_len
            page_offsets = b.to(tl.int64) * stride_pt + tok // page_size
            page = tl.load(page_table_ptr + page_offsets, mask=valid, other=0).to(tl.int64)
            slot = tok % page_size
            k_offsets = (
                page[:, None] * stride_kp
                + slot[:, None] * stride_ks
                + kv_head * stride_kh
                + d[None, :]
            )
            k = tl.load(k_ptr + k_offsets, mask=valid[:, None] & (d[None, :] < D), other=0.0)
            scores = dot_acc(tl.zeros([GROUP_PAD, BLOCK_T], tl.float32), q, tl.trans(k), DOT_FP32)
            scores = tl.where(valid[None, :], scores * scale, float("-inf"))  # [G, T]
            probs, alpha, m_i, l_i = softmax_step(scores, m_i, l_i)
            v_offsets = (
                page[:, None] * stride_vp
                + slot[:, None] * stride_vs
                + kv_head * stride_vh
                + dv[None, :]
            )
            v = tl.load(v_ptr + v_offsets, mask=valid[:, None] & (dv[None, :] < DV), other=0.0)
            # the probabilities rounded to the values' dtype, as the reference rounds them
            acc = dot_acc(acc * alpha[:, None], probs.to(v_ptr.dtype.element_ty), v, DOT_FP32)
    row = (b.to(tl.int64) * num_q_heads + heads) * num_splits + split  # [G] of [B, Hq, splits]
    store_split(part_ptr, lse_ptr, row, g < GROUP, dv, DV, acc, m_i, l_i)


@triton.jit
def softmax_step(scores, m_i, l_i):
    """One block of an online softmax over `scores [rows, T]` (-inf where masked), given the
    running row maxima `m_i` and sums `l_i`: `(probs, alpha, m_i, l_i)` updated, where the
    output so far is to be scaled by `alpha` before `probs @ values` is added."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: exp(-inf) = 0
    alpha = tl.exp(m_i - m_safe)
    probs = tl.exp(scores - m_safe[:, None])
    return probs, alpha, m_new, l_i * alpha + tl.sum(probs, axis=1)


@triton.jit
def store_split(part_ptr, lse_ptr, row, live, cols, width: tl.constexpr, acc, m_i, l_i):
    """A split's normalised output (`acc / l_i`, `[rows, width]` into `part` at `row`) and its
    log-sum-exp; a split that scored nothing (past its request's last key) stores zeros and
    -inf, which `combine_splits` skips."""
    has_keys = l_i > 0
    out = tl.where(has_keys[:, None], acc / tl.where(has_keys, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(has_keys, m_i + tl.log(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    tl.store(lse_ptr + row, lse, mask=live)
    mask = live[:, None] & (cols < width)[None, :]
    tl.store(part_ptr + row[:, None] * width + cols[None, :], out, mask=mask)


# NOTE: the splits (and tokens per split) are not keys: they follow the batch and page-row
# width, which vary between eager batches; the config tuned for the model's heads serves them all
_decode_split_tuned = autotuned(
    _decode_split_kernel,
    [triton.Config({}, num_warps=w, num_stages=s) for w in (2, 4, 8) for s in (1, 3)],
    key=["GROUP", "D", "DV"],
    default=2,  # 4 warps, 1 stage
)


@triton.jit(do_not_specialize=["num_splits"])
def _combine_kernel(
    part_ptr,
    lse_ptr,
    out_ptr,
    num_splits,
    SPLITS_PAD: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    # one program per (request, query head): its splits weighted by exp(lse_s - logsumexp(lse))
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, SPLITS_PAD)
    dv = tl.arange(0, BLOCK_DV)
    lse = tl.load(lse_ptr + row * num_splits + s, mask=s < num_splits, other=float("-inf"))
    top = tl.max(lse, axis=0)
    weights = tl.exp(lse - tl.where(top == float("-inf"), 0.0, top))  # empty splits: 0
    total = tl.sum(weights, axis=0)
    live = weights > 0  # only splits that scored a key are read
    parts = tl.load(
        part_ptr + (row * num_splits + s)[:, None] * DV + dv[None, :],
        mask=live[:, None] & (dv < DV)[None, :],
        other=0.0,
    )
    out = tl.sum(weights[:, None] * parts, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * DV + dv, out.to(out_ptr.dtype.element_ty), mask=dv < DV)


# keyed by the value width alone: the split count follows the batch (see the split kernel)
_combine_tuned = autotuned(
    _combine_kernel, [triton.Config({}, num_warps=w) for w in (1, 2, 4)], key=["DV"]
)


def num_splits(batch: int, groups: int, blocks: int, forced: int | None = None) -> int:
    """Splits of a key row of `blocks` blocks, for programs per (request, one of `groups` head
    groups: KV heads here, `triton.mla`'s head blocks) and split: enough programs to fill the
    GPU, each at least one block, at most `MAX_SPLITS`; `forced` (tests), clamped the same
    way, replaces the count. A function of shapes only, so a captured graph keeps its grid."""
    wanted = forced or -(-TARGET_PROGRAMS // max(1, batch * groups))
    return max(1, min(blocks, wanted, MAX_SPLITS))


def paged_decode_attention(
    q: torch.Tensor,  # [B, Hq, D], one new token per request
    k_cache: torch.Tensor,  # [P, S, Hkv, D]
    v_cache: torch.Tensor,  # [P, S, Hkv, Dv]
    page_table: torch.Tensor,  # [B, W] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    splits: int | None = None,  # default: num_splits(B, Hkv, the row's BLOCK_T blocks)
) -> torch.Tensor:  # [B, Hq, Dv] in v_cache's dtype; a request with no tokens gets zeros
    _check_device(q, k_cache, v_cache, page_table, seq_lens)
    b, hq, d = q.shape
    _, page_size, hkv, dv = v_cache.shape
    if hq % hkv or k_cache.shape[:3] != v_cache.shape[:3] or k_cache.shape[3] != d:
        raise ValueError(
            f"q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache "
            f"{tuple(v_cache.shape)}: heads or head dims do not line up"
        )
    for t in (q, k_cache, v_cache):
        if t.stride(-1) != 1:
            raise ValueError("the last dim of q and of the caches must be contiguous")
    width = page_table.shape[1]
    blocks = -(-width * page_size // BLOCK_T)  # of the page row
    splits = num_splits(b, hkv, blocks, splits)
    part = torch.empty(b, hq, splits, dv, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, hq, splits, dtype=torch.float32, device=q.device)
    out = torch.empty(b, hq, dv, dtype=v_cache.dtype, device=q.device)
    if b:
        group = hq // hkv
        kernel, fixed = tuned_or_fixed(_decode_split_tuned)
        kernel[(b, hkv, splits)](
            q,
            k_cache,
            v_cache,
            page_table,
            seq_lens,
            part,
            lse,
            scale,
            q.stride(0),
            q.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            v_cache.stride(0),
            v_cache.stride(1),
            v_cache.stride(2),
            page_table.stride(0),
            hq,
            page_size,
            splits,
            -(-blocks // splits),
            GROUP=group,
            GROUP_PAD=max(16, triton.next_power_of_2(group)),  # tl.dot's least rows
            D=d,
            DV=dv,
            BLOCK_D=max(16, triton.next_power_of_2(d)),
            BLOCK_DV=max(16, triton.next_power_of_2(dv)),
            BLOCK_T=BLOCK_T,
            DOT_FP32=dot_in_fp32(q.dtype),
            **fixed,
        )
        combine_splits(part, lse, out)
    return out


def combine_splits(part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor) -> None:
    """Each `(request, head)`'s splits, `part [B, H, splits, Dv]` float32 with their
    log-sum-exps `lse [B, H, splits]`, merged into `out [B, H, Dv]` (contiguous). A row whose
    splits all scored nothing gets zeros."""
    b, h, splits, dv = part.shape
    kernel, fixed = tuned_or_fixed(_combine_tuned)
    kernel[(b * h,)](
        part,
        lse,
        out,
        splits,
        SPLITS_PAD=triton.next_power_of_2(splits),
        DV=dv,
        BLOCK_DV=triton.next_power_of_2(dv),
        **fixed,
    )
