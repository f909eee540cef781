"""Greedy picks in Triton: each row's argmax of the logits and its logprob, in two launches.

    tokens, picked = greedy_picks(logits)   # as `engine.sampler.greedy_picks`, the reference

The reference runs torch's argmax and a whole-vocabulary `log_softmax` (gathered at the argmax),
then casts and concatenates: about eight kernels, some 60 us a decode step on the H200 for a
128k vocabulary (bench/results/2026-11-30-h200-steady-llama8b-backends), between one step's graph and the next. Here one program
per (row, chunk of the vocabulary) finds its chunk's maximum, the first index holding it and the
sum of `exp(logit - maximum)`; one program per row then combines the chunks: the token is the
first index of the row's maximum (torch's argmax picks the first too) and its logprob is
`maximum - logsumexp(row)`, which is what `log_softmax` gives at the argmax.

NOTE: imports triton at import time (see triton_kernels.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from snapfn.handler.llm.kernels.triton.kernels import (
    _check_device,
    autotuned,
    tuned_or_fixed,
    warps_configs,
)

CHUNK = 4096  # vocabulary entries per first-stage program


@triton.jit
def _chunk_kernel(
    logits_ptr, max_ptr, index_ptr, sum_ptr, vocab, row_stride, num_chunks, CHUNK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(logits_ptr + row * row_stride + cols, mask=cols < vocab, other=float("-inf"))
    x = x.to(tl.float32)
    top, first = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    total = tl.sum(tl.exp(x - tl.where(top == float("-inf"), 0.0, top)), axis=0)
    out = row * num_chunks + chunk
    tl.store(max_ptr + out, top)
    tl.store(index_ptr + out, chunk * CHUNK + first)
    tl.store(sum_ptr + out, total)


# keyed by the vocabulary's size alone: the rows change the grid, not a program's work
_chunk_tuned = autotuned(_chunk_kernel, warps_configs(4, 8, 16), key=["vocab"])


@triton.jit
def _row_kernel(
    max_ptr, index_ptr, sum_ptr, tokens_ptr, picked_ptr, num_chunks, CHUNKS_PAD: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS_PAD)
    live = c < num_chunks
    tops = tl.load(max_ptr + row * num_chunks + c, mask=live, other=float("-inf"))
    # the first chunk holding the row's maximum holds its first index
    top, best = tl.max(tops, axis=0, return_indices=True, return_indices_tie_break_left=True)
    token = tl.load(index_ptr + row * num_chunks + best).to(tl.int64)
    sums = tl.load(sum_ptr + row * num_chunks + c, mask=live, other=0.0)
    lse = top + tl.log(tl.sum(sums * tl.exp(tops - top), axis=0))
    tl.store(tokens_ptr + row, token)
    tl.store(picked_ptr + row * 2, token.to(tl.float64))
    tl.store(picked_ptr + row * 2 + 1, (top - lse).to(tl.float64))


_row_tuned = autotuned(_row_kernel, warps_configs(1, 2), key=["num_chunks"])


def greedy_picks(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's argmax of `logits [B, V]`, on their device, with no host sync: (tokens [B]
    int64, [B, 2] float64 of token id and its logprob), as `sampler.greedy_picks`."""
    _check_device(logits)
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [B, V] with contiguous rows, got {tuple(logits.shape)}")
    rows, vocab = logits.shape
    num_chunks = triton.cdiv(vocab, CHUNK)
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    picked = torch.empty(rows, 2, dtype=torch.float64, device=logits.device)
    if rows and vocab:
        scratch = torch.empty(3, rows, num_chunks, dtype=torch.float32, device=logits.device)
        index = torch.empty(rows, num_chunks, dtype=torch.int32, device=logits.device)
        kernel, fixed = tuned_or_fixed(_chunk_tuned)
        kernel[(rows, num_chunks)](
            logits,
            scratch[0],
            index,
            scratch[1],
            vocab,
            logits.stride(0),
            num_chunks,
            CHUNK=CHUNK,
            **fixed,
        )
        kernel, fixed = tuned_or_fixed(_row_tuned)
        kernel[(rows,)](
            scratch[0],
            index,
            scratch[1],
            tokens,
            picked,
            num_chunks,
            CHUNKS_PAD=triton.next_power_of_2(num_chunks),
            **fixed,
        )
    return tokens, picked
