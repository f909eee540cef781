"""FlashInfer's MLA kernel for `glm_moe_dsa`: sparse (DSA top-k) latent attention.

`flashinfer.mla.BatchMLAPagedAttentionWrapper` attends over the latent cache with `kv_b`
absorbed (FlashMLA's form, as `torch_ref.mla_decode_absorbed`): per head, the query becomes
`W_k^T q_nope` in latent space (`R` values) beside its RoPE part, every key is a cached latent
`c | k_rope`, and the output is `sum p c`, which `W_v` maps to the head's values. Each query
attends only to its own `topk_indices` keys, so every query row is its own flashinfer
"request" (one query, its `n` selected keys) over the cache viewed with page size 1
(`[P * S, 1, R + Dr]`, `c` and `k_rope` strided views of it): a key's "page" is its slot.
This serves prefill (each token its own selection) and decode alike.

Planning (host): each row's key count `n = min(position + 1, topk)` (the indexer selects every
causal key up to `topk`; `dsa_topk` documents it) gives `kv_indptr`; flashinfer's `plan()`
splits the work. The key slots themselves are data: `fill_kv_indices` (the reference; on
CUDA its one-launch Triton twin in `triton.indexer`) writes them from the top-k on the GPU,
compacted by `kv_indptr`, on every layer (the full indexer layers select
anew), so decode CUDA graphs capture it; the plan is redone before each replay, into the
graph's fixed buffers (flashinfer's CUDA-graph mode), like the llama decode plan.

Covered: bfloat16 / float16, `R = 512`, `Dr = 64` (the MLA shapes flashinfer's kernels are
built for: DeepSeek-V3's and GLM-5's); anything else runs the reference.
GPU-tested on the H200 (`tests/flashinfer_checks.py`, docs/kernels.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import torch

from snapfn.handler.llm.engine.batch import ForwardBatch
from snapfn.handler.llm.kernels.flashinfer.plan import ForwardPlan

DTYPES = (torch.float16, torch.bfloat16)
LATENT_DIMS = ((512, 64),)  # (R, Dr) flashinfer's MLA kernels are built for


@dataclass(frozen=True)
class MLAShape:
    """What an MLA plan is specialised for; every layer of a model has the same."""

    num_heads: int
    rank: int  # R, the latent's width
    rope_dim: int  # Dr
    topk: int
    dtype: torch.dtype
    scale: float

    @classmethod
    def of(cls, q, latent_cache, rank: int, scale: float, topk_indices) -> MLAShape | None:
        """The shape, or None where flashinfer's MLA does not apply (the reference runs it):
        dense attention (no top-k), another dtype, or latent widths it is not built for."""
        rope_dim = latent_cache.shape[-1] - rank
        if topk_indices is None or q.dtype not in DTYPES or latent_cache.dtype != q.dtype:
            return None
        if (rank, rope_dim) not in LATENT_DIMS:
            return None
        return cls(q.shape[1], rank, rope_dim, topk_indices.shape[1], q.dtype, scale)


@dataclass(frozen=True)
class RowPlan:
    """A batch's query rows as flashinfer requests (host arrays)."""

    kv_lens: np.ndarray  # [T] int32 keys row t attends to
    kv_indptr: np.ndarray  # [T+1] int32 row t's keys are kv_indices[kv_indptr[t]:kv_indptr[t+1]]
    request: np.ndarray  # [T] int64 request of row t (its page-table row)


def row_plan(batch: ForwardBatch, topk: int) -> RowPlan:
    """Per query row: its request and its number of selected keys, `min(position + 1, topk)`.
    Read from the batch's host copies where it has them (no wait for the GPU)."""
    if batch.seq_lens_cpu:
        seq_lens = np.asarray(batch.seq_lens_cpu, dtype=np.int64)
        q_lens = np.asarray(batch.q_lens_cpu, dtype=np.int64)
    else:
        seq_lens = batch.seq_lens.cpu().numpy().astype(np.int64)
        q_lens = np.diff(batch.cu_q_lens.cpu().numpy().astype(np.int64))
    request = np.repeat(np.arange(len(q_lens)), q_lens)  # [T]
    first = np.repeat(seq_lens - q_lens, q_lens)  # position of each request's first new token
    within = np.arange(len(request)) - np.repeat(np.cumsum(q_lens) - q_lens, q_lens)
    kv_lens = np.minimum(first + within + 1, topk).astype(np.int32)
    kv_indptr = np.concatenate(([0], np.cumsum(kv_lens))).astype(np.int32)
    return RowPlan(kv_lens, kv_indptr, request)


