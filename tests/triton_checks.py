"""Triton kernels against the torch reference, case by case, on one device.

`python -m triton_checks --device cpu` (with `TRITON_INTERPRET=1`, set before triton is
imported) runs every case and prints one JSON line per case; `tests/test_triton_kernels.py`
runs it in a subprocess on CPU and calls `run_case` in-process on CUDA.
`python -m triton_checks --device cuda --autotune-once` calls each autotuned kernel once at a
model's shapes (the autotune cache test runs it twice over one `TRITON_CACHE_DIR`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from unittest import mock

import torch

from snapfn.handler.llm.models.layers import RMSNorm
from snapfn.handler.llm.weights.quant import dequantize_fp8_block, quantize_fp8_block

# NOTE: triton's interpreter (3.7.1, 3.9.0) casts float32 to bfloat16 by truncation, where compiled
# kernels and torch round to nearest even. So on CPU a bf16 result is compared with the float32
# value truncated (`_round`), exactly where the kernel's last step is that one cast.
BF16_ULP = 2**-7  # relative spacing of bf16 values at the bottom of a binade
# RMSNorm (atol, rtol), compiled / interpreted: the row sum's order and rsqrt differ from
# torch's in the last float32 bits, which may flip the bf16 rounding of the normalised value
# (1 ulp) and then of its product with the weight; truncation adds up to 1 ulp more.
RMS_TOL = {
    (torch.float32, False): (1e-5, 1e-5),
    (torch.float32, True): (1e-5, 1e-5),
    (torch.bfloat16, False): (1e-6, 2 * BF16_ULP),
    (torch.bfloat16, True): (1e-6, 3 * BF16_ULP),
}
EXACT = (0.0, 0.0)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# hidden sizes: tiny test models (64), Llama head_dim q/k-norm (128), MLA kv latent rank (512),
# a non-power of two (GLM-5's 6144 is 3 * 2^11; 96 keeps the masking case small)
RMS_SHAPES = {"tiny": (5, 64), "heads": (3, 4, 128), "latent": (7, 512), "odd": (4, 96)}
# [N, K] and stacked experts [E, N, K]; partial edge blocks included
FP8_SHAPES = {"square": (256, 128), "edges": (300, 200), "experts": (3, 136, 260)}

# fused FP8 GEMM: (rows of x, N, K): decode rows, partial blocks both ways, a prefill-sized tile
FP8_GEMM_SHAPES = {"decode": (1, 384, 256), "edges": (5, 200, 136), "rows": (70, 256, 384)}
# K split (`splits`): 3 ways over 5 scale blocks (the last split shorter), 4 over 3 (one empty)
FP8_GEMM_SHAPES |= {"decode_split3": (1, 384, 600), "edges_split4": (5, 200, 300)}
# (atol, rtol) against F.linear over the same dequantized weight: float32 sums in another order
FP8_GEMM_TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2)}

# paged decode: (requests, q heads, kv heads, head dim, page size, page-row width, seq lens)
DECODE_SHAPES = {
    "gqa": (3, 8, 2, 64, 16, 6, (1, 40, 96)),  # a one-token request, a partial last page
    "mha": (2, 4, 4, 32, 16, 3, (16, 33)),
    "llama8b": (2, 32, 8, 128, 16, 9, (130, 7)),  # the 8B's heads; a row wider than needed
    "odd": (2, 6, 2, 48, 8, 5, (0, 23)),  # group of 3, head dim 48, a request with no tokens
}
# splits forced: the whole row in one split, so that one program walks two 64-token blocks, and
# two splits
DECODE_SPLITS = {"gqa": None, "mha": None, "llama8b": None, "odd": None, "gqa1": 1, "gqa2": 2}
DECODE_SHAPES |= {"gqa1": DECODE_SHAPES["gqa"], "gqa2": DECODE_SHAPES["gqa"]}
# decode attention (atol, rtol) against the float32 reference: float32 sums in another order;
# bf16 inputs are exact in float32 and the output is rounded once (reference: twice, probs too)
DECODE_TOL = {torch.float32: (2e-6, 1e-5), torch.bfloat16: (2e-2, 2e-2)}

# routed experts: (tokens, top-k, local experts, first local expert, of all experts, hidden,
# intermediate); sizes off the 16/32 block grid, and ep ranks whose pairs partly go elsewhere
MOE_SHAPES = {
    "decode": (3, 2, 4, 0, 4, 48, 40),
    "prefill": (37, 4, 8, 0, 8, 64, 96),
    "ep_rank1": (20, 3, 4, 4, 8, 32, 24),  # experts 4-7 of 8: about half the pairs are elsewhere
    "fp8": (9, 2, 4, 0, 4, 160, 136),  # FP8 experts: partial 128-blocks both ways
    "fp8_prefill": (25, 2, 2, 0, 3, 160, 136),  # FP8, 64-row tiles, a third of pairs elsewhere
    # one token: `moe_gemv`, each slot's expert read as matrix-vector products
    "gemv": (1, 4, 8, 0, 8, 48, 40),
    "gemv_ep": (1, 4, 4, 4, 8, 32, 24),  # experts 4-7 of 8: some slots elsewhere
    "gemv_fp8": (1, 4, 6, 0, 6, 160, 136),  # partial 128-blocks both ways
    # a verify step's few tokens, some picking the same experts
    "gemv_tokens3": (3, 4, 8, 0, 8, 48, 40),
    "gemv_ep_tokens2": (2, 4, 4, 4, 8, 32, 24),
    "gemv_fp8_tokens4": (4, 4, 6, 0, 6, 160, 136),
}
MOE_PREFILL_SIZED = {"prefill", "fp8_prefill"}  # > 16 pairs per local expert: 64-row tiles
MOE_TOL = {torch.float32: (2e-5, 1e-4), torch.bfloat16: (3e-2, 0.0)}  # bf16: x max|out|

# RoPE + cache write: (tokens, q heads, kv heads, head dim, pages, page size, interleaved); q, k
# and v are views of one fused projection's output, as the llama model passes them
ROPE_SHAPES = {
    "llama8b": (5, 32, 8, 128, 4, 16, False),
    "tiny": (7, 4, 2, 16, 3, 4, False),
    "odd": (3, 6, 2, 48, 2, 8, False),  # head dim 48: half 24, masked lanes
    "interleaved": (4, 4, 1, 64, 2, 4, True),  # MLA's layout
}
# (atol, rtol): the reference rounds each product and the sum to the dtype, the kernel once
ROPE_TOL = {torch.float32: (1e-6, 1e-5), torch.bfloat16: (1e-2, 3 * BF16_ULP)}
# partial RoPE: (tokens, heads, head dim, first rotated dim, rotated dims, interleaved)
ROPE_PART_SHAPES = {
    "mla_q": (3, 4, 48, 32, 16, True),  # q_nope | rope(q_rope): the last dims
    "indexer": (2, 8, 64, 0, 16, True),  # rope(q_rot) | q_pass: the first dims
    "middle": (3, 2, 40, 8, 24, False),  # half-split, dims on both sides, 12 pairs (masked lanes)
}
# MLA's latent into the cache, norm(c) | rope(k_rope): (tokens, rank, rope dims, interleaved,
# page size); GLM-5's widths, a small one with masked lanes (half-split)
NORM_ROPE_SHAPES = {"glm5": (3, 512, 64, True, 4), "odd": (5, 40, 12, False, 2)}
# the DSA indexer's key into its cache, rope(layer_norm(k)): (tokens, dim, rope dims,
# interleaved, page size)
LAYER_NORM_ROPE_SHAPES = {"glm5": (3, 128, 64, True, 4), "odd": (5, 40, 12, False, 2)}
SILU_SHAPES = {"decode": (1, 14336), "odd": (5, 100), "tiny": (9, 64)}  # (rows, intermediate)
SILU_TOL = {torch.float32: (1e-6, 1e-5), torch.bfloat16: (1e-6, 3 * BF16_ULP)}

# MoE router: (tokens, experts, groups, groups kept, experts per token, renormalised, scaling)
ROUTE_SHAPES = {
    "glm5": (5, 256, 8, 4, 8, True, 2.5),  # GLM-5's / DeepSeek-V3's routing
    "tiny": (7, 8, 2, 1, 2, True, 2.5),  # glm-tiny's
    "one_group": (3, 64, 1, 1, 6, False, 1.0),  # odd widths: 6 of 64, no renormalising
    "ties": (4, 16, 4, 2, 3, True, 1.0),  # tied logits: the lower group and expert id win
}

# the DSA indexer's decode pick: (row width, seq lens, topk)
SELECT_SHAPES = {
    "ties": (40, (40, 7, 0), 16),  # five distinct values, -0.0 and 0.0; an empty request
    "wide": (1000, (1000, 613), 64),
    "short": (12, (12, 5), 32),  # fewer keys than topk: -1 padded
}

# DSA indexer decode: (requests, indexer heads, head dim, page size, row width, seq lens, topk)
INDEXER_SHAPES = {
    "glm": (3, 4, 32, 16, 5, (70, 9, 33), 16),  # fewer keys than topk in one request
    "wide": (2, 8, 64, 8, 7, (50, 1), 8),
    "ties": (2, 4, 32, 16, 4, (60, 40), 48),  # zero keys: exact ties at 0, earlier key first
}

# greedy picks: (rows, vocabulary); "ties" plants a row's maximum twice, in two chunks
PICKS_SHAPES = {"vocab": (3, 128256), "ties": (2, 9000), "small": (4, 50)}

# fused GEMV (one row): (N, K) and the work fused in; K off the block grid
# fp32w: a float32 weight (GLM-5's indexer `weights_proj`, the MoE router), a float32 product
GEMV_KINDS = (
    "plain",
    "bias",
    "norm",
    "add_norm",
    "swiglu",
    "fp8",
    "fp8_norm",  # the norm with no residual: GLM-5's q_a_layernorm before q_b | wq_b
    "fp8_add_norm",
    "fp8_swiglu",
    "fp32w",
    # the final logits' form: the product stored as float32, rounded to x's dtype first
    "add_norm_float",
    # K split three ways (300 = 3 steps of the interpreter's 128), or five (two splits empty)
    "bias_split3",
    "add_norm_split3",
    "fp8_add_norm_split3",
    "fp8_swiglu_split3",
    "fp32w_split5",
)
GEMV_SHAPE = (72, 300)
# FP8 weights: output columns ending inside a 128-row scale block and K inside a 128-wide one;
# with SwiGLU, gate's rows a whole block (the up half must start on one)
GEMV_FP8_SHAPES = {
    "fp8": (200, 300),
    "fp8_norm": (200, 300),
    "fp8_add_norm": (200, 300),
    "fp8_swiglu": (128, 300),
}
# (atol, rtol) against the unfused reference ops: float32 sums in another order, and in bf16 the
# reference's two roundings of the normed row skipped (relative 2^-9 each)
GEMV_TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (3e-2, 2e-2)}

# DSA indexer prefill, one request's chunk: (queries, first query's position, indexer heads,
# head dim, topk): a whole prompt, a later chunk (some queries with fewer keys than topk), ties
INDEXER_PREFILL_SHAPES = {
    "prompt": (37, 0, 4, 32, 16),
    "chunk": (20, 45, 8, 64, 48),
    "ties": (30, 10, 4, 32, 24),  # zero keys: exact ties at 0, the earlier key first
}

# MLA key slots from the top-k: (rows, topk, page size, page-row width, each row's positions,
# each row's planned count); -1 pads a row with fewer keys, a plan below a row's keys cuts it
FILL_KV_SHAPES = {
    "decode": (3, 16, 4, 12, (40, 9, 16), (16, 9, 16)),
    "prefill": (5, 64, 16, 6, (70, 1, 33, 64, 90), (64, 1, 33, 64, 64)),
    "cut": (2, 8, 2, 10, (20, 6), (5, 6)),  # row 0 planned 5 of its 8 picks
}

# MLA decode (`triton.mla.mla_decode`): (requests, heads, nope, rope, rank, value width, page
# size, page-row width, seq lens, topk or 0 for dense, splits or None); heads off the 16-head
# block, a row longer than topk (a random selection), a one-key row, a split holding no key
MLA_DECODE_SHAPES = {
    "sparse": (3, 20, 24, 16, 32, 40, 4, 12, (40, 1, 17), 16, None),
    "dense": (2, 20, 24, 16, 32, 40, 4, 12, (33, 5), 0, None),
    "split1": (2, 4, 8, 16, 32, 8, 8, 6, (45, 20), 32, 1),  # one program walks both blocks
    "split4": (2, 4, 8, 16, 32, 8, 8, 6, (45, 20), 32, 4),
    # GLM-5's heads and widths and index_topk, one request past it
    "glm5": (2, 64, 192, 64, 512, 256, 16, 140, (300, 2100), 2048, None),
}
# (atol, rtol) against the float32 `mla_decode_absorbed`: bf16 rounds q's latent (a bmm in
# bf16), the probabilities and the output
MLA_DECODE_TOL = {torch.float32: (2e-5, 1e-4), torch.bfloat16: (3e-2, 3e-2)}

# MLA's absorbed products (`triton.absorb`): (tokens, heads, nope, rope, rank, value width,
# fp8 kv_b); heads of 80 rows straddle kv_b's 128-row scale blocks, a rank off the 128 grid
ABSORB_SHAPES = {
    "small": (3, 4, 24, 8, 160, 56, False),
    "small_fp8": (3, 4, 24, 8, 160, 56, True),
    # GLM-5's widths (448 rows a head: every other head starts inside a scale block); four of
    # its 64 heads, one token, so that the interpreter takes seconds
    "glm5_fp8": (1, 4, 192, 64, 512, 256, True),
}
# against float32 products of the float32-dequantized kv_b: bf16 rounds the outputs only
ABSORB_TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 1e-2)}

# sum64's one-pass kernel (snapshot/layout/sum64_triton.py): (chunks, words a chunk); a word
# count off the kernel's block and span grids, one word, several spans
SUM64_SHAPES = {"chunks": (5, 70_001), "one": (1, 1), "wide": (2, 3 * 65536 + 17)}

CASES = (
    [f"rms_norm-{s}-{d}" for s in RMS_SHAPES for d in DTYPES]
    + [f"add_rms_norm-{s}-{d}" for s in RMS_SHAPES for d in DTYPES]
    + [f"rope_store-{s}-{d}" for s in ROPE_SHAPES for d in DTYPES]
    + [f"rope_part-{s}-{d}" for s in ROPE_PART_SHAPES for d in DTYPES]
    + [f"norm_rope_store-{s}-{d}" for s in NORM_ROPE_SHAPES for d in DTYPES]
    + [f"layer_norm_rope_store-{s}-{d}" for s in LAYER_NORM_ROPE_SHAPES for d in DTYPES]
    + ["store_refusals-fp32"]
    + [f"silu_mul-{s}-{d}" for s in SILU_SHAPES for d in DTYPES]
    + [f"dequant_fp8-{s}-{d}" for s in FP8_SHAPES for d in DTYPES]
    + [f"linear_fp8-{d}" for d in DTYPES]
    + [f"fp8_gemm-{s}-{d}" for s in FP8_GEMM_SHAPES for d in DTYPES]
    + [f"decode_attention-{s}-{d}" for s in DECODE_SHAPES for d in DTYPES]
    + [f"backend_decode-{d}" for d in DTYPES]
    + [f"greedy_picks-{s}-fp32" for s in PICKS_SHAPES]  # logits are float32
    + [f"gemv-{k}-{d}" for k in GEMV_KINDS for d in DTYPES]
    + [f"backend_gemv-{d}" for d in DTYPES]
    + [f"moe-{s}-{d}" for s in MOE_SHAPES for d in DTYPES]
    # the 16- and 64-row tiles, and one token's GEMVs
    + [f"moe_configs-{s}-bf16" for s in ("fp8", "fp8_prefill", "gemv_fp8")]
    + [f"route-{s}-fp32" for s in ROUTE_SHAPES]  # router logits are float32
    + [f"select-{s}-fp32" for s in SELECT_SHAPES]  # index scores are float32
    + [f"fill_kv-{s}-int32" for s in FILL_KV_SHAPES]
    + [f"mla_decode-{s}-{d}" for s in MLA_DECODE_SHAPES for d in DTYPES]
    + [f"absorb-{s}-{d}" for s in ABSORB_SHAPES for d in DTYPES]
    + [f"indexer-{s}-{d}" for s in INDEXER_SHAPES for d in DTYPES]
    + [f"indexer_prefill-{s}-{d}" for s in INDEXER_PREFILL_SHAPES for d in DTYPES]
    + [f"backend_indexer_prefill-{d}" for d in DTYPES]
    + [f"sum64-{s}-int64" for s in SUM64_SHAPES]
    + [
        "engine_greedy-tiny-fp32",
        "engine_greedy-glm-tiny-fp32",
        "engine_greedy-glm-tiny-bf16ckpt-fp32",
        "engine_greedy-glm-tiny-switchesoff-fp32",
        "engine_greedy-glm-tiny-mlaabsorb-fp32",
        "autotuned",
    ]
)

# every kernel the engine launches on GPUs, autotuned (`triton.kernels.autotuned`), with the
# number of distinct autotune keys `run_autotuned_once` hits: one results file each
AUTOTUNED_KERNELS = {
    "_rms_norm_kernel": 2,  # rms_norm and add_rms_norm (HAS_RESIDUAL is a key)
    "_dequant_fp8_block_kernel": 1,
    "_fp8_block_linear_kernel": 1,
    "_rope_store_kernel": 1,
    "_rope_part_kernel": 1,
    "_norm_rope_store_kernel": 1,
    "_layer_norm_rope_store_kernel": 1,
    "_silu_mul_kernel": 1,
    "_gate_up_kernel": 2,  # a decode-sized and a prefill-sized batch: BLOCK_M 16 and 64
    "_down_kernel": 2,
    "_decode_split_kernel": 1,
    "_combine_kernel": 2,  # the llama's heads (Dv 128) and MLA's latent (512)
    "_mla_split_kernel": 1,
    "_absorb_kernel": 1,  # GLM-5's FP8 kv_b
    "_expand_kernel": 1,
    "_gemv_kernel": 2,  # a 16-bit and an FP8 weight (SCALED is a key)
    "_route_kernel": 1,
    "_select_topk_kernel": 1,
    "_fill_kv_indices_kernel": 1,
    "_gate_up_gemv_kernel": 1,  # one token's experts
    "_down_gemv_kernel": 1,
    "_chunk_kernel": 1,  # greedy picks
    "_row_kernel": 1,
    "_index_scores_kernel": 1,
    "_index_scores_prefill_kernel": 1,
}


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    norm = RMSNorm(x.shape[-1], eps, weight.dtype, x.device)
    norm.weight.data.copy_(weight)
    return norm(x)


def interpreted() -> bool:
    import triton

    return triton.knobs.runtime.interpret


def _round(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float32 tensor cast to `dtype` the way the kernels' last cast does on this run."""
    if dtype == torch.bfloat16 and interpreted():
        return (value.view(torch.int32) & -(1 << 16)).view(torch.float32).to(dtype)  # exact
    return value.to(dtype)


