"""Triton backend: the torch reference with our own Triton kernels where they cover an op.

Today that is only the FP8 path of `linear`: the 128x128 block-scaled weight is dequantized by
a Triton kernel, then multiplied by `F.linear` like the reference does. Everything else is
inherited from `TorchBackend`, which stays the oracle. Nothing of this is verified on a GPU
yet (docs/kernels.md).
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
