"""FlashInfer backend: the Triton backend with FlashInfer's paged attention (llama family) and
its MLA kernel (`glm_moe_dsa`'s sparse latent attention: `flashinfer.mla`).

- `paged_attention` for decode batches (one new token per request):
  `flashinfer.BatchDecodeWithPagedKVCacheWrapper`, eagerly or, inside decode CUDA graphs, in
  its CUDA-graph mode (page metadata in buffers fixed per graph);
- `paged_attention` for prefill and mixed batches: `BatchPrefillWithPagedKVCacheWrapper`,
  causal over each request's cached prefix.

Both read the pool's separate K and V caches (`[num_pages, page_size, Hkv, D]` each, flashinfer's
"NHD" layout, passed as a `(k, v)` tuple) through the batch's pages in flashinfer's CSR form
(`paged_kv_metadata`). float16 / bfloat16 only, CUDA only, `D == Dv`. Everything else (the
fused norms, RoPE and SwiGLU, FP8 linear, MoE, the DSA indexer) is inherited from
`TritonBackend` (triton ships with torch's CUDA wheels; flashinfer needs it too), whose own
fallbacks are the torch reference, the oracle (docs/kernels.md).

Planning: flashinfer splits attention into `plan()` (host work: the page metadata and the
split-KV schedule, copied to the GPU; it syncs with the host, so it never runs inside CUDA
graph capture) and `run()` (kernels only). One plan per forward serves every layer; when a
forward is planned is `flashinfer.plan.ForwardPlan`'s to say (announced graph forwards at
`begin_forward`, others at their first call). A plan also depends on the attention's shape
(heads, head dim, dtype, scale).

GPU-tested on the H200: `tests/test_flashinfer.py -m gpu` (2026-11-30 and since;
docs/kernels.md). `mla_attention` with a DSA selection and latent widths flashinfer is built for
goes to `FlashInferMLA`, which plans like the above (per forward, a graph's into its buffers);
decode batches on the GPU go to `triton.mla` instead (no plan, no pinned copy a step; faster on
the H200, docs/kernels.md), unless `mla_decode="off"` (SNAPFN_MLA_DECODE=off).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import torch

from snapfn.handler.llm.engine.batch import ForwardBatch
from snapfn.handler.llm.kernels.flashinfer.mla import FlashInferMLA, MLAShape
from snapfn.handler.llm.kernels.flashinfer.plan import ForwardPlan
from snapfn.handler.llm.kernels.triton.backend import TritonBackend
from snapfn.snapshot.errors import InitFailed

FLASHINFER_VERSION = "0.6.9"  # the release this backend is written and checked against
WORKSPACE_BYTES = 128 << 20  # split-KV partial results; flashinfer's recommended size
DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIMS = (64, 128, 256)  # what flashinfer's decode and prefill templates are built for
GROUP_SIZES = (1, 2, 3, 4, 8)  # query heads per KV head its CUDA-core decode dispatches
KV_LAYOUT = "NHD"  # a page is [page_size, Hkv, D]: the KV pool's layout
# who runs decode batches' attention (SNAPFN_DECODE_ATTENTION): "flashinfer"'s decode kernel,
# the "triton" split-KV kernel the triton backend runs, or "auto": Triton for decode batches of
# at most TRITON_DECODE_MAX_ROWS requests, flashinfer for larger ones
DECODE_ATTENTION = "auto"
TRITON_DECODE_MAX_ROWS = 1


def import_flashinfer() -> ModuleType:
    """The flashinfer module, or InitFailed saying how to install it.

    NOTE: imported when the backend is built, never at module import: importing flashinfer
    initialises CUDA (it names its JIT cache after each GPU's compute capability) and reads
    FLASHINFER_WORKSPACE_BASE, which the runtime_env stage sets first.
    """
    try:
        import flashinfer
    except ImportError as exc:
        raise InitFailed(
            f"backend 'flashinfer' needs the flashinfer-python package, which does not import "
            f"here ({exc}); on a CUDA machine: pip install flashinfer-python=={FLASHINFER_VERSION}"
        ) from exc
    return flashinfer


@dataclass(frozen=True)
class PagedKVMetadata:
    """A batch's tokens and pages in flashinfer's CSR form (request `b` of `B`)."""

    qo_indptr: torch.Tensor  # [B+1] int32: b's new tokens are rows qo_indptr[b]:qo_indptr[b+1]
    kv_indptr: torch.Tensor  # [B+1] int32: b's pages are kv_indices[kv_indptr[b]:kv_indptr[b+1]]
    kv_indices: torch.Tensor  # [kv_indptr[-1]] int32 page ids, in token order
    kv_last_page_len: torch.Tensor  # [B] int32 tokens in b's last page: 1..page_size, 0 if none


def paged_kv_metadata(batch: ForwardBatch) -> PagedKVMetadata:
    """The batch's page metadata, on the host: request `b` holds `seq_lens[b]` tokens in the
    first `ceil(seq_lens[b] / page_size)` pages of its page-table row (the rest is padding).
    Read from the batch's host copies where it has them (no wait for the GPU).

    NOTE: numpy, not torch, on these few small arrays: a decode step plans once, and each torch
    op on a CPU tensor costs several microseconds of host time where numpy's cost about one
    (about 70 us per plan with torch ops, measured on the CI machine's CPU)."""
    if batch.page_table_cpu is not None and batch.seq_lens_cpu:
        seq_lens = np.asarray(batch.seq_lens_cpu, dtype=np.int64)
        q_lens = np.asarray(batch.q_lens_cpu, dtype=np.int64)
        page_table = batch.page_table_cpu.numpy()
    else:
        seq_lens = batch.seq_lens.cpu().numpy().astype(np.int64)
        q_lens = np.diff(batch.cu_q_lens.cpu().numpy().astype(np.int64))
        page_table = batch.page_table.cpu().numpy()
    num_pages = (seq_lens + batch.page_size - 1) // batch.page_size  # [B]
    width = page_table.shape[1]
    if (num_pages > width).any():
        raise ValueError(
            f"a request needs {int(num_pages.max())} pages, its page-table row has {width}"
        )
    used = np.arange(width)[None, :] < num_pages[:, None]  # [B, W]
    last_page_len = seq_lens - np.maximum(num_pages - 1, 0) * batch.page_size

    def int32(values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.int32))

    return PagedKVMetadata(
        qo_indptr=int32(np.concatenate(([0], np.cumsum(q_lens)))),
        kv_indptr=int32(np.concatenate(([0], np.cumsum(num_pages)))),
        kv_indices=int32(page_table[used]),  # row-major: request by request, in order
        kv_last_page_len=int32(last_page_len),
    )


@dataclass(frozen=True)
class AttentionShape:
    """What a flashinfer plan is specialised for; every layer of a llama model has the same."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype  # of q and of the caches
    scale: float

    @classmethod
    def of(cls, q, k_cache, v_cache, scale: float) -> AttentionShape | None:
        """The shape, or None where flashinfer's kernels do not apply (the torch reference
        runs that attention instead): not float16 / bfloat16, K and V head dims that differ,
        a head dim or a query-per-KV-head group size its prebuilt choices do not cover."""
        _, page_size, num_kv_heads, _ = k_cache.shape
        shape = cls(q.shape[1], num_kv_heads, q.shape[2], page_size, q.dtype, scale)
        supported = (
            q.dtype in DTYPES
            and k_cache.dtype == v_cache.dtype == q.dtype
            and v_cache.shape[-1] == q.shape[-1]
            and shape.head_dim in HEAD_DIMS
            and shape.num_qo_heads % num_kv_heads == 0
            and shape.num_qo_heads // num_kv_heads in GROUP_SIZES
        )
        return shape if supported else None


class FlashInferBackend(TritonBackend):
    name = "flashinfer"

    def __init__(self, decode_attention: str = DECODE_ATTENTION, **triton_modes: str) -> None:
        """`triton_modes`: `TritonBackend`'s switches (deepgemm, gemv, ...), its defaults."""
        super().__init__(**triton_modes)
        if decode_attention not in ("auto", "flashinfer", "triton"):
            raise ValueError(
                f"decode_attention must be 'auto', 'flashinfer' or 'triton', not "
                f"{decode_attention!r}"
            )
        self._decode_attention = decode_attention
        self._flashinfer = import_flashinfer()
        self._workspace: torch.Tensor | None = None  # shared by all wrappers: one runs at a time
        self._eager: dict[str, Any] = {}  # "decode" / "prefill" -> wrapper
        self._graphed: dict[tuple[int, int], Any] = {}  # (rows, page-table width) -> wrapper
        # the forward in progress and its planned wrapper
        self._forward = ForwardPlan("flashinfer", self._plan)
        self._mla = FlashInferMLA(self._flashinfer, self._workspace_on)

    def begin_forward(self, batch, graph=False):
        if not self._triton_decode(batch):  # else nothing of flashinfer's to plan
            self._forward.begin_forward(batch, graph)
        if self._triton_mla(batch, batch.seq_lens) is None:  # else nothing of flashinfer's
            self._mla.begin_forward(batch, graph)

    def mla_attention(
        self, q, latent_cache, kv_b_weight, kv_b_scale_inv, batch, scale, topk_indices=None
    ):
        shape = MLAShape.of(q, latent_cache, kv_b_weight.shape[1], scale, topk_indices)
        if shape is None or self._triton_mla(batch, q) is not None:
            # dense, float32 or latent widths flashinfer is not built for: the reference;
            # decode on the GPU: `triton.mla` (TritonBackend.mla_attention; mla_decode="off"
            # keeps flashinfer's kernel)
            return super().mla_attention(
                q, latent_cache, kv_b_weight, kv_b_scale_inv, batch, scale, topk_indices
            )
        q_lat, q_pe, expand = self.absorb_kv_b(q, kv_b_weight, kv_b_scale_inv, shape.rope_dim)
        return expand(self._mla.attention(q_lat, q_pe, latent_cache, batch, shape, topk_indices))

    def paged_attention(self, q, k_cache, v_cache, batch, scale):
        shape = AttentionShape.of(q, k_cache, v_cache, scale)
        if shape is None or self._triton_decode(batch):
            # a float32 model: the reference; decode by Triton: its split-KV kernel
            return super().paged_attention(q, k_cache, v_cache, batch, scale)
        wrapper = self._forward.for_call(batch, shape)
        return wrapper.run(q.contiguous(), (k_cache, v_cache))  # [T, Hq, D]

    def _triton_decode(self, batch: ForwardBatch) -> bool:
        """Whether `batch`'s attention runs the Triton split-KV decode kernel (`triton.attention`):
        a decode batch, under "triton", or under "auto" when it has few enough requests."""
        if not batch.is_decode or self._decode_attention == "flashinfer":
            return False
        rows = batch.seq_lens.shape[0]
        return self._decode_attention == "triton" or rows <= TRITON_DECODE_MAX_ROWS

    def _plan(self, batch: ForwardBatch, graph: bool, shape: AttentionShape) -> Any:
        """Plan `batch` on its wrapper; returns the wrapper, ready to `run` every layer."""
        if batch.page_size != shape.page_size:
            raise ValueError(f"batch page size {batch.page_size}, cache's {shape.page_size}")
        if graph and not batch.is_decode:
            raise ValueError("only decode batches run in CUDA graphs")
        meta = paged_kv_metadata(batch)
        wrapper = self._wrapper(batch, graph)
        common = dict(
            num_qo_heads=shape.num_qo_heads,
            num_kv_heads=shape.num_kv_heads,
            page_size=shape.page_size,
            sm_scale=shape.scale,
            q_data_type=shape.dtype,
            kv_data_type=shape.dtype,
        )
        if batch.is_decode:
            wrapper.plan(
                meta.kv_indptr,
                meta.kv_indices,
                meta.kv_last_page_len,
                head_dim=shape.head_dim,
                **common,
            )
        else:
            wrapper.plan(
                meta.qo_indptr,
                meta.kv_indptr,
                meta.kv_indices,
                meta.kv_last_page_len,
                head_dim_qk=shape.head_dim,
                causal=True,
                **common,
            )
        return wrapper

    def _workspace_on(self, device: torch.device) -> torch.Tensor:
        if self._workspace is None:
            self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        return self._workspace

    def _wrapper(self, batch: ForwardBatch, graph: bool) -> Any:
        device = batch.seq_lens.device
        self._workspace_on(device)
        fi = self._flashinfer
        if graph:
            rows, width = batch.page_table.shape
            if (rows, width) not in self._graphed:
                self._graphed[rows, width] = fi.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace,
                    KV_LAYOUT,
                    use_cuda_graph=True,
                    paged_kv_indptr_buffer=torch.zeros(rows + 1, dtype=torch.int32, device=device),
                    paged_kv_indices_buffer=torch.zeros(
                        rows * width, dtype=torch.int32, device=device
                    ),
                    paged_kv_last_page_len_buffer=torch.zeros(
                        rows, dtype=torch.int32, device=device
                    ),
                )
            return self._graphed[rows, width]
        kind = "decode" if batch.is_decode else "prefill"
        if kind not in self._eager:
            cls = (
                fi.BatchDecodeWithPagedKVCacheWrapper
                if batch.is_decode
                else fi.BatchPrefillWithPagedKVCacheWrapper
            )
            self._eager[kind] = cls(self._workspace, KV_LAYOUT)
        return self._eager[kind]