def _check_close(name: str, got: torch.Tensor, want: torch.Tensor, tol) -> dict:
    atol, rtol = tol
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")
    err = (got.float() - want.float()).abs().max().item() if got.numel() else 0.0
    return {"max_abs_err": err}


def _check_rms_norm(shape: tuple[int, ...], dtype: torch.dtype, device: str, fused: bool) -> dict:
    from snapfn.handler.llm.kernels.triton import kernels as tk

    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=gen) * 3
    x[0] *= 1e-3  # a row whose mean square (~1e-5) is near eps, so eps must be right
    x = x.to(dtype).to(device)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype).to(device)
    eps, tol = 1e-6, RMS_TOL[dtype, interpreted()]
    if not fused:
        got = tk.rms_norm(x, weight, eps)
        return _check_close("rms_norm", got, reference_rms_norm(x, weight, eps), tol)
    residual = torch.randn(shape, generator=gen).to(dtype).to(device)
    out, total = tk.add_rms_norm(x, residual, weight, eps)
    want_total = x + residual
    # the sum is the same float32 value cast once, in the kernel and in torch: exact
    _check_close("add_rms_norm sum", total, _round(x.float() + residual.float(), dtype), EXACT)
    if not interpreted():
        _check_close("add_rms_norm sum", total, want_total, EXACT)
    return _check_close("add_rms_norm", out, reference_rms_norm(want_total, weight, eps), tol)


