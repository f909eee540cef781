"""MLA decode attention over the latent cache in Triton (split-KV), sparse (a DSA top-k per
request) or dense, with no host planning: matches `torch_ref.mla_decode_absorbed`.

    out = mla_decode(q, latent_cache, kv_b, page_table, seq_lens, scale, topk_indices)
    out_latent = mla_decode_latent(q_latent, q_pe, latent_cache, page_table, seq_lens, scale,
                                   topk_indices)  # the attention alone, kv_b absorbed by the caller

`kv_b` is absorbed as FlashMLA and `flashinfer.mla` do it (`torch_ref.absorb_query`,
`expand_output`):
each head's query becomes `W_k^T q_nope` in latent space beside its RoPE part, every key is a
cached latent `c | k_rope` that all heads share, and the head's output is `W_v (sum p c)`. So
the attention itself is one "KV head" of width `R + Dr` (576 for GLM-5) under `H` query heads,
its values the keys' first `R` columns.

One program per (request, block of `BLOCK_H` heads, split of the request's key list) scores its
heads against `BLOCK_T` keys at a time on tensor cores, with an online softmax in float32, and
writes its partial output and log-sum-exp; `triton.attention`'s combine kernel merges each
head's splits. A request's key list is its top-k row (`topk_indices`: key positions within the
request, `-1` past the last; `dsa_topk` fills a row's first `min(seq_len, topk)` entries), or,
dense, its positions `0 .. seq_len - 1`. A key position becomes a cache slot through the
request's page-table row in the kernel, so nothing runs on the host before a step: the grid
and trip counts follow shapes only, and both kernels run inside captured CUDA graphs. This is
what flashinfer's MLA needs a per-step `plan()` for (its schedule, computed on the host and
copied to the GPU; 13-15 us of pinned copy a step in the H200 profiles recorded in commits
22ad861 and 07522b8), and a
`fill_kv_indices` launch per layer.

Probabilities are rounded to the cache's dtype before they multiply the values, as the
reference's float32 sums would not: that is flashinfer's and `triton.attention`'s rounding.
The warps and pipeline depth are autotuned once per (heads, latent widths, dtypes).

NOTE: imports triton at import time, like kernels.py; `TRITON_INTERPRET=1` before the
first import runs it on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from snapfn.handler.llm.kernels.torch_ref import absorb_query, expand_output
from snapfn.handler.llm.kernels.triton.attention import (
    combine_splits,
    num_splits,
    softmax_step,
    store_split,
)
from snapfn.handler.llm.kernels.triton.kernels import (
    _check_device,
    autotuned,
    dot_acc,
    dot_in_fp32,
    tuned_or_fixed,
)

BLOCK_H = 16  # heads a program scores together: tl.dot's least rows
BLOCK_T = 32  # keys a program scores at a time ([32, 512] bf16 latents: 32 KB a step)


# NOTE: the splits and blocks per split follow the batch and the key list's length, so they are
# plain arguments (see triton.attention's split kernel)
@triton.jit(do_not_specialize=["num_splits", "blocks_per_split"])
def _mla_split_kernel(
    q_lat_ptr,
    q_pe_ptr,
    cache_ptr,
    page_table_ptr,
    seq_lens_ptr,
    topk_ptr,
    part_ptr,
    lse_ptr,
    scale,
    stride_lb,
    stride_lh,
    stride_pb,
    stride_ph,
    stride_cp,
    stride_cs,
    stride_pt,
    stride_tk,
    num_heads,
    page_size,
    num_splits,
    blocks_per_split,
    TOPK: tl.constexpr,  # 0: dense, every position below the request's length
    R: tl.constexpr,
    DR: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_T: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    b = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    live = heads < num_heads
    r = tl.arange(0, BLOCK_R)
    dr = tl.arange(0, BLOCK_DR)
    t = tl.arange(0, BLOCK_T)
    seq_len = tl.load(seq_lens_ptr + b)
    # the key list's filled entries: a top-k row's first min(seq_len, topk), or every position
    entries = tl.minimum(seq_len, TOPK) if TOPK > 0 else seq_len
    q_lat = tl.load(
        q_lat_ptr + b.to(tl.int64) * stride_lb + heads[:, None] * stride_lh + r[None, :],
        mask=live[:, None] & (r[None, :] < R),
        other=0.0,
    )  # [H, R]
    q_pe = tl.load(
        q_pe_ptr + b.to(tl.int64) * stride_pb + heads[:, None] * stride_ph + dr[None, :],
        mask=live[:, None] & (dr[None, :] < DR),
        other=0.0,
    )  # [H, Dr]
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    # NOTE: a trip count fixed by shapes (the interpreter cannot loop to a loaded bound); a
    # block past the list's filled entries is skipped whole (a branch: no loads, no products)
    for i in range(0, blocks_per_split):
        first = (split * blocks_per_split + i) * BLOCK_T
        if first < entries:
            j = first + t  # [T] entries of the key list
            listed = j < entries
            if TOPK > 0:
                pos = tl.load(topk_ptr + b.to(tl.int64) * stride_tk + j, mask=listed, other=-1)
                valid = listed & (pos >= 0) & (pos < seq_len)
            else:
                pos = j
                valid = listed
            pos = tl.where(valid, pos, 0)
            page = tl.load(
                page_table_ptr + b.to(tl.int64) * stride_pt + pos // page_size,
                mask=valid,
                other=0,
            ).to(tl.int64)
            row = page * stride_cp + (pos % page_size) * stride_cs  # [T] cache rows
            c = tl.load(
                cache_ptr + row[:, None] + r[None, :],
                mask=valid[:, None] & (r[None, :] < R),
                other=0.0,
            )  # [T, R]: keys' latent part, and the values
            k_pe = tl.load(
                cache_ptr + row[:, None] + R + dr[None, :],
                mask=valid[:, None] & (dr[None, :] < DR),
                other=0.0,
            )  # [T, Dr]
            scores = dot_acc(tl.zeros([BLOCK_H, BLOCK_T], tl.float32), q_lat, tl.trans(c), DOT_FP32)
            scores = dot_acc(scores, q_pe, tl.trans(k_pe), DOT_FP32)
            scores = tl.where(valid[None, :], scores * scale, float("-inf"))  # [H, T]
            probs, alpha, m_i, l_i = softmax_step(scores, m_i, l_i)
            # the probabilities rounded to the cache's dtype, as flashinfer rounds them
            probs = probs.to(cache_ptr.dtype.element_ty)
            acc = dot_acc(acc * alpha[:, None], probs, c, DOT_FP32)
    at = (b.to(tl.int64) * num_heads + heads) * num_splits + split  # [H] of [B, H, splits]
    store_split(part_ptr, lse_ptr, at, live, r, R, acc, m_i, l_i)


# NOTE: the splits (and blocks per split) are not keys: they follow the batch and the list's
# length; the config tuned for the model's heads and widths serves them all
_mla_split_tuned = autotuned(
    _mla_split_kernel,
    [triton.Config({}, num_warps=w, num_stages=s) for w in (4, 8) for s in (1, 2)],
    key=["R", "DR", "TOPK"],
)


def takes(q: torch.Tensor, latent_cache: torch.Tensor, rank: int) -> bool:
    """Whether `mla_decode` runs this attention: q and the cache of one dtype (16-bit, or
    float32 as the tests run), a rope part, and a contiguous latent row."""
    rope = latent_cache.shape[-1] - rank
    return q.dtype == latent_cache.dtype and 0 < rope < q.shape[-1] and latent_cache.stride(-1) == 1


def mla_decode(
    q: torch.Tensor,  # [B, H, Dn + Dr], one new token per request
    latent_cache: torch.Tensor,  # [P, S, R + Dr]: normalised latents | rotated k_rope
    kv_b: torch.Tensor,  # [H * (Dn + Dv), R] dense, q's dtype
    page_table: torch.Tensor,  # [B, W] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    topk_indices: torch.Tensor | None = None,  # [B, topk] int32, -1 = none; None = dense
    splits: int | None = None,  # default: triton.attention.num_splits's
) -> torch.Tensor:  # [B, H, Dv] in q's dtype; a request with no keys gets zeros
    """Decode MLA attention (module docstring): `mla_decode_absorbed`'s result, `kv_b`
    absorbed by `torch_ref`'s bmms around `mla_decode_latent`."""
    rank = kv_b.shape[1]
    if not takes(q, latent_cache, rank):
        raise ValueError(
            f"q {tuple(q.shape)} {q.dtype} and latent cache {tuple(latent_cache.shape)} "
            f"{latent_cache.dtype} (rank {rank}) do not line up"
        )
    q_lat, q_pe, w_v = absorb_query(q, kv_b, rank, latent_cache.shape[-1] - rank)
    out_latent = mla_decode_latent(
        q_lat, q_pe, latent_cache, page_table, seq_lens, scale, topk_indices, splits
    )
    return expand_output(out_latent, w_v)


