"""Triton backend: the torch reference with our own Triton kernels where they cover an op.

- `linear` with an FP8 weight: the 128x128 block-scaled weight is dequantized by a Triton
  kernel, then multiplied by `F.linear` like the reference does (GPU-tested on the H200);
- `rms_norm`: one program per row (GPU-tested on the H200 as a kernel; in the models since
  session 4, checked there under triton's interpreter only);
- `moe`: `triton_moe.fused_moe`, no host sync (the reference's `.tolist()` keeps decode graphs
  from capturing a MoE model); bf16 / fp32 and FP8 block-scaled experts (checked under triton's
  interpreter only);
- `dsa_topk` for decode batches: `triton_indexer.indexer_topk_decode` scores only each
  request's own keys, then picks like the reference (checked under the interpreter only);
- `paged_attention` for decode batches: `triton_attention.paged_decode_attention`, which reads
  only each request's own pages (checked against the reference under triton's interpreter;
  not yet run on a GPU).

Everything else is inherited from `TorchBackend`, which stays the oracle (docs/kernels.md).
"""

from __future__ import annotations

import torch.nn.functional as F

from .torch_ref import TorchBackend


class TritonBackend(TorchBackend):
    name = "triton"

    def linear(self, x, weight, bias=None, weight_scale_inv=None):
        if weight_scale_inv is None:
            return super().linear(x, weight, bias)
        # lazy: importing triton takes seconds and the package must import without it
        from .triton_kernels import dequantize_fp8_block

        return F.linear(x, dequantize_fp8_block(weight, weight_scale_inv, x.dtype), bias)

    def moe(self, x, experts, topk_ids, topk_weights):
        from .triton_moe import fused_moe

        return fused_moe(x, experts, topk_ids, topk_weights)

    def dsa_topk(self, q, weights, k_cache, batch, topk, scale):
        if not batch.is_decode:
            return super().dsa_topk(q, weights, k_cache, batch, topk, scale)
        from .triton_indexer import indexer_topk_decode

        return indexer_topk_decode(
            q, weights, k_cache, batch.page_table, batch.seq_lens, topk, scale
        )

    def rms_norm(self, x, weight, eps):
        from .triton_kernels import rms_norm

        return rms_norm(x, weight, eps)

    def paged_attention(self, q, k_cache, v_cache, batch, scale):
        if not batch.is_decode:
            return super().paged_attention(q, k_cache, v_cache, batch, scale)
        from .triton_attention import paged_decode_attention

        return paged_decode_attention(
            q, k_cache, v_cache, batch.page_table, batch.seq_lens, scale
        ).to(q.dtype)