def _random_fp8(shape: tuple[int, ...], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(sum(shape))
    weight = torch.randn(shape, generator=gen) * 0.05
    weight[..., :64, :] *= 40  # blocks of different scales
    q, scale_inv = quantize_fp8_block(weight)
    return q.to(device), scale_inv.to(device)


def _reference_dequant(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype):
    if interpreted():
        return _round(dequantize_fp8_block(q, scale_inv, torch.float32), dtype)
    return dequantize_fp8_block(q, scale_inv, dtype)


def _check_rope_store(shape: tuple, dtype: torch.dtype, device: str) -> dict:
    from snapfn.handler.llm.engine.batch import ForwardBatch
    from snapfn.handler.llm.kernels.torch_ref import TorchBackend
    from snapfn.handler.llm.kernels.triton import kernels as tk

    tokens, hq, hkv, dim, pages, page_size, interleaved = shape
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * dim, generator=g).to(dtype).to(device)
    q, k, v = (t.unflatten(-1, (-1, dim)) for t in qkv.split([hq * dim, hkv * dim, hkv * dim], -1))
    angles = torch.rand(tokens, dim // 2, generator=g) * 6.28
    cos, sin = angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device)
    slots = torch.randperm(pages * page_size, generator=g)[:tokens].to(device)
    batch = ForwardBatch(*(slots,) * 8, page_size=page_size)  # the ops read slot_mapping only
    caches = [torch.zeros(pages, page_size, hkv, dim, dtype=dtype, device=device) for _ in "kv"]
    want_caches = [c.clone() for c in caches]
    want = TorchBackend().rope_store_kv(q, k, v, cos, sin, interleaved, *want_caches, batch)
    got = tk.rope_store_kv(q, k, v, cos, sin, interleaved, *caches, slots)
    tol = ROPE_TOL[dtype]
    _check_close("rope_store k_cache", caches[0], want_caches[0], tol)
    _check_close("rope_store v_cache", caches[1], want_caches[1], EXACT)  # copied
    return _check_close("rope_store q", got, want, tol)


def _check_rope_part(shape: tuple, dtype: torch.dtype, device: str) -> dict:
    from snapfn.handler.llm.kernels.torch_ref import rope_part
    from snapfn.handler.llm.kernels.triton import kernels as tk

    tokens, heads, dim, start, rope_dim, interleaved = shape
    g = torch.Generator().manual_seed(5)
    # a strided view: the heads of a wider projection's output, as the models pass them
    wide = torch.randn(tokens, heads * dim + 24, generator=g).to(dtype).to(device)
    x = wide[:, 24:].unflatten(-1, (heads, dim))
    angles = torch.rand(tokens, rope_dim // 2, generator=g) * 6.28
    cos, sin = angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device)
    want = rope_part(x, cos, sin, interleaved, start)
    got = tk.rope_part(x, cos, sin, interleaved, start)
    end = start + rope_dim
    _check_close("rope_part copied", got[..., :start], want[..., :start], EXACT)
    _check_close("rope_part copied", got[..., end:], want[..., end:], EXACT)
    return _check_close("rope_part", got, want, ROPE_TOL[dtype])


def _check_norm_rope_store(shape: tuple, dtype: torch.dtype, device: str) -> dict:
    from types import SimpleNamespace

    from snapfn.handler.llm.kernels.torch_ref import TorchBackend
    from snapfn.handler.llm.kernels.triton import kernels as tk

    tokens, rank, rope_dim, interleaved, page_size = shape
    g = torch.Generator().manual_seed(6)
    # the latent's columns of a wider projection's output (the stacked q_a | kv_a | wk)
    wide = (3 * torch.randn(tokens, rank + rope_dim + 40, generator=g)).to(dtype).to(device)
    x = wide[:, 24 : 24 + rank + rope_dim]
    norm = (1 + 0.1 * torch.randn(rank, generator=g)).to(dtype).to(device)
    angles = torch.rand(tokens, rope_dim // 2, generator=g) * 6.28
    cos, sin = angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device)
    slots = torch.randperm(4 * page_size * tokens, generator=g)[:tokens].to(device)
    want, got = (torch.zeros(4 * tokens, page_size, rank + rope_dim, dtype=dtype) for _ in "wg")
    ref_batch = SimpleNamespace(slot_mapping=slots.cpu())
    ref_args = (x.cpu(), norm.cpu(), 1e-6, cos.cpu(), sin.cpu(), interleaved, ref_batch)
    TorchBackend().norm_rope_store(want, *ref_args)
    got = got.to(device)
    tk.norm_rope_store(x, norm, 1e-6, cos, sin, interleaved, got, slots)
    got, flat = got.cpu().flatten(0, 1), want.flatten(0, 1)
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[slots.cpu()] = False
    assert not got[untouched].any(), "wrote outside the token's slots"
    _check_close(
        "norm_rope_store norm", got[:, :rank], flat[:, :rank], RMS_TOL[dtype, interpreted()]
    )
    return _check_close("norm_rope_store rope", got[:, rank:], flat[:, rank:], ROPE_TOL[dtype])


def _check_layer_norm_rope_store(shape: tuple, dtype: torch.dtype, device: str) -> dict:
    from types import SimpleNamespace

    from snapfn.handler.llm.kernels.torch_ref import TorchBackend
    from snapfn.handler.llm.kernels.triton import kernels as tk

    tokens, dim, rope_dim, interleaved, page_size = shape
    g = torch.Generator().manual_seed(7)
    # the key's columns of a wider projection's output (the stacked q_a | kv_a | wk)
    wide = (2 + 3 * torch.randn(tokens, dim + 40, generator=g)).to(dtype).to(device)
    x = wide[:, 24 : 24 + dim]
    weight, bias = ((1 + 0.1 * torch.randn(dim, generator=g)).to(dtype).to(device) for _ in "wb")
    angles = torch.rand(tokens, rope_dim // 2, generator=g) * 6.28
    cos, sin = angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device)
    slots = torch.randperm(4 * page_size * tokens, generator=g)[:tokens].to(device)
    want, got = (torch.zeros(4 * tokens, page_size, dim, dtype=dtype) for _ in "wg")
    ref_batch = SimpleNamespace(slot_mapping=slots.cpu())
    ref_args = (x.cpu(), weight.cpu(), bias.cpu(), 1e-6, cos.cpu(), sin.cpu(), interleaved)
    TorchBackend().layer_norm_rope_store(want, *ref_args, ref_batch)
    got = got.to(device)
    tk.layer_norm_rope_store(x, weight, bias, 1e-6, cos, sin, interleaved, got, slots)
    got, flat = got.cpu().flatten(0, 1), want.flatten(0, 1)
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[slots.cpu()] = False
    assert not got[untouched].any(), "wrote outside the token's slots"
    norm_tol = RMS_TOL[dtype, interpreted()]  # a row's statistics, rounded once like RMSNorm
    _check_close("layer_norm_rope_store norm", got[:, rope_dim:], flat[:, rope_dim:], norm_tol)
    tol = tuple(max(a, b) for a, b in zip(norm_tol, ROPE_TOL[dtype], strict=True))
    return _check_close("layer_norm_rope_store rope", got[:, :rope_dim], flat[:, :rope_dim], tol)


def _check_store_refusals(device: str) -> dict:
    """The one-launch cache stores refuse rows that do not fit, each with its reason."""
    from snapfn.handler.llm.kernels.triton import kernels as tk

    def zeros(*shape: int) -> torch.Tensor:
        return torch.zeros(shape, device=device)

    x, cache, cos, slots = zeros(2, 576), zeros(4, 8, 576), zeros(2, 32), zeros(2).long()
    strided = zeros(576, 2).t()
    latent, key = tk.norm_rope_store, tk.layer_norm_rope_store
    cases = [
        (latent, "norm 500 | rope 64", (x, zeros(500), 1e-6, cos, cos, True, cache, slots)),
        (latent, "cos/sin", (x, zeros(512), 1e-6, cos[:1], cos[:1], True, cache, slots)),
        (latent, "x's 576", (x, zeros(512), 1e-6, cos, cos, True, cache[..., :128], slots)),
        (latent, "contiguous", (strided, zeros(512), 1e-6, cos, cos, True, cache, slots)),
        (key, "must be [128]", (x[:, :128], zeros(64), zeros(128), 1e-6, cos, cos, True,
                                zeros(4, 8, 128), slots)),
    ]  # fmt: skip
    for store, want, call in cases:
        try:
            store(*call)
        except ValueError as exc:
            assert want in str(exc), f"{store.__name__}: {exc} (wanted {want!r})"
        else:
            raise AssertionError(f"{store.__name__} took rows that do not fit ({want})")
    return {"refused": len(cases)}


def _check_silu_mul(shape: tuple[int, int], dtype: torch.dtype, device: str) -> dict:
    from snapfn.handler.llm.kernels.torch_ref import TorchBackend
    from snapfn.handler.llm.kernels.triton import kernels as tk

    rows, inter = shape
    g = torch.Generator().manual_seed(4)
    gate_up = (3 * torch.randn(rows, 2 * inter, generator=g)).to(dtype).to(device)
    want = TorchBackend().silu_mul(gate_up)
    return _check_close("silu_mul", tk.silu_mul(gate_up), want, SILU_TOL[dtype])


def _check_dequant(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> dict:
    from snapfn.handler.llm.kernels.triton import kernels as tk

    q, scale_inv = _random_fp8(shape, device)
    got = tk.dequantize_fp8_block(q, scale_inv, dtype)
    # one float32 multiply and one cast in both: exact
    return _check_close("dequant_fp8", got, _reference_dequant(q, scale_inv, dtype), EXACT)


def _check_linear(dtype: torch.dtype, device: str) -> dict:
    from snapfn.handler.llm.kernels import get_backend
    from snapfn.handler.llm.kernels.triton.backend import FP8_FUSED_MAX_ROWS

    q, scale_inv = _random_fp8((200, 136), device)
    bias = torch.randn(200, generator=torch.Generator().manual_seed(2)).to(dtype).to(device)
    errors = []
    for rows in (9, FP8_FUSED_MAX_ROWS + 1):  # the fused kernel; dequantize + F.linear
        x = torch.randn(rows, 136, generator=torch.Generator().manual_seed(1)).to(dtype)
        x = x.to(device)
        got = get_backend("triton").linear(x, q, bias, scale_inv)
        if interpreted():
            want = torch.nn.functional.linear(x, _reference_dequant(q, scale_inv, dtype), bias)
        else:
            want = get_backend("torch").linear(x, q, bias, scale_inv)
        # the same dequantized weight through the same F.linear: exact; fused: sums reordered,
        # and in bf16 rounded before the bias is added (the reference rounds once, after): up
        # to an ulp of the largest outputs (the 40x scale blocks' ~10: 0.0625) where the bias
        # cancels them to near 0, as `_gemv_tol` allows
        tol = FP8_GEMM_TOL[dtype] if rows <= FP8_FUSED_MAX_ROWS else EXACT
        if rows <= FP8_FUSED_MAX_ROWS and dtype != torch.float32:
            tol = (max(tol[0], 2**-7 * want.float().abs().max().item()), tol[1])
        errors.append(_check_close(f"linear_fp8 {rows} rows", got, want, tol)["max_abs_err"])
    return {"max_abs_err": max(errors)}


def _check_fp8_gemm(name: str, dtype: torch.dtype, device: str) -> dict:
    from snapfn.handler.llm.kernels.triton import kernels as tk

    rows, n, k = FP8_GEMM_SHAPES[name]
    splits = int(name.partition("_split")[2] or 1)
    q, scale_inv = _random_fp8((n, k), device)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(2)).to(dtype).to(device)
    got = tk.fp8_block_linear(x, q, scale_inv, splits=splits)
    if splits > 1:  # once more: the last program of each column tile left its count at 0
        again = tk.fp8_block_linear(x, q, scale_inv, splits=splits)
        assert torch.equal(again, got), f"fp8_gemm {name}: a second split run differs"
    weight = _reference_dequant(q, scale_inv, dtype)
    want = torch.nn.functional.linear(x.float(), weight.float()).to(dtype)
    return _check_close("fp8_gemm", got, want, FP8_GEMM_TOL[dtype])