def fill_kv_indices(
    kv_indices: torch.Tensor,  # [>= T * topk + 1] int32; its last element takes the unselected
    topk_indices: torch.Tensor,  # [T, topk] int32 key positions within the request, -1 = none
    page_table: torch.Tensor,  # [T, W] int32: each row's page-table row
    kv_indptr: torch.Tensor,  # [T+1] int32 on the device
    page_size: int,
) -> None:
    """Write each row's selected keys as cache slots (`page * page_size + offset`), row `t`'s at
    `kv_indptr[t]` on, in selection order. A row never writes past its planned count: a
    selection with more keys than that (which `dsa_topk` never returns) is cut, not spilled
    into the next row's keys. No host syncs: CUDA-graph capturable."""
    valid = topk_indices >= 0
    pos = topk_indices.clamp(min=0).long()
    pages = torch.gather(page_table, 1, pos // page_size).long()  # [T, topk]
    slots = pages * page_size + pos % page_size
    rank = valid.long().cumsum(1)  # 1-based, among the row's selected keys
    valid &= rank <= kv_indptr.diff()[:, None]
    dest = torch.where(valid, kv_indptr[:-1, None].long() + rank - 1, kv_indices.shape[0] - 1)
    kv_indices.scatter_(0, dest.flatten(), slots.flatten().to(kv_indices.dtype))


class _Buffers:
    """One plan's device arrays: flashinfer reads them, `fill_kv_indices` writes the keys. A
    graph wrapper's are fixed (its capture reads them) and all four are flashinfer's; an eager
    plan makes its own `kv_indptr` and `kv_indices` (flashinfer uploads the other two)."""

    def __init__(self, rows: int, topk: int, device: torch.device, graph: bool = False) -> None:
        def ints(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=device)

        self.kv_indptr = ints(rows + 1)
        self.kv_indices = ints(rows * topk + 1)
        self.qo_indptr = ints(rows + 1) if graph else None
        self.kv_lens = ints(rows) if graph else None
        # each query row's page-table row (gathered once per plan)
        self.page_table: torch.Tensor | None = None


class FlashInferMLA:
    """The MLA half of the flashinfer backend: plans and runs `mla_attention`. The backend owns
    one, shares its workspace and tells it of each forward (`begin_forward`)."""

    def __init__(self, flashinfer: ModuleType, workspace) -> None:
        self._fi = flashinfer
        self._workspace = workspace  # () -> the shared float workspace on the batch's device
        self._graphed: dict[int, tuple[Any, _Buffers]] = {}  # rows -> wrapper, its buffers
        self._eager: Any = None
        self._forward = ForwardPlan("flashinfer MLA", self._plan)  # -> (wrapper, buffers)

    def begin_forward(self, batch: ForwardBatch, graph: bool) -> None:
        self._forward.begin_forward(batch, graph)

    def attention(self, q_latent, q_pe, latent_cache, batch, shape: MLAShape, topk_indices):
        """The queries, `kv_b` absorbed (`q_latent [T, H, R]`: each head's `W_k^T q_nope`;
        `q_pe [T, H, Dr]`), over their top-k latents -> `[T, H, R]`, the latent output the
        caller maps through `W_v` (`TritonBackend.absorb_kv_b`)."""
        wrapper, buffers = self._forward.for_call(batch, shape)
        rank = shape.rank
        fill = fill_kv_indices
        if q_latent.is_cuda:  # one Triton launch (`triton.indexer.fill_kv_indices`); triton is here
            from snapfn.handler.llm.kernels.triton.indexer import fill_kv_indices as fill
        fill(
            buffers.kv_indices, topk_indices, buffers.page_table, buffers.kv_indptr, batch.page_size
        )
        flat = latent_cache.view(-1, 1, latent_cache.shape[-1])  # page size 1: a slot a page
        return wrapper.run(q_latent, q_pe, flat[..., :rank], flat[..., rank:])  # [T, H, R]

    def _plan(self, batch: ForwardBatch, graph: bool, shape: MLAShape) -> tuple[Any, _Buffers]:
        if graph and not batch.is_decode:
            raise ValueError("only decode batches run in CUDA graphs")
        rows = row_plan(batch, shape.topk)
        device = batch.seq_lens.device
        num_rows = len(rows.kv_lens)
        kv_indptr = torch.from_numpy(rows.kv_indptr)
        # NOTE: plan() takes its CSR arrays on the host (it reads them there, and copies them
        # into a graph wrapper's buffers or to the device itself); the key slots it is given
        # only for an eager wrapper: the device buffer that each layer fills
        if graph:
            wrapper, buffers = self._graph_wrapper(num_rows, shape.topk, device)
            indices = buffers.kv_indices[:0]  # filled on the GPU by each layer
        else:
            buffers = _Buffers(num_rows, shape.topk, device)
            buffers.kv_indptr.copy_(kv_indptr, non_blocking=True)  # for `fill_kv_indices`
            if self._eager is None:
                self._eager = self._fi.mla.BatchMLAPagedAttentionWrapper(self._workspace(device))
            wrapper, indices = self._eager, buffers.kv_indices
        if batch.is_decode:  # a row a request (a graph's: its static table)
            buffers.page_table = batch.page_table
        else:
            request = torch.from_numpy(rows.request).to(device, non_blocking=True)
            buffers.page_table = batch.page_table[request]
        wrapper.plan(
            torch.arange(num_rows + 1, dtype=torch.int32),
            kv_indptr,
            indices,
            torch.from_numpy(rows.kv_lens),
            shape.num_heads,
            shape.rank,
            shape.rope_dim,
            1,  # page size 1: kv_indices are cache slots
            False,  # each row's keys are its own selection, causal by construction
            shape.scale,
            shape.dtype,
            shape.dtype,
        )
        return wrapper, buffers

    def _graph_wrapper(self, rows: int, topk: int, device: torch.device):
        if rows not in self._graphed:
            buffers = _Buffers(rows, topk, device, graph=True)
            wrapper = self._fi.mla.BatchMLAPagedAttentionWrapper(
                self._workspace(device),
                use_cuda_graph=True,
                qo_indptr=buffers.qo_indptr,
                kv_indptr=buffers.kv_indptr,
                kv_indices=buffers.kv_indices,
                kv_len_arr=buffers.kv_lens,
            )
            self._graphed[rows] = (wrapper, buffers)
        return self._graphed[rows]
