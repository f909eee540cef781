"""The flashinfer backend's MLA (`glm_moe_dsa`'s sparse latent attention), on CPU.

Its host planning (each query row a flashinfer request of `min(position + 1, topk)` keys), the
key slots written from the top-k (`fill_kv_indices`), the absorbed-weight math and the plan's
lifetime (one per forward, a graph's into its fixed buffers, never inside capture) run over a
fake `flashinfer.mla` whose wrapper takes flashinfer 0.6.9's arguments and computes the
attention from the planned arrays as flashinfer documents them. Against the torch reference's
`mla_attention`. The real kernels: `tests/flashinfer_checks.py` on CUDA.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch

from snapfn.handler.llm.engine.batch import ForwardBatch
from snapfn.handler.llm.kernels import get_backend
from snapfn.handler.llm.kernels.flashinfer import plan as flashinfer_plan
from snapfn.handler.llm.kernels.flashinfer.mla import fill_kv_indices, row_plan
from snapfn.handler.llm.weights.quant import quantize_fp8_block

from flashinfer_checks import mla_reference, random_topk

HEADS, NOPE, ROPE, RANK, V_DIM = 2, 32, 64, 512, 48
SCALE = (NOPE + ROPE) ** -0.5


# --- host planning and the key slots --------------------------------------------------------


def test_row_plan_of_a_mixed_batch():
    # a 3-token prompt, a decode row at position 9, a 2-token chunk after 5 cached tokens
    batch = ForwardBatch.build(
        [[1, 2, 3], [4], [5, 6]], [0, 9, 5], [[0], [1, 2, 3], [4, 5]], 4, "cpu"
    )
    plan = row_plan(batch, topk=4)
    assert plan.kv_lens.tolist() == [1, 2, 3, 4, 4, 4]  # min(position + 1, 4)
    assert plan.kv_indptr.tolist() == [0, 1, 3, 6, 10, 14, 18]
    assert plan.request.tolist() == [0, 0, 0, 1, 2, 2]
    assert plan.kv_lens.dtype == plan.kv_indptr.dtype == np.int32


def test_fill_kv_indices_compacts_slots_by_row():
    page_table = torch.tensor([[7, 2], [5, 0]], dtype=torch.int32)  # page size 4
    topk = torch.tensor([[5, 0, -1], [3, 1, 2]], dtype=torch.int32)  # row 0: 2 keys, row 1: 3
    indptr = torch.tensor([0, 2, 5], dtype=torch.int32)
    out = torch.full((2 * 3 + 1,), -9, dtype=torch.int32)
    fill_kv_indices(out, topk, page_table, indptr, 4)
    # row 0: position 5 -> page 2 slot 9, position 0 -> page 7 slot 28; row 1: page 5
    assert out[:5].tolist() == [9, 28, 23, 21, 22]
    assert out[5].item() == -9  # untouched; the unselected key went to the last element
    assert out.dtype == torch.int32

    # a row selecting more keys than planned is cut at its count, the next row's kept
    fill_kv_indices(out, topk, page_table, torch.tensor([0, 1, 4], dtype=torch.int32), 4)
    assert out[:4].tolist() == [9, 23, 21, 22]


# --- over a fake flashinfer.mla -------------------------------------------------------------


class _FakeMLA:
    """flashinfer 0.6.9's BatchMLAPagedAttentionWrapper as the backend uses it. `run` attends
    row by row over the keys `kv_indices[kv_indptr[t]:kv_indptr[t+1]]` (pages of one slot)."""

    def __init__(
        self,
        float_workspace_buffer,
        use_cuda_graph=False,
        qo_indptr=None,
        kv_indptr=None,
        kv_indices=None,
        kv_len_arr=None,
        backend="auto",
    ):
        assert float_workspace_buffer.dtype == torch.uint8
        self.use_cuda_graph = use_cuda_graph
        self.buffers = (qo_indptr, kv_indptr, kv_indices, kv_len_arr)
        self.num_plans = 0

    def plan(
        self,
        qo_indptr,
        kv_indptr,
        kv_indices,
        kv_len_arr,
        num_heads,
        head_dim_ckv,
        head_dim_kpe,
        page_size,
        causal,
        sm_scale,
        q_data_type,
        kv_data_type,
    ):
        arrays = (qo_indptr, kv_indptr, kv_indices, kv_len_arr)
        assert all(t.dtype == torch.int32 for t in arrays)
        assert torch.equal(kv_indptr.diff(), kv_len_arr) and page_size == 1 and not causal
        if self.use_cuda_graph:  # copied into the fixed buffers the graph reads
            for buffer, values in zip(self.buffers, arrays, strict=True):
                buffer[: len(values)].copy_(values)
            arrays = self.buffers
        self.arrays = arrays
        self.dims, self.scale = (num_heads, head_dim_ckv, head_dim_kpe), sm_scale
        self.dtypes = (q_data_type, kv_data_type)
        self.num_plans += 1

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache):
        assert (q_nope.dtype, ckv_cache.dtype) == self.dtypes
        assert (q_nope.shape[1], q_nope.shape[2], q_pe.shape[2]) == self.dims
        assert ckv_cache.shape[1] == kpe_cache.shape[1] == 1  # page size 1
        qo_indptr, kv_indptr, kv_indices, _ = (t.tolist() for t in self.arrays)
        out = torch.empty(q_nope.shape, dtype=q_nope.dtype)
        for t in range(len(qo_indptr) - 1):
            assert qo_indptr[t + 1] - qo_indptr[t] == 1
            slots = torch.tensor(kv_indices[kv_indptr[t] : kv_indptr[t + 1]], dtype=torch.long)
            c, kpe = ckv_cache[slots, 0].float(), kpe_cache[slots, 0].float()  # [L, R], [L, Dr]
            scores = (q_nope[t].float() @ c.T + q_pe[t].float() @ kpe.T) * self.scale
            out[t] = (torch.softmax(scores, -1) @ c).to(out.dtype)
        return out


@pytest.fixture
def fake_flashinfer(monkeypatch):
    fake = types.ModuleType("flashinfer")
    fake.mla = types.SimpleNamespace(BatchMLAPagedAttentionWrapper=_FakeMLA)
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    return fake


def _inputs(rows: int, num_pages: int, gen: torch.Generator, dtype=torch.bfloat16):
    q = torch.randn(rows, HEADS, NOPE + ROPE, generator=gen).to(dtype)
    latent = torch.randn(num_pages, 4, RANK + ROPE, generator=gen).to(dtype)
    kv_b = (torch.randn(HEADS * (NOPE + V_DIM), RANK, generator=gen) / RANK**0.5).to(dtype)
    return q, latent, kv_b


def _reference(q, latent, kv_b, batch, topk):
    return mla_reference(q, latent, kv_b, batch, topk, SCALE)


def _planned(backend) -> list[tuple[str, int]]:
    mla = backend._mla
    wrappers = {f"graph{rows}": w for rows, (w, _) in mla._graphed.items()}
    if mla._eager is not None:
        wrappers["eager"] = mla._eager
    return sorted((name, w.num_plans) for name, w in wrappers.items())


BATCHES = {
    # decode rows at positions 2 (fewer keys than topk), 12 and 30 over shuffled pages
    "decode": ([[1], [2], [3]], [2, 12, 30], [[3], [9, 4, 0, 6], [1, 5, 2, 7, 8, 10, 11, 12]]),
    # a prompt, a chunk after a cached prefix, a decode row
    "prefill": ([[1] * 6, [2] * 3, [3]], [0, 9, 4], [[3, 1], [9, 4, 0], [6, 8]]),
}


@pytest.mark.parametrize("kind", sorted(BATCHES))
def test_mla_over_fake_flashinfer_matches_the_reference(fake_flashinfer, kind):
    gen = torch.Generator().manual_seed(len(kind))
    batch = ForwardBatch.build(*BATCHES[kind], 4, "cpu")
    backend = get_backend("flashinfer")
    q, latent, kv_b = _inputs(batch.input_ids.shape[0], 13, gen)
    for _layer in range(3):  # each layer its own selection, one plan
        topk = random_topk(batch, 5, gen)
        got = backend.mla_attention(q, latent, kv_b, None, batch, SCALE, topk)
        assert got.shape == (q.shape[0], HEADS, V_DIM) and got.dtype == torch.bfloat16
        want = _reference(q, latent, kv_b, batch, topk)
        torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
    assert _planned(backend) == [("eager", 1)]


def test_fp8_kv_b_is_dequantized_once(fake_flashinfer):
    gen = torch.Generator().manual_seed(5)
    batch = ForwardBatch.build(*BATCHES["decode"], 4, "cpu")
    q, latent, kv_b = _inputs(3, 13, gen)
    weight, scale_inv = quantize_fp8_block(kv_b.float())
    backend, topk = get_backend("flashinfer"), random_topk(batch, 5, gen)
    first = backend.mla_attention(q, latent, weight, scale_inv, batch, SCALE, topk)
    (dense,) = (d for _, d in backend._dense_kv_b.values())
    backend.mla_attention(q, latent, weight, scale_inv, batch, SCALE, topk)
    assert [d for _, d in backend._dense_kv_b.values()] == [dense]  # the same tensor, kept
    want = get_backend("torch").mla_attention(
        q.float(), latent.float(), weight, scale_inv, batch, SCALE, topk
    )
    torch.testing.assert_close(first.float(), want, atol=3e-2, rtol=3e-2)


def test_graph_forward_is_planned_into_fixed_buffers_and_filled_by_each_layer(fake_flashinfer):
    gen = torch.Generator().manual_seed(2)
    backend = get_backend("flashinfer")
    first = ForwardBatch.build(*BATCHES["decode"], 4, "cpu")
    q, latent, kv_b = _inputs(3, 13, gen)
    backend.begin_forward(first, graph=True)  # shape unseen: planned at first use
    assert _planned(backend) == []
    topk = random_topk(first, 5, gen)
    got = backend.mla_attention(q, latent, kv_b, None, first, SCALE, topk)
    torch.testing.assert_close(
        got.float(), _reference(q, latent, kv_b, first, topk), atol=3e-2, rtol=3e-2
    )
    wrapper, buffers = backend._mla._graphed[3]
    assert wrapper.use_cuda_graph and len(buffers.kv_indices) == 3 * 5 + 1

    # a replay: new positions, planned by begin_forward into the same buffers
    second = ForwardBatch.build([[1], [2], [3]], [0, 9, 3], BATCHES["decode"][2], 4, "cpu")
    backend.begin_forward(second, graph=True)
    assert _planned(backend) == [("graph3", 2)]
    assert buffers.kv_indptr.tolist() == [0, 1, 6, 10]
    for _layer in range(2):
        topk = random_topk(second, 5, gen)
        got = backend.mla_attention(q, latent, kv_b, None, second, SCALE, topk)
        torch.testing.assert_close(
            got.float(), _reference(q, latent, kv_b, second, topk), atol=3e-2, rtol=3e-2
        )
    assert _planned(backend) == [("graph3", 2)]


def test_no_mla_planning_inside_graph_capture(fake_flashinfer, monkeypatch):
    gen = torch.Generator().manual_seed(3)
    batch = ForwardBatch.build(*BATCHES["decode"], 4, "cpu")
    q, latent, kv_b = _inputs(3, 13, gen)
    monkeypatch.setattr(flashinfer_plan, "capturing", lambda device: True)
    with pytest.raises(RuntimeError, match="inside CUDA graph capture"):
        get_backend("flashinfer").mla_attention(
            q, latent, kv_b, None, batch, SCALE, random_topk(batch, 5, gen)
        )


def test_what_flashinfer_mla_does_not_cover_runs_the_reference(fake_flashinfer):
    gen = torch.Generator().manual_seed(4)
    batch = ForwardBatch.build(*BATCHES["decode"], 4, "cpu")
    q, latent, kv_b = _inputs(3, 13, gen)
    topk = random_topk(batch, 5, gen)
    narrow = latent[..., RANK - 32 :], kv_b[:, RANK - 32 :]  # R = 32: no kernel built
    cases = {
        "float32": (q.float(), latent.float(), kv_b.float(), topk),
        "dense": (q, latent, kv_b, None),
        "rank 32": (q, *narrow, topk),
    }
    for name, (qq, cache, w, selection) in cases.items():
        backend = get_backend("flashinfer")
        got = backend.mla_attention(qq, cache, w, None, batch, SCALE, selection)
        want = get_backend("torch").mla_attention(qq, cache, w, None, batch, SCALE, selection)
        assert torch.equal(got, want), name
        assert _planned(backend) == [], name