def mla_decode_latent(
    q_lat: torch.Tensor,  # [B, H, R]: each head's W_k^T q_nope
    q_pe: torch.Tensor,  # [B, H, Dr]
    latent_cache: torch.Tensor,  # [P, S, R + Dr]
    page_table: torch.Tensor,  # [B, W] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    topk_indices: torch.Tensor | None = None,  # [B, topk] int32, -1 = none; None = dense
    splits: int | None = None,
) -> torch.Tensor:  # [B, H, R] in q_lat's dtype: sum p c, before W_v
    """The latent attention of `mla_decode`, for a caller that absorbs `kv_b` itself (the
    backends, with `triton.absorb` reading an FP8 `kv_b` as stored)."""
    _check_device(q_lat, q_pe, latent_cache, page_table, seq_lens, topk_indices)
    b, heads, rank = q_lat.shape
    rope = latent_cache.shape[-1] - rank
    out_latent = torch.empty(b, heads, rank, dtype=q_lat.dtype, device=q_lat.device)
    if b:
        page_size = latent_cache.shape[1]
        topk = 0 if topk_indices is None else topk_indices.shape[1]
        entries = topk or page_table.shape[1] * page_size  # the longest key list
        blocks = -(-entries // BLOCK_T)
        head_blocks = -(-heads // BLOCK_H)
        splits = num_splits(b, head_blocks, blocks, splits)
        part = torch.empty(b, heads, splits, rank, dtype=torch.float32, device=q_lat.device)
        lse = torch.empty(b, heads, splits, dtype=torch.float32, device=q_lat.device)
        topk_arg = topk_indices if topk_indices is not None else seq_lens  # unread when dense
        kernel, fixed = tuned_or_fixed(_mla_split_tuned)
        kernel[(b, head_blocks, splits)](
            q_lat,
            q_pe,
            latent_cache,
            page_table,
            seq_lens,
            topk_arg,
            part,
            lse,
            scale,
            q_lat.stride(0),
            q_lat.stride(1),
            q_pe.stride(0),
            q_pe.stride(1),
            latent_cache.stride(0),
            latent_cache.stride(1),
            page_table.stride(0),
            topk_arg.stride(0),
            heads,
            page_size,
            splits,
            -(-blocks // splits),
            TOPK=topk,
            R=rank,
            DR=rope,
            BLOCK_R=triton.next_power_of_2(rank),
            BLOCK_DR=max(16, triton.next_power_of_2(rope)),
            BLOCK_H=BLOCK_H,
            BLOCK_T=BLOCK_T,
            DOT_FP32=dot_in_fp32(q_lat.dtype),
            **fixed,
        )
        combine_splits(part, lse, out_latent)
    return out_latent