def _check_decode(shape: tuple, dtype: torch.dtype, device: str, splits: int | None) -> dict:
    from snapfn.handler.llm.kernels.torch_ref import decode_attention
    from snapfn.handler.llm.kernels.triton import attention as ta

    b, hq, hkv, d, page, width, seq_lens = shape
    gen = torch.Generator().manual_seed(hq * d + width)
    num_pages = b * width + 3
    k_cache = torch.randn(num_pages, page, hkv, d, generator=gen)
    v_cache = torch.randn(num_pages, page, hkv, d, generator=gen)
    q = torch.randn(b, hq, d, generator=gen)
    # each request's row: distinct pages in a shuffled order (a real pool's are anywhere)
    page_table = torch.randperm(num_pages, generator=gen)[: b * width].view(b, width).int()
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    q, k_cache, v_cache = (t.to(dtype) for t in (q, k_cache, v_cache))
    scale = d**-0.5
    args = [t.to(device) for t in (q, k_cache, v_cache, page_table, lens)]
    got = ta.paged_decode_attention(*args, scale, splits=splits).float().cpu()
    upcast = (q.float(), k_cache.float(), v_cache.float(), page_table, lens)
    want = decode_attention(*upcast, scale)  # float32 reference on CPU
    live = lens > 0  # the reference gives NaN for a request with no tokens; the kernel zeros
    assert torch.equal(got[~live], torch.zeros_like(got[~live])), "empty request not zero"
    return _check_close("decode_attention", got[live], want[live], DECODE_TOL[dtype])


def _check_picks(shape: tuple[int, int], device: str) -> dict:
    from snapfn.handler.llm.engine.sampler import greedy_picks
    from snapfn.handler.llm.kernels.triton import sampling as ts

    rows, vocab = shape
    logits = 4 * torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab))
    if vocab > ts.CHUNK:  # the maximum at the end of chunk 1 and again in chunk 0: the first wins
        logits[0, ts.CHUNK + 5] = logits[0, 7] = logits[0].max() + 1
    tokens, picked = ts.greedy_picks(logits.to(device))
    want_tokens, want = greedy_picks(logits)
    assert torch.equal(tokens.cpu(), want_tokens), (
        f"tokens {tokens.tolist()} != {want_tokens.tolist()}"
    )
    return _check_close("greedy_picks", picked.cpu(), want, (1e-4, 1e-5))  # 128k-term sums


def _check_gemv(kind: str, dtype: torch.dtype, device: str) -> dict:
    from snapfn.handler.llm.kernels.torch_ref import TorchBackend
    from snapfn.handler.llm.kernels.triton import gemv as tg

    ref = TorchBackend()
    kind, _, split = kind.partition("_split")
    splits = int(split) if split else None
    float_out = kind.endswith("_float")
    kind = kind.removesuffix("_float")
    n, k = GEMV_FP8_SHAPES.get(kind, GEMV_SHAPE)
    gen = torch.Generator().manual_seed(len(kind))
    swiglu = kind.endswith("swiglu")
    rows = 2 * n if swiglu else n
    x, residual = (torch.randn(1, k, generator=gen).to(dtype).to(device) for _ in "xr")
    scale_inv = None
    if kind.startswith("fp8"):
        weight, scale_inv = _random_fp8((rows, k), device)
    elif kind == "fp32w":
        weight = (torch.randn(rows, k, generator=gen) / k**0.5).to(device)
    else:
        weight = (torch.randn(rows, k, generator=gen) / k**0.5).to(dtype).to(device)
    bias = torch.randn(rows, generator=gen).to(dtype).to(device) if kind == "bias" else None
    norm = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype).to(device)
    fused = {}
    h = x
    if kind in ("norm", "add_norm", "swiglu", "fp8_norm", "fp8_add_norm", "fp8_swiglu"):
        fused = {"norm_weight": norm, "eps": 1e-6}
        if kind in ("norm", "fp8_norm"):
            normed = ref.rms_norm(x, norm, 1e-6)
        else:
            fused["residual"] = residual
            normed, h = ref.add_rms_norm(x, residual, norm, 1e-6)
    else:
        normed = x
    want = ref.linear(normed, weight, bias, scale_inv)
    if swiglu:
        want = ref.silu_mul(want)
    call = dict(swiglu=swiglu, weight_scale_inv=scale_inv, splits=splits, float_out=float_out)
    got, total = tg.gemv(x, weight, bias, **call, **fused)
    if float_out:  # float32, holding values of x's dtype (what `.float()` of one would)
        assert got.dtype == torch.float32, f"gemv {kind}: {got.dtype} logits"
        assert torch.equal(got, got.to(dtype).float()), f"gemv {kind}: not rounded to {dtype}"
        got = got.to(dtype)  # exact (just checked): compared at x's dtype's tolerance
    if splits:  # once more: the last program of each column block left its count at 0
        again, _ = tg.gemv(x, weight, bias, **call, **fused)
        assert torch.equal(again, got), f"gemv {kind}: a second split run differs"
    assert got.dtype == want.dtype, f"gemv {kind}: a {got.dtype} product, want {want.dtype}"
    if "residual" in fused:
        _check_close("gemv residual sum", total, h, (BF16_ULP * 8, BF16_ULP))
    return _check_close(f"gemv {kind}", got, want, _gemv_tol(want, scale_inv is not None))


def _gemv_tol(want: torch.Tensor, fp8: bool) -> tuple[float, float]:
    """GEMV_TOL; for an FP8 weight in 16-bit, the absolute part scaled to the output: the
    reference rounds each dequantized weight to the input dtype (the kernel does not), and the
    weights' mixed block scales make outputs of ~30 (one bf16 ulp there: 0.125) whose
    cancellations leave some near 0."""
    atol, rtol = GEMV_TOL[want.dtype]
    if fp8 and want.dtype != torch.float32:
        atol = max(atol, 2**-7 * want.float().abs().max().item())
    return atol, rtol


@contextlib.contextmanager
def _counting(module, name: str):
    """Calls to `module.name` counted (a list, one entry per call) while the block runs."""
    calls, real = [], getattr(module, name)
    setattr(module, name, lambda *a, **kw: calls.append(1) or real(*a, **kw))
    try:
        yield calls
    finally:
        setattr(module, name, real)


def _check_backend_gemv(dtype: torch.dtype, device: str) -> dict:
    """The triton backend's `add_norm_linear` and `linear` against the torch backend's: a
    16-bit row through the fused GEMV (counted), two rows or float32 through the unfused ops."""
    from snapfn.handler.llm.kernels import get_backend
    from snapfn.handler.llm.kernels.triton import gemv as tg

    triton, torch_ref = get_backend("triton"), get_backend("torch")
    gen = torch.Generator().manual_seed(8)
    n, k = GEMV_SHAPE
    weight = (torch.randn(2 * n, k, generator=gen) / k**0.5).to(dtype).to(device)
    norm = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype).to(device)
    with _counting(tg, "gemv") as calls:
        errors = []
        for rows in (1, 2):
            x, residual = (torch.randn(rows, k, generator=gen).to(dtype).to(device) for _ in "xr")
            for swiglu in (False, True):
                got, h = triton.add_norm_linear(x, residual, norm, 1e-6, weight, swiglu=swiglu)
                want, h_want = torch_ref.add_norm_linear(
                    x, residual, norm, 1e-6, weight, swiglu=swiglu
                )
                tol = GEMV_TOL[dtype]  # unfused, bf16 differs too: the norm kernel's rounding
                errors.append(
                    _check_close(f"add_norm_linear {rows} rows", got, want, tol)["max_abs_err"]
                )
                _check_close("residual sum", h, h_want, (BF16_ULP * 8, BF16_ULP))
            got = triton.linear(x, weight)
            errors.append(
                _check_close(
                    f"linear {rows} rows", got, torch_ref.linear(x, weight), GEMV_TOL[dtype]
                )["max_abs_err"]
            )
            # FP8: gate | up (2 x 128 rows) with the norm and SwiGLU, then a plain product
            fp8, fp8_scale = _random_fp8((256, k), device)
            got, _ = triton.add_norm_linear(x, residual, norm, 1e-6, fp8, None, fp8_scale, True)
            want, _ = torch_ref.add_norm_linear(x, residual, norm, 1e-6, fp8, None, fp8_scale, True)
            tol = _gemv_tol(want, True)
            errors.append(_check_close(f"fp8 swiglu {rows} rows", got, want, tol)["max_abs_err"])
            got = triton.linear(x, fp8, None, fp8_scale)
            want = torch_ref.linear(x, fp8, None, fp8_scale)
            tol = _gemv_tol(want, True)
            errors.append(_check_close(f"fp8 linear {rows} rows", got, want, tol)["max_abs_err"])
            # a float32 weight (a float32 module): a float32 product whatever x's dtype
            fp32 = weight.float()
            got, want = triton.linear(x, fp32), torch_ref.linear(x, fp32)
            assert got.dtype == want.dtype == torch.float32, (got.dtype, want.dtype)
            tol = GEMV_TOL[torch.float32]
            errors.append(_check_close(f"fp32 linear {rows} rows", got, want, tol)["max_abs_err"])
    # one 16-bit row: two add_norm_linear and one linear, the FP8 swiglu and linear, float32 W
    want_calls = 6 if dtype != torch.float32 else 0
    assert len(calls) == want_calls, f"gemv ran {len(calls)} times, expected {want_calls}"
    return {"max_abs_err": max(errors)}


