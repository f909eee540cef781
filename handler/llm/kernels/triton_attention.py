"""Paged decode attention in Triton (split-KV), matching `torch_ref.decode_attention`.

    out = paged_decode_attention(q, k_cache, v_cache, page_table, seq_lens, scale)

The reference gathers every request's whole page row (`W` pages, the graph bucket's width)
before it scores; this reads only the pages that hold the request's tokens. One program per
(request, KV head, split of the page row) scores the KV head's group of query heads against
each page's keys in float32 with an online softmax and writes its partial output and
log-sum-exp; the splits are then combined by their log-sum-exp (in torch). The grid depends on
shapes only and nothing syncs with the host, so it runs inside captured CUDA graphs.

The kernel's warps and pipeline depth are autotuned on GPUs once per (query heads per KV head,
page size, head dims, dtypes), not per batch or page-row width, with triton's results cache on
(`triton_kernels.autotuned`); the interpreter runs it untuned.

NOTE: imports triton at import time, like triton_kernels.py (see there); `TRITON_INTERPRET=1`
before the first import runs it on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_kernels import _check_device, autotuned, tuned_or_fixed

TARGET_PROGRAMS = 256  # splits are added until requests x KV heads x splits reaches this


@triton.jit
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
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    PAGE: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PAGES_PER_SPLIT: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    s = tl.arange(0, PAGE)
    heads = kv_head * GROUP + g
    q_mask = (g[:, None] < GROUP) & (d[None, :] < D)
    q_offsets = b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0).to(tl.float32)  # [G, D]
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_DV], tl.float32)
    # NOTE: a fixed trip count, a function of shapes (triton's interpreter cannot loop to a
    # loaded bound); pages past the request's last are masked and never read
    for i in range(0, PAGES_PER_SPLIT):
        p = split * PAGES_PER_SPLIT + i
        has_page = p * PAGE < seq_len
        page_offset = b.to(tl.int64) * stride_pt + p
        page = tl.load(page_table_ptr + page_offset, mask=has_page, other=0).to(tl.int64)
        valid = p * PAGE + s < seq_len  # [S]
        k_offsets = page * stride_kp + s[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
        k_mask = valid[:, None] & (d[None, :] < D)
        k = tl.load(k_ptr + k_offsets, mask=k_mask, other=0.0).to(tl.float32)  # [S, D]
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G, S]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: exp(-inf) = 0
        alpha = tl.exp(m_i - m_safe)
        probs = tl.exp(scores - m_safe[:, None])  # [G, S]
        l_i = l_i * alpha + tl.sum(probs, axis=1)
        v_offsets = page * stride_vp + s[:, None] * stride_vs + kv_head * stride_vh + dv[None, :]
        v_mask = valid[:, None] & (dv[None, :] < DV)
        v = tl.load(v_ptr + v_offsets, mask=v_mask, other=0.0).to(tl.float32)  # [S, DV]
        acc = acc * alpha[:, None] + tl.sum(probs[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    has_keys = l_i > 0  # a split past the request's last page scored nothing
    out = tl.where(has_keys[:, None], acc / tl.where(has_keys, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(has_keys, m_i + tl.log(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    row = (b.to(tl.int64) * num_q_heads + heads) * NUM_SPLITS + split  # [G] of [B, Hq, splits]
    live = g < GROUP
    tl.store(lse_ptr + row, lse, mask=live)
    tl.store(
        part_ptr + row[:, None] * DV + dv[None, :], out, mask=live[:, None] & (dv < DV)[None, :]
    )


# NOTE: the splits (and pages per split) are not keys: they follow the batch and page-row width,
# which vary between eager batches; the config tuned for the model's heads serves them all
_decode_split_tuned = autotuned(
    _decode_split_kernel,
    [triton.Config({}, num_warps=w, num_stages=s) for w in (2, 4, 8) for s in (1, 3)],
    key=["GROUP", "PAGE", "D", "DV"],
)


def num_splits(batch: int, num_kv_heads: int, width: int) -> int:
    """Splits of a page row of `width` pages: enough programs to fill the GPU, at most one
    page per split. A function of shapes only, so a captured graph keeps its grid."""
    return max(1, min(width, -(-TARGET_PROGRAMS // max(1, batch * num_kv_heads))))


def paged_decode_attention(
    q: torch.Tensor,  # [B, Hq, D], one new token per request
    k_cache: torch.Tensor,  # [P, S, Hkv, D]
    v_cache: torch.Tensor,  # [P, S, Hkv, Dv]
    page_table: torch.Tensor,  # [B, W] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    splits: int | None = None,  # default: num_splits(B, Hkv, W)
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
    splits = max(1, min(width, splits or num_splits(b, hkv, width)))
    part = torch.empty(b, hq, splits, dv, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, hq, splits, dtype=torch.float32, device=q.device)
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
            GROUP=group,
            GROUP_PAD=triton.next_power_of_2(group),
            PAGE=page_size,
            D=d,
            DV=dv,
            BLOCK_D=triton.next_power_of_2(d),
            BLOCK_DV=triton.next_power_of_2(dv),
            NUM_SPLITS=splits,
            PAGES_PER_SPLIT=-(-width // splits),
            **fixed,
        )
    # combine the splits by their log-sum-exp: weight_s = exp(lse_s - logsumexp(lse))
    total = torch.logsumexp(lse, dim=-1, keepdim=True)  # [B, Hq, 1]; -inf: no tokens at all
    weights = torch.exp(lse - total.clamp_min(torch.finfo(torch.float32).min)).nan_to_num_(0.0)
    out = (weights.unsqueeze(-1) * part).sum(dim=2)  # [B, Hq, Dv]
    return out.to(v_cache.dtype)
