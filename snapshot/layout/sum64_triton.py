"""sum64 of many chunks in one Triton kernel (CUDA): each chunk's words read once, their
products with the odd weights summed in registers, instead of torch's multiply (writing the
products) and row sum (reading them back), three passes over the data.

    partial_sums(rows)      [num_chunks, parts] int64 partial sums of [num_chunks, words] int64
                            rows; their row sums (mod 2^64, in any order) are the chunks' sum64

The arithmetic is unsigned 64-bit, which wraps mod 2^64 by definition (checksum.py's module
docstring: the value does not depend on the order of the sums). triton is imported by the
caller, only where it is present; `tests/triton_checks.py` compares it with the torch path
(checksum.chunk_sums with the kernel off), bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # words a step of one program (8 KiB)
SPAN_BLOCKS = 64  # steps a program takes: 512 KiB of a chunk each


# NOTE: the sizes are not specialised on (Triton would compile a variant per divisibility of
# each): one compiled kernel serves every chunk size, so the one an init warms
# (checksum.warm_kernel) is the one every restore runs, and none compiles there
@triton.jit(do_not_specialize=["words", "parts"])
def _partial_sum64(rows, out, words, parts, SPAN: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    base = rows + row.to(tl.int64) * words
    acc = tl.zeros([BLOCK], dtype=tl.uint64)
    for step in range(0, SPAN, BLOCK):
        idx = part.to(tl.int64) * SPAN + step + tl.arange(0, BLOCK)
        word = tl.load(base + idx, mask=idx < words, other=0).to(tl.uint64, bitcast=True)
        acc += word * (idx.to(tl.uint64) * 2 + 1)
    total = tl.sum(acc, axis=0).to(tl.int64, bitcast=True)
    tl.store(out + row.to(tl.int64) * parts + part, total)


def partial_sums(rows: torch.Tensor) -> torch.Tensor:
    """[num_chunks, parts] int64 partial sum64s of contiguous [num_chunks, words] int64 `rows`."""
    assert rows.dtype == torch.int64 and rows.dim() == 2 and rows.is_contiguous()
    num_chunks, words = rows.shape
    span = BLOCK * SPAN_BLOCKS
    parts = -(-words // span)
    out = torch.empty(num_chunks, parts, dtype=torch.int64, device=rows.device)
    if num_chunks:
        _partial_sum64[(num_chunks, parts)](rows, out, words, parts, SPAN=span, BLOCK=BLOCK)
    return out