def _check_backend_decode(dtype: torch.dtype, device: str) -> dict:
    """The triton backend's decode attention against the torch backend's, through the seam."""
    from types import SimpleNamespace

    from snapfn.handler.llm.kernels import get_backend

    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache = (torch.randn(12, 16, 2, 64, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(2, 8, 64, generator=gen).to(dtype)
    page_table = torch.tensor([[3, 7, 1, 0], [11, 2, 5, 9]], dtype=torch.int32)
    seq_lens = torch.tensor([50, 9], dtype=torch.int32)

    def decode_batch(on: str) -> SimpleNamespace:  # what paged_attention reads of a batch
        return SimpleNamespace(
            is_decode=True, page_table=page_table.to(on), seq_lens=seq_lens.to(on)
        )

    args = [t.to(device) for t in (q, k_cache, v_cache)]
    got = get_backend("triton").paged_attention(*args, decode_batch(device), 0.125)
    upcast = [t.float() for t in (q, k_cache, v_cache)]
    want = get_backend("torch").paged_attention(*upcast, decode_batch("cpu"), 0.125)
    assert got.dtype == dtype and got.shape == want.shape
    return _check_close("backend_decode", got.float().cpu(), want, DECODE_TOL[dtype])


def assert_same_greedy(got, want, logprob_atol: float, what: str = "greedy tokens") -> float:
    """Equal tokens and logprobs within `logprob_atol` (lists of GenerationResult); returns the
    largest logprob error."""
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids, f"{what} differ: {a.token_ids} != {b.token_ids}"
    diffs = [
        abs(x - y)
        for a, b in zip(got, want, strict=True)
        for x, y in zip(a.logprobs, b.logprobs, strict=True)
    ]
    assert max(diffs) < logprob_atol, f"{what}: logprobs differ by {max(diffs)}"
    return max(diffs)


def _check_engine_greedy(preset: str, dtype: str, device: str) -> dict:
    """Whole model: greedy tokens through the triton backend equal the torch backend's
    (decode attention with page size 4, so requests span pages; FP8 linear for glm-tiny)."""
    # -switchesoff: with the Triton MoE router, the indexer's decode pick, the one-launch
    # cache stores and the decode MLA by `triton.mla` switched off (the switches are read when
    # the backend is built), so their reference paths run instead; -mlaabsorb: decode MLA's
    # absorbed products by `triton.absorb` (SNAPFN_MLA_ABSORB, off by default)
    switches = ("SNAPFN_MOE_ROUTER", "SNAPFN_INDEXER_SELECT", "SNAPFN_CACHE_STORES")
    switches += ("SNAPFN_MLA_DECODE",)
    on = not preset.endswith("-switchesoff")
    preset = preset.removesuffix("-switchesoff")
    absorb = preset.endswith("-mlaabsorb")
    preset = preset.removesuffix("-mlaabsorb")
    checkpoint = "fp8" if preset == "glm-tiny" else "bf16"  # bf16ckpt: the MoE kernel's path
    preset = preset.removesuffix("-bf16ckpt")
    from snapfn.handler.llm.kernels.triton import absorb as tab
    from snapfn.handler.llm.kernels.triton import indexer as ti
    from snapfn.handler.llm.kernels.triton import kernels as tk
    from snapfn.handler.llm.kernels.triton import mla as triton_mla
    from snapfn.handler.llm.kernels.triton import moe as tm

    with mock.patch.dict(os.environ):  # restored afterwards, whatever happens
        for name in (*switches, "SNAPFN_MLA_ABSORB"):
            os.environ.pop(name, None)
        if not on:
            os.environ.update(dict.fromkeys(switches, "off"))
        if absorb:
            os.environ["SNAPFN_MLA_ABSORB"] = "triton"
        with (
            _counting(tm, "route") as routed,
            _counting(ti, "select_topk_decode") as picked,
            _counting(tk, "norm_rope_store") as stored,
            _counting(triton_mla, "mla_decode_latent") as attended,
            _counting(tab, "expand_output") as expanded,
        ):
            result = _engine_greedy(preset, checkpoint, dtype, device)
    if preset.startswith("glm"):
        ran = (len(routed), len(picked), len(stored), len(attended))
        assert bool(routed) == bool(picked) == bool(stored) == bool(attended) == on, ran
        want = len(attended) if absorb else 0
        assert len(expanded) == want, f"triton_absorb ran {len(expanded)} times"
    return result


def _engine_greedy(preset: str, checkpoint: str, dtype: str, device: str) -> dict:
    import tempfile
    from pathlib import Path

    from snapfn.handler.llm.build import EngineOptions, build_engine
    from snapfn.handler.llm.engine.engine import SchedulerConfig
    from snapfn.handler.llm.engine.request import SamplingParams
    from snapfn.handler.llm.make_model.build import make_model

    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(preset, Path(tmp) / preset, dtype=checkpoint, seed=3)
        results, graphs = {}, None
        runs = ("torch", "triton") + (("triton-graphs",) if device.startswith("cuda") else ())
        for run in runs:
            backend = run.removesuffix("-graphs")
            opts = EngineOptions(
                dtype={"fp32": "float32", "bf16": "bfloat16"}[dtype],
                num_pages=64,
                backend=backend,
                device=device,
                # the graphs' run prefills in steps of 16 tokens, which replay bucket 16 a row a
                # token (absorb.MAX_TOKENS: the largest batch MLA's absorbed kernels take)
                scheduler=SchedulerConfig(
                    page_size=4, max_num_batched_tokens=16 if run.endswith("-graphs") else 256
                ),
            )
            engine = build_engine(model, opts).engine
            if run.endswith("-graphs"):  # decode replays captured graphs (MoE and DSA too),
                # and so do the prefill's steps (20 tokens: 16, then 4 beside decodes)
                graphs = engine.capture_graphs([1, 2, 4, 16], max_seq_len=64)
            params = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
            prompts = [[5, 17, 3, 9, 12, 40, 7], [2, 8], [30, 1, 4, 4, 11, 6, 19, 23, 2, 9, 10]]
            results[run] = engine.generate(prompts, params)
    got = results["triton"]
    err = assert_same_greedy(got, results["torch"], 1e-3, what=preset)
    if graphs is not None:
        assert graphs.replays > 0 and graphs.eager_fallbacks == 0, graphs
        assert graphs.prefill_replays >= 2, graphs
        err = max(err, assert_same_greedy(results["triton-graphs"], results["torch"], 1e-3))
    return {"max_abs_err": err, "tokens": sum(len(r.token_ids) for r in got)}


def _check_moe(name: str, dtype: torch.dtype, device: str, config=None) -> dict:
    from snapfn.handler.llm.kernels import get_backend
    from snapfn.handler.llm.kernels.base import ExpertWeights
    from snapfn.handler.llm.kernels.triton import moe as tm

    tokens, topk, num_local, first, num_all, hidden, inter = MOE_SHAPES[name]
    gemv = name.startswith("gemv")
    want_block_m = tm.PREFILL_BLOCK_M if name in MOE_PREFILL_SIZED else tm.DECODE_BLOCK_M
    assert gemv or tm.block_m_for(tokens * topk, num_local) == want_block_m, f"{name}: row tile"
    gen = torch.Generator().manual_seed(tokens * hidden + inter)
    x = torch.randn(tokens, hidden, generator=gen)
    gate, up = (torch.randn(num_local, inter, hidden, generator=gen) * 0.2 for _ in range(2))
    down = torch.randn(num_local, hidden, inter, generator=gen) * 0.2
    ids = torch.stack([torch.randperm(num_all, generator=gen)[:topk] for _ in range(tokens)])
    weights = torch.rand(tokens, topk, generator=gen)

    if "fp8" in name:  # quantized weights and their scales; else plain
        quantized = [quantize_fp8_block(w) for w in (gate, up, down)]
        stored = [q for q, _ in quantized] + [s for _, s in quantized]
    else:
        stored = [w.to(dtype) for w in (gate, up, down)] + [None] * 3

    def experts(ws):
        return ExpertWeights(*ws, first_expert=first)

    on = [None if w is None else w.to(device) for w in stored]
    args = (x.to(dtype).to(device), experts(on), ids.to(device), weights.to(device))
    got = (tm.moe_gemv if gemv else tm.fused_moe)(*args, config=config)
    if stored[3] is None:  # the float32 reference on the same (rounded) weights
        plain = [w.float() for w in stored[:3]] + [None] * 3
    else:  # dequantized as the reference does it in `dtype`, then upcast
        plain = [dequantize_fp8_block(q, s, dtype).float() for q, s in quantized] + [None] * 3
    want = get_backend("torch").moe(x.to(dtype).float(), experts(plain), ids, weights)
    assert got.dtype == dtype and got.shape == want.shape
    # bf16: the kernel rounds to bf16 where the reference in bf16 does (each projection, silu,
    # the product; the interpreter by truncation), five roundings against none in the float32
    # reference: bounded relative to the output's scale
    atol, rtol = MOE_TOL[dtype]
    scale = float(want.abs().max())
    if gemv and tokens > 1:
        _check_moe_gemv_tokens(args, got, config)
    return _check_close("moe", got.float().cpu(), want, (atol * max(1.0, scale), rtol))


def _check_moe_gemv_tokens(args: tuple, got: torch.Tensor, config) -> None:
    """`moe_gemv` of several tokens: each token's row the bits its call alone gives (a verify
    step's row as plain decode's), and the triton backend sending those tokens to it unless
    `moe_gemv_rows` is off (then `fused_moe`)."""
    from snapfn.handler.llm.kernels.triton import moe as tm
    from snapfn.handler.llm.kernels.triton.backend import TritonBackend

    x, experts, ids, weights = args
    for t in range(x.shape[0]):
        alone = tm.moe_gemv(x[t : t + 1], experts, ids[t : t + 1], weights[t : t + 1], config)
        assert torch.equal(alone[0], got[t]), f"token {t}: not its one-token result"
    with _counting(tm, "moe_gemv") as gemvs, _counting(tm, "fused_moe") as fused:
        for mode in ("off", "auto"):
            TritonBackend(moe_gemv_rows=mode).moe(x, experts, ids, weights)
    assert (len(gemvs), len(fused)) == (1, 1), f"moe_gemv {len(gemvs)}, fused_moe {len(fused)}"


def _check_route(name: str, device: str) -> dict:
    """`triton.moe.route` against `torch_ref.noaux_tc_route`: per token the same set of experts
    with the same weights (the reference's slot order is unspecified), best first; with tied
    logits, the lower-id experts and groups, as a stable descending sort picks them."""
    from types import SimpleNamespace

    from snapfn.handler.llm.kernels.torch_ref import noaux_tc_route
    from snapfn.handler.llm.kernels.triton import moe as tm
    from snapfn.handler.llm.kernels.triton.backend import TritonBackend

    tokens, experts, groups, kept, topk, norm, scaling = ROUTE_SHAPES[name]
    moe = SimpleNamespace(
        n_routed_experts=experts, n_group=groups, topk_group=kept, num_experts_per_tok=topk,
        norm_topk_prob=norm, routed_scaling_factor=scaling,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(experts + topk)
    logits = torch.randn(tokens, experts, generator=gen) * 2
    bias = torch.randn(experts, generator=gen) * 0.2
    if name == "ties":  # every expert's logit one of two values, no bias: ties everywhere
        logits = (logits > 0).float()
        bias = torch.zeros(experts)
    ids, weights = (t.cpu() for t in tm.route(logits.to(device), bias.to(device), moe))
    assert ids.shape == weights.shape == (tokens, topk) and ids.dtype == torch.int64
    choice = logits.sigmoid() + bias
    if name == "ties":  # the reference by a stable sort: the earliest of equals first
        grouped = choice.view(tokens, groups, -1)
        group_score = grouped.sort(dim=-1, descending=True, stable=True)[0][..., :2].sum(-1)
        keep = group_score.sort(dim=-1, descending=True, stable=True)[1][:, :kept]
        mask = torch.zeros(tokens, groups, dtype=torch.bool).scatter_(1, keep, True)
        masked = choice.masked_fill(~mask.repeat_interleave(experts // groups, 1), float("-inf"))
        want_ids = masked.sort(dim=-1, descending=True, stable=True)[1][:, :topk]
        assert torch.equal(ids, want_ids), f"tie-break: {ids.tolist()} != {want_ids.tolist()}"
        # the reference's topk breaks these ties its own way: its sets are not comparable
        return {"max_abs_err": 0.0}
    want_ids, want_weights = noaux_tc_route(logits, bias, moe)
    with _counting(tm, "route") as calls:  # through the backend: the kernel only when on
        for mode, expected in (("off", 0), ("auto", 1)):
            backend = TritonBackend(router=mode)
            got = backend.route(logits.to(device), bias.to(device), moe)[0].cpu()
            assert torch.equal(got.sort(dim=-1).values, want_ids.sort(dim=-1).values), mode
            assert len(calls) == expected, f"router {mode}: the kernel ran {len(calls)} times"
    order = want_ids.sort(dim=-1)
    mine = ids.sort(dim=-1)
    assert torch.equal(mine.values, order.values), f"experts: {ids.tolist()} vs {want_ids.tolist()}"
    got_w = weights.gather(1, mine.indices)
    want_w = want_weights.gather(1, order.indices)
    picked = choice.gather(1, ids)
    assert bool((picked[:, :-1] >= picked[:, 1:]).all()), "slots are not best first"
    return _check_close("route weights", got_w, want_w, (1e-6, 1e-6))


def _check_indexer(name: str, dtype: torch.dtype, device: str) -> dict:
    from snapfn.handler.llm.kernels.torch_ref import _topk_decode
    from snapfn.handler.llm.kernels.triton import indexer as ti

    b, heads, dim, page, width, seq_lens, topk = INDEXER_SHAPES[name]
    gen = torch.Generator().manual_seed(heads * dim + width)
    num_pages = b * width + 2
    # positive queries and keys: relu keeps every score, and they are far apart
    k_cache = torch.rand(num_pages, page, dim, generator=gen)
    q = torch.rand(b, heads, dim, generator=gen)
    if name == "ties":
        k_cache[:, ::3] = 0.0  # every third slot of every page scores exactly 0
    weights = torch.rand(b, heads, generator=gen) * heads**-0.5
    page_table = torch.randperm(num_pages, generator=gen)[: b * width].view(b, width).int()
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    q, k_cache = q.to(dtype), k_cache.to(dtype)
    scale = dim**-0.5
    args = [t.to(device) for t in (q, weights, k_cache, page_table, lens)]
    got_scores = ti.index_scores_decode(*args, scale).cpu()
    k = k_cache.float()[page_table.long()].flatten(1, 2)  # the reference's scores, float32
    scores = torch.relu(torch.matmul(q.float(), k.transpose(1, 2)) * scale)
    want_scores = torch.matmul(weights.unsqueeze(1), scores).squeeze(1)
    live = torch.arange(k.shape[1])[None, :] < lens[:, None]
    want_scores = want_scores.masked_fill(~live, float("-inf"))
    _check_close("index_scores", got_scores, want_scores, (1e-5, 1e-5))
    _assert_no_near_tie(want_scores, topk)
    got = ti.indexer_topk_decode(*args, topk, scale).cpu()
    want = _topk_decode(q.float(), weights, k_cache.float(), page_table, lens, topk, scale)
    assert torch.equal(got, want), f"picks differ:\n{got}\n{want}"
    got = ti.indexer_topk_decode(*args, topk, scale, select=True).cpu()  # the Triton pick
    assert torch.equal(got, want), f"picks (select_topk_decode) differ:\n{got}\n{want}"
    return {"max_abs_err": float((got_scores - want_scores).nan_to_num(0.0).abs().max())}


def _check_select(name: str, device: str) -> dict:
    """`triton.indexer.select_topk_decode` against `torch_ref.select_topk` on the same scores:
    the same picks exactly, ties (-0.0 and 0.0 among them) to the earlier key."""
    from snapfn.handler.llm.kernels.torch_ref import select_topk
    from snapfn.handler.llm.kernels.triton import indexer as ti

    width, seq_lens, topk = SELECT_SHAPES[name]
    gen = torch.Generator().manual_seed(width + topk)
    if name == "ties":
        values = torch.tensor([-1.5, -0.0, 0.0, 0.5, 2.0])
        scores = values[torch.randint(0, 5, (len(seq_lens), width), generator=gen)]
    else:
        scores = torch.randn(len(seq_lens), width, generator=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scores = scores.masked_fill(torch.arange(width)[None, :] >= lens[:, None], float("-inf"))
    got = ti.select_topk_decode(scores.to(device), lens.to(device), topk).cpu()
    want = select_topk(scores, lens, topk)
    assert torch.equal(got, want), f"{name}: picks differ:\n{got}\n{want}"
    return {"picked": int((got >= 0).sum())}


def random_topk(key_counts, topk: int, gen: torch.Generator) -> torch.Tensor:
    """`[rows, topk]` int32 valid DSA selections (as `dsa_topk` returns, read as sets): for a
    row with `n` causal keys, `min(n, topk)` distinct positions below `n` in a random order,
    then -1."""
    picked = torch.full((len(key_counts), topk), -1, dtype=torch.int32)
    for row, n in enumerate(key_counts):
        picked[row, : min(n, topk)] = torch.randperm(n, generator=gen)[:topk].int()
    return picked


def _check_mla_decode(name: str, dtype: torch.dtype, device: str) -> dict:
    """`triton.mla.mla_decode` against `torch_ref.mla_decode_absorbed` in float32."""
    from snapfn.handler.llm.kernels.torch_ref import mla_decode_absorbed
    from snapfn.handler.llm.kernels.triton import mla as tm

    b, heads, nope, rope, rank, dv, page, width, seq_lens, topk, splits = MLA_DECODE_SHAPES[name]
    gen = torch.Generator().manual_seed(heads * rank + topk)
    num_pages = b * width + 2
    cache = torch.randn(num_pages, page, rank + rope, generator=gen)
    q = torch.randn(b, heads, nope + rope, generator=gen)
    kv_b = torch.randn(heads * (nope + dv), rank, generator=gen) / rank**0.5
    page_table = torch.randperm(num_pages, generator=gen)[: b * width].view(b, width).int()
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    picked = random_topk(seq_lens, topk, gen) if topk else None
    q, cache, kv_b = (t.to(dtype) for t in (q, cache, kv_b))
    scale = (nope + rope) ** -0.5
    on = [t.to(device) for t in (q, cache, kv_b, page_table, lens)]
    got = tm.mla_decode(*on, scale, None if picked is None else picked.to(device), splits)
    latent = cache.float()[page_table.long()].flatten(1, 2)  # each request's page row
    want = mla_decode_absorbed(q.float(), latent, kv_b.float(), lens, scale, picked)
    assert got.dtype == dtype and got.shape == want.shape, (got.dtype, got.shape)
    return _check_close(f"mla_decode {name}", got.float().cpu(), want, MLA_DECODE_TOL[dtype])


def _check_absorb(name: str, dtype: torch.dtype, device: str) -> dict:
    """`triton.absorb.absorb_query` and `expand_output` against `torch_ref`'s bmms over the
    float32 (dequantized) `kv_b`, both products in one case."""
    from snapfn.handler.llm.kernels.torch_ref import absorb_query, expand_output
    from snapfn.handler.llm.kernels.triton import absorb as tab

    tokens, heads, nope, rope, rank, dv, fp8 = ABSORB_SHAPES[name]
    gen = torch.Generator().manual_seed(heads * rank + nope)
    q = torch.randn(tokens, heads, nope + rope, generator=gen).to(dtype)
    out_latent = torch.randn(tokens, heads, rank, generator=gen).to(dtype)
    if fp8:  # scales differ block by block (`_random_fp8`)
        kv_b, scale_inv = _random_fp8((heads * (nope + dv), rank), "cpu")
        dense = dequantize_fp8_block(kv_b, scale_inv, torch.float32)
    else:
        kv_b = (torch.randn(heads * (nope + dv), rank, generator=gen) / 8).to(dtype)
        scale_inv, dense = None, kv_b.float()
    want_q, _, w_v = absorb_query(q.float(), dense, rank, rope)
    want_out = expand_output(out_latent.float(), w_v)
    on = [None if t is None else t.to(device) for t in (q, out_latent, kv_b, scale_inv)]
    assert tab.takes(tokens, on[2], on[3])
    got_q = tab.absorb_query(on[0], on[2], on[3], rope)
    got_out = tab.expand_output(on[1], on[2], on[3], nope)
    assert got_q.dtype == got_out.dtype == dtype, (got_q.dtype, got_out.dtype)
    tol = ABSORB_TOL[dtype]
    absorbed = _check_close(f"absorb {name}", got_q.float().cpu(), want_q, tol)
    expanded = _check_close(f"expand {name}", got_out.float().cpu(), want_out, tol)
    return {"absorb_max_abs_err": absorbed["max_abs_err"], **expanded}


def _check_fill_kv(name: str, device: str) -> dict:
    """`triton.indexer.fill_kv_indices` against `flashinfer.mla.fill_kv_indices`: the same
    slots wherever a row reads them (`kv_indices[:kv_indptr[-1]]`)."""
    from snapfn.handler.llm.kernels.flashinfer.mla import fill_kv_indices
    from snapfn.handler.llm.kernels.triton import indexer as ti

    rows, topk, page, width, positions, planned = FILL_KV_SHAPES[name]
    gen = torch.Generator().manual_seed(rows * topk)
    topk_indices = random_topk(positions, topk, gen)  # distinct positions below n, any order
    page_table = torch.randperm(rows * width, generator=gen).int().view(rows, width)
    kv_indptr = torch.tensor([0, *torch.tensor(planned).cumsum(0).tolist()], dtype=torch.int32)
    total = int(kv_indptr[-1])
    want = torch.full((rows * topk + 1,), -7, dtype=torch.int32)
    fill_kv_indices(want, topk_indices, page_table, kv_indptr, page)
    got = torch.full((rows * topk + 1,), -7, dtype=torch.int32, device=device)
    args = (topk_indices, page_table, kv_indptr)
    ti.fill_kv_indices(got, *(a.to(device) for a in args), page)
    got = got.cpu()
    assert torch.equal(got[:total], want[:total]), f"{name}: slots differ:\n{got}\n{want}"
    assert (got[total:] == -7).all(), f"{name}: wrote past the planned keys: {got[total:]}"
    return {"slots": total}


def _indexer_inputs(q_len: int, num_keys: int, heads: int, dim: int, seed: int, ties: bool):
    """Positive queries and keys (relu keeps every score), float32 head weights. Each key is
    scaled by its own factor (1, 1.25, 1.5, ... shuffled) so that scores are far apart: random
    keys of equal size give near-ties at the top-k cut, which a reordered float32 sum may flip."""
    gen = torch.Generator().manual_seed(seed)
    factors = 1 + 0.25 * torch.randperm(num_keys, generator=gen).float()
    k = (0.5 + 0.05 * torch.rand(num_keys, dim, generator=gen)) * factors[:, None]
    if ties:
        k[::3] = 0.0  # every third key scores exactly 0
    q = torch.rand(q_len, heads, dim, generator=gen)
    return q, torch.rand(q_len, heads, generator=gen) * heads**-0.5, k


def _assert_no_near_tie(scores: torch.Tensor, topk: int) -> None:
    """Picks can only be compared equal where the scores around each row's top-k cut are
    further apart than the kernel's error (exact ties at 0 are fine: the earlier key wins)."""
    ranked = scores.sort(dim=-1, descending=True).values
    cut = min(topk, ranked.shape[1] - 1)
    gaps = (ranked[:, cut - 1] - ranked[:, cut]).abs()
    near_tie = (gaps < 1e-4) & torch.isfinite(ranked[:, cut]) & (ranked[:, cut] != 0)
    assert not near_tie.any(), f"test data too close to a tie at the cut: {gaps}"


def _check_indexer_prefill(name: str, dtype: torch.dtype, device: str) -> dict:
    from snapfn.handler.llm.kernels.torch_ref import index_scores_one_seq, pick_causal_topk
    from snapfn.handler.llm.kernels.triton import indexer as ti

    q_len, q_offset, heads, dim, topk = INDEXER_PREFILL_SHAPES[name]
    q, weights, k = _indexer_inputs(
        q_len, q_offset + q_len, heads, dim, q_len * dim, name == "ties"
    )
    q, k = q.to(dtype), k.to(dtype)
    scale = dim**-0.5
    got = ti.index_scores_prefill(q.to(device), weights.to(device), k.to(device), q_offset, scale)
    want = index_scores_one_seq(q.float(), weights, k.float(), q_offset, scale)
    got = got.cpu()
    assert torch.equal(torch.isinf(got), torch.isinf(want)), "the causal mask differs"
    _check_close("index_scores_prefill", got, want, (1e-5, 1e-5))
    _assert_no_near_tie(want, topk)
    picked, want_picked = (pick_causal_topk(s, q_offset, topk) for s in (got, want))
    assert torch.equal(picked, want_picked), f"picks differ:\n{picked}\n{want_picked}"
    return {"max_abs_err": float((got - want).nan_to_num(0.0).abs().max())}


def _check_backend_indexer_prefill(dtype: torch.dtype, device: str) -> dict:
    """The triton backend's `dsa_topk` over a prefill batch (a whole prompt and a later chunk
    of another request) equals the torch backend's, through the kernel only when
    `prefill_indexer` is on."""
    from snapfn.handler.llm.engine.batch import ForwardBatch
    from snapfn.handler.llm.kernels.torch_ref import TorchBackend
    from snapfn.handler.llm.kernels.triton import indexer as ti
    from snapfn.handler.llm.kernels.triton.backend import TritonBackend

    heads, dim, page, topk = 4, 32, 4, 12
    # request 0: 9 new tokens at 0..8; request 1: 6 new tokens at 14..19 (14 cached)
    batch = ForwardBatch.build(
        [[1] * 9, [2] * 6], [0, 14], [[3, 0, 7], [1, 5, 2, 6, 8]], page, device
    )
    q, weights, _ = _indexer_inputs(15, 1, heads, dim, 11, ties=False)
    k_cache = _indexer_inputs(1, 9 * page, heads, dim, 12, ties=True)[2].view(9, page, dim)
    q, k_cache = q.to(dtype).to(device), k_cache.to(dtype).to(device)
    weights = weights.to(device)
    want = TorchBackend().dsa_topk(q.float(), weights, k_cache.float(), batch, topk, dim**-0.5)
    with _counting(ti, "index_scores_prefill") as calls:
        for mode, expected in (("off", 0), ("auto", 2)):
            got = TritonBackend(prefill_indexer=mode).dsa_topk(
                q, weights, k_cache, batch, topk, dim**-0.5
            )
            assert torch.equal(got.cpu(), want.cpu()), f"{mode}: picks differ"
            assert len(calls) == expected, f"{mode}: the kernel ran {len(calls)} times"
    return {"picked": int((want >= 0).sum())}


def _check_moe_configs(name: str, dtype: torch.dtype, device: str) -> dict:
    """Every config the MoE kernels may be tuned to, forced in turn: each tile must lie in one
    FP8 scale block and cover the rows, whichever the GPU's timing picks. A config the GPU
    cannot run is skipped, as the autotuner skips it."""
    from triton.runtime.errors import OutOfResources, PTXASError

    from snapfn.handler.llm.kernels.triton import moe as tm

    errors, skipped = [], 0
    for config in tm.MOE_GEMV_CONFIGS if name.startswith("gemv") else tm.MOE_CONFIGS:
        try:
            errors.append(_check_moe(name, dtype, device, config)["max_abs_err"])
        except (OutOfResources, PTXASError):
            skipped += 1
    assert errors, "no MoE config runs here"
    return {"max_abs_err": max(errors), "configs": len(errors), "skipped": skipped}


def _kernel_modules() -> list:
    from snapfn.handler.llm.kernels.triton import absorb as triton_absorb
    from snapfn.handler.llm.kernels.triton import attention as triton_attention
    from snapfn.handler.llm.kernels.triton import gemv as triton_gemv
    from snapfn.handler.llm.kernels.triton import indexer as triton_indexer
    from snapfn.handler.llm.kernels.triton import kernels as triton_kernels
    from snapfn.handler.llm.kernels.triton import mla as triton_mla
    from snapfn.handler.llm.kernels.triton import moe as triton_moe
    from snapfn.handler.llm.kernels.triton import sampling as triton_sampling

    return [
        triton_kernels,
        triton_moe,
        triton_attention,
        triton_indexer,
        triton_gemv,
        triton_sampling,
        triton_mla,
        triton_absorb,
    ]


def _check_autotuned() -> dict:
    """Each launched kernel (`*_kernel`) of our modules is autotuned, with results cached on
    GPUs, and its keys and config parameters are its own arguments (triton ignores a key that
    names none: the kernel would be tuned once for every shape)."""
    import triton

    kernels, tuners = set(), {}
    for module in _kernel_modules():
        for value in vars(module).values():
            if isinstance(value, triton.runtime.Autotuner):
                tuners[value.base_fn.__name__] = value
            elif isinstance(value, triton.runtime.KernelInterface):
                kernels.add(getattr(value, "__name__", ""))
    launched = {name for name in kernels if name.endswith("_kernel")}
    assert launched == set(tuners) == set(AUTOTUNED_KERNELS), (launched, sorted(tuners))
    for name, tuner in tuners.items():
        assert set(tuner.keys) <= set(tuner.arg_names), f"{name}: key {tuner.keys}"
        for config in tuner.configs:
            assert set(config.kwargs) <= set(tuner.arg_names), f"{name}: config {config}"
        assert tuner.cache_results or interpreted(), f"{name}: results not cached"
    # the fused GEMV times its wider FP8 configs for FP8 weights only
    from snapfn.handler.llm.kernels.triton import gemv as tg

    prune = tuners["_gemv_kernel"].early_config_prune

    def labels(configs) -> set[str]:  # compared as sets: prune keeps the autotuner's order
        return {str(c) for c in configs}

    assert labels(prune(tg.GEMV_ALL_CONFIGS, {}, SCALED=False)) == labels(tg.GEMV_CONFIGS)
    assert labels(prune(tg.GEMV_ALL_CONFIGS, {}, SCALED=True)) == labels(tg.GEMV_FP8_CONFIGS)
    assert len(labels(tg.GEMV_ALL_CONFIGS)) == len(tg.GEMV_ALL_CONFIGS), "a config listed twice"
    return {"kernels": len(tuners)}


def run_autotuned_once(device: str) -> None:
    """One call of each autotuned kernel at a model's shapes, hitting each kernel's keys of
    `AUTOTUNED_KERNELS`: the 8B llama's widths, heads and FP8 weight blocks; GLM-5's indexer
    and expert widths (8 local experts)."""
    _run_llama_kernels(device)
    _run_glm_kernels(device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _randn(*shape: int, device: str, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(shape, device=device).to(dtype)


def _random_fp8_on(*shape: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-scaled FP8 weights `[..., N, K]` and their scales, made on `device`."""
    from snapfn.handler.llm.weights.quant import FP8_DTYPE

    blocks = (-(-shape[-2] // 128), -(-shape[-1] // 128))
    scales = torch.rand(*shape[:-2], *blocks, device=device)
    return (0.1 * torch.randn(shape, device=device)).to(FP8_DTYPE), scales


def _run_llama_kernels(device: str, tokens: int = 4) -> None:
    from snapfn.handler.llm.kernels.triton import attention as ta
    from snapfn.handler.llm.kernels.triton import gemv as tg
    from snapfn.handler.llm.kernels.triton import kernels as tk
    from snapfn.handler.llm.kernels.triton import sampling as ts

    x, weight = _randn(tokens, 4096, device=device), _randn(4096, device=device)
    tk.rms_norm(x, weight, 1e-6)
    tk.add_rms_norm(x, _randn(tokens, 4096, device=device), weight, 1e-6)
    q, scale_inv = _random_fp8_on(1024, 4096, device=device)
    tk.dequantize_fp8_block(q, scale_inv, torch.bfloat16)
    tk.fp8_block_linear(_randn(1, 4096, device=device), q, scale_inv)
    qkv = _randn(tokens, (32 + 2 * 8) * 128, device=device).unflatten(-1, (-1, 128))
    q_heads, k_heads, v_heads = qkv.split([32, 8, 8], dim=1)
    k_cache, v_cache = (_randn(64, 16, 8, 128, device=device) for _ in "kv")
    angles = torch.rand(tokens, 64, device=device)
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    slots = torch.arange(tokens, device=device)
    tk.rope_store_kv(q_heads, k_heads, v_heads, cos, sin, False, k_cache, v_cache, slots)
    tk.silu_mul(_randn(tokens, 2 * 14336, device=device))
    tk.rope_part(q_heads, cos[:, :32], sin[:, :32], True, 64)  # MLA's q_nope | rope(q_rope)
    page_table = torch.arange(tokens * 16, device=device, dtype=torch.int32).view(tokens, 16)
    seq_lens = torch.full((tokens,), 200, device=device, dtype=torch.int32)
    q_new = _randn(tokens, 32, 128, device=device)
    ta.paged_decode_attention(q_new, k_cache, v_cache, page_table, seq_lens, 0.1)
    row = _randn(1, 4096, device=device)
    norm = _randn(4096, device=device)
    tg.gemv(row, _randn(6144, 4096, device=device), norm_weight=norm, residual=row)
    ts.greedy_picks(torch.randn(1, 128256, device=device))


def _run_glm_kernels(device: str, tokens: int = 4) -> None:
    from types import SimpleNamespace

    from snapfn.handler.llm.kernels.base import ExpertWeights
    from snapfn.handler.llm.kernels.triton import gemv as tg
    from snapfn.handler.llm.kernels.triton import indexer as ti
    from snapfn.handler.llm.kernels.triton import kernels as tk
    from snapfn.handler.llm.kernels.triton import moe as tm

    q, weights = _randn(tokens, 32, 128, device=device), torch.rand(tokens, 32, device=device)
    k_cache = _randn(64, 16, 128, device=device)
    page_table = torch.arange(tokens * 16, device=device, dtype=torch.int32).view(tokens, 16)
    seq_lens = torch.full((tokens,), 200, device=device, dtype=torch.int32)
    scores = ti.index_scores_decode(q, weights, k_cache, page_table, seq_lens, 0.1)
    picked = ti.select_topk_decode(scores, seq_lens, 2048)  # GLM-5's index_topk
    kv_indptr = torch.arange(tokens + 1, device=device, dtype=torch.int32) * 200
    kv_indices = torch.empty(tokens * 2048 + 1, device=device, dtype=torch.int32)
    ti.fill_kv_indices(kv_indices, picked, page_table, kv_indptr, 16)
    from snapfn.handler.llm.kernels.triton import mla as triton_mla  # MLA decode over those picks

    q_mla, kv_b = _randn(tokens, 64, 256, device=device), _randn(64 * 448, 512, device=device)
    cache = _randn(64, 16, 576, device=device)  # GLM-5's latent rows: 512 | 64
    triton_mla.mla_decode(q_mla, cache, kv_b, page_table, seq_lens, 0.1, picked)
    from snapfn.handler.llm.kernels.triton import absorb as tab  # its products, FP8 kv_b

    kv_b_fp8, kv_b_scale = _random_fp8_on(64 * 448, 512, device=device)
    tab.expand_output(tab.absorb_query(q_mla, kv_b_fp8, kv_b_scale, 64), kv_b_fp8, kv_b_scale, 192)
    ti.index_scores_prefill(q, weights, _randn(200, 128, device=device), 196, 0.1)
    gate, up = (_random_fp8_on(8, 2048, 6144, device=device) for _ in "gu")
    down = _random_fp8_on(8, 6144, 2048, device=device)
    experts = ExpertWeights(gate[0], up[0], down[0], gate[1], up[1], down[1])
    for num_tokens in (tokens, 256):  # 16- and 64-row tiles (`block_m_for`)
        ids = torch.rand(num_tokens, 8, device=device).argsort(dim=-1)  # top-8 of 8 experts
        x = _randn(num_tokens, 6144, device=device)
        tm.fused_moe(x, experts, ids, torch.rand(num_tokens, 8, device=device))
    tm.moe_gemv(x[:1], experts, ids[:1], torch.rand(1, 8, device=device))  # one token
    glm5_routing = dict(n_routed_experts=256, n_group=8, topk_group=4, num_experts_per_tok=8)
    routing = SimpleNamespace(**glm5_routing, norm_topk_prob=True, routed_scaling_factor=2.5)
    tm.route(torch.randn(tokens, 256, device=device), torch.zeros(256, device=device), routing)
    q_a, q_a_scale = _random_fp8_on(2048, 6144, device=device)  # an FP8 projection of one row
    tg.gemv(x[:1], q_a, weight_scale_inv=q_a_scale)
    latent = _randn(tokens, 576, device=device)  # MLA's latent: norm(c) | rope(k_rope)
    angles = torch.rand(tokens, 32, device=device)
    slots = torch.arange(tokens, device=device)
    tk.norm_rope_store(latent, _randn(512, device=device), 1e-6, angles.cos().bfloat16(),
                       angles.sin().bfloat16(), True, _randn(8, 16, 576, device=device), slots)  # fmt: skip
    index_k = _randn(tokens, 128, device=device)  # the indexer's key: rope(layer_norm(k))
    tk.layer_norm_rope_store(index_k, _randn(128, device=device), _randn(128, device=device),
                             1e-6, angles.cos().bfloat16(), angles.sin().bfloat16(), True,
                             _randn(8, 16, 128, device=device), slots)  # fmt: skip


def _check_sum64(shape: str, device: str) -> dict:
    """The kernel's chunk sums equal torch's (`checksum.sum64`) bit for bit, extreme words
    included; on CUDA `chunk_sums` and `sum64_bytes` take the kernel and agree too."""
    from snapfn.snapshot.layout import sum64_triton
    from snapfn.snapshot.layout.checksum import chunk_sums, sum64, sum64_bytes

    chunks, words = SUM64_SHAPES[shape]
    g = torch.Generator().manual_seed(5)
    data = torch.randint(-(2**63), 2**63 - 1, (chunks, words), dtype=torch.int64, generator=g)
    data.view(-1)[:4] = torch.tensor([-1, 2**63 - 1, -(2**63), 0])[: data.numel()]
    want = torch.stack([sum64(row) for row in data])
    on_device = data.to(device)
    got = sum64_triton.partial_sums(on_device).sum(1).cpu()
    assert torch.equal(got, want), (got, want)
    raw = on_device.view(-1).view(torch.uint8)
    assert torch.equal(chunk_sums(raw, words * 8).cpu(), want)
    assert int(sum64_bytes(raw[: words * 8])) == int(want[0])
    return {"chunks": chunks, "words": words}


def run_case(case: str, device: str) -> dict:
    """Run one case of `CASES`; raises AssertionError on a mismatch, else returns its error."""
    if case == "autotuned":
        return _check_autotuned()
    kind, *rest = case.split("-")
    if kind == "fill_kv":
        return _check_fill_kv(rest[0], device)
    if kind == "store_refusals":
        return _check_store_refusals(device)
    if kind == "sum64":
        return _check_sum64(rest[0], device)
    dtype = DTYPES[rest[-1]]
    if kind in ("rms_norm", "add_rms_norm"):
        return _check_rms_norm(RMS_SHAPES[rest[0]], dtype, device, fused=kind == "add_rms_norm")
    if kind == "rope_store":
        return _check_rope_store(ROPE_SHAPES[rest[0]], dtype, device)
    if kind == "route":
        return _check_route(rest[0], device)
    if kind == "select":
        return _check_select(rest[0], device)
    if kind == "rope_part":
        return _check_rope_part(ROPE_PART_SHAPES[rest[0]], dtype, device)
    if kind == "norm_rope_store":
        return _check_norm_rope_store(NORM_ROPE_SHAPES[rest[0]], dtype, device)
    if kind == "layer_norm_rope_store":
        return _check_layer_norm_rope_store(LAYER_NORM_ROPE_SHAPES[rest[0]], dtype, device)
    if kind == "silu_mul":
        return _check_silu_mul(SILU_SHAPES[rest[0]], dtype, device)
    if kind == "dequant_fp8":
        return _check_dequant(FP8_SHAPES[rest[0]], dtype, device)
    if kind == "fp8_gemm":
        return _check_fp8_gemm(rest[0], dtype, device)
    if kind == "linear_fp8":
        return _check_linear(dtype, device)
    if kind == "engine_greedy":
        return _check_engine_greedy("-".join(rest[:-1]), rest[-1], device)
    if kind == "indexer_prefill":
        return _check_indexer_prefill(rest[0], dtype, device)
    if kind == "backend_indexer_prefill":
        return _check_backend_indexer_prefill(dtype, device)
    if kind == "indexer":
        return _check_indexer(rest[0], dtype, device)
    if kind == "moe":
        return _check_moe(rest[0], dtype, device)
    if kind == "moe_configs":
        return _check_moe_configs(rest[0], dtype, device)
    if kind == "backend_decode":
        return _check_backend_decode(dtype, device)
    if kind == "greedy_picks":
        return _check_picks(PICKS_SHAPES[rest[0]], device)
    if kind == "backend_gemv":
        return _check_backend_gemv(dtype, device)
    if kind == "gemv":
        return _check_gemv(rest[0], dtype, device)
    if kind == "decode_attention":
        return _check_decode(DECODE_SHAPES[rest[0]], dtype, device, DECODE_SPLITS[rest[0]])
    if kind == "mla_decode":
        return _check_mla_decode(rest[0], dtype, device)
    if kind == "absorb":
        return _check_absorb(rest[0], dtype, device)
    raise ValueError(f"unknown case {case!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--autotune-once", action="store_true", help="see run_autotuned_once")
    args = parser.parse_args(argv)
    if args.autotune_once:  # SNAPFN_KERNEL_TUNING decides whether configs are timed
        from snapfn.handler.llm.kernels.triton import tuning

        tuning.use_tuning(tuning.KernelTuning.from_env(os.environ))
        run_autotuned_once(args.device)
        print(json.dumps({"kernel_choices": tuning.choice_counts()}), flush=True)
        return 0
    for case in CASES:
        try:
            result = {"case": case, "ok": True, **run_case(case, args.device)}
        except AssertionError as exc:
            result = {"case": case, "ok": False, "error": str(exc)}
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
