"""The flashinfer backend: its page metadata and planning on CPU, its kernels on CUDA.

On CPU: `paged_kv_metadata` against hand-computed CSR arrays; the registry's install hint; the
snapshot's copy of flashinfer's JIT cache; and the backend's planning (once per forward, graph
wrappers on fixed buffers, never inside capture) over a fake flashinfer module, whose two
wrappers take flashinfer 0.6.9's argument names and run the torch reference on the planned
CSR arrays, read as flashinfer documents them. On CUDA with flashinfer installed: `tests/flashinfer_checks.py`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from snapfn.handler.llm.engine.batch import ForwardBatch
from snapfn.handler.llm.engine.graphs import DecodeGraphs
from snapfn.handler.llm.engine.kv_pool import KVBufferSpec, KVPool
from snapfn.handler.llm.kernels import available_backends, get_backend
from snapfn.handler.llm.kernels.flashinfer import backend as flashinfer_backend
from snapfn.handler.llm.kernels.flashinfer import plan as flashinfer_plan
from snapfn.handler.llm.kernels.flashinfer.backend import paged_kv_metadata
from snapfn.handler.llm.kernels.torch_ref import causal_attention
from snapfn.snapshot.errors import InitFailed
from snapfn.snapshot.portable import compile_caches

import flashinfer_checks

HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None


def _ints(t: torch.Tensor) -> list[int]:
    assert t.dtype == torch.int32, t.dtype
    return t.tolist()


# --- paged_kv_metadata ----------------------------------------------------------------------


def test_metadata_of_a_mixed_batch():
    # page size 4: a 5-token prompt (2 pages, 1 token in the last), a decode row whose 8 tokens
    # fill 2 pages exactly, and a 3-token chunk after 7 cached tokens (10: 3 pages, 2 in the last)
    batch = ForwardBatch.build(
        [[1, 2, 3, 4, 5], [6], [7, 8, 9]], [0, 7, 7], [[7, 2], [3, 9], [5, 1, 6, 11]], 4, "cpu"
    )
    meta = paged_kv_metadata(batch)
    assert _ints(meta.qo_indptr) == [0, 5, 6, 9]
    assert _ints(meta.kv_indptr) == [0, 2, 4, 7]
    assert _ints(meta.kv_indices) == [7, 2, 3, 9, 5, 1, 6]  # page 11 and the row padding unused
    assert _ints(meta.kv_last_page_len) == [1, 4, 2]


def test_metadata_of_page_multiples_and_a_request_without_tokens():
    seq_lens = [4, 16, 1, 0]
    batch = SimpleNamespace(
        cu_q_lens=torch.tensor([0, 1, 2, 3, 4]),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        page_table=torch.tensor([[8, 0, 0, 0], [4, 5, 6, 7], [3, 0, 0, 0], [0, 0, 0, 0]]),
        page_size=4,
        page_table_cpu=None,  # read from the tensors
    )
    meta = paged_kv_metadata(batch)
    assert _ints(meta.kv_indptr) == [0, 1, 5, 6, 6]
    assert _ints(meta.kv_indices) == [8, 4, 5, 6, 7, 3]
    assert _ints(meta.kv_last_page_len) == [4, 4, 1, 0]  # a full last page is 4, not 0


def test_metadata_of_a_decode_graph_with_padded_rows():
    """The static batch that DecodeGraphs captures with: every row padding, one token on the
    scratch page; then two real rows, as a replay loads them."""
    kv = KVPool(
        [KVBufferSpec("k", 1, (2, 8))], num_pages=10, page_size=4, dtype=torch.float32, device="cpu"
    )
    graphs = DecodeGraphs(SimpleNamespace(device=torch.device("cpu")), kv, [1, 4], max_seq_len=12)
    scratch = kv.scratch_page
    meta = paged_kv_metadata(graphs._static_batch(4))
    assert _ints(meta.qo_indptr) == [0, 1, 2, 3, 4]
    assert _ints(meta.kv_indptr) == [0, 1, 2, 3, 4]
    assert _ints(meta.kv_indices) == [scratch] * 4
    assert _ints(meta.kv_last_page_len) == [1, 1, 1, 1]

    graphs._host_views["seq_lens"][:2] = [9, 4]
    graphs._host_table[:2] = torch.tensor([[2, 5, 7], [1, scratch, scratch]], dtype=torch.int32)
    graphs._upload()
    on_host = graphs._static_batch(4)
    on_device = dataclasses.replace(on_host, page_table_cpu=None)  # read from the buffers
    for batch in (on_host, on_device):
        meta = paged_kv_metadata(batch)
        assert _ints(meta.kv_indptr) == [0, 3, 4, 5, 6]
        assert _ints(meta.kv_indices) == [2, 5, 7, 1, scratch, scratch]
        assert _ints(meta.kv_last_page_len) == [1, 4, 1, 1]


def test_metadata_refuses_a_page_row_too_short():
    batch = SimpleNamespace(  # 9 tokens need 3 pages
        cu_q_lens=torch.tensor([0, 1]),
        seq_lens=torch.tensor([9], dtype=torch.int32),
        page_table=torch.tensor([[3, 4]]),
        page_size=4,
        page_table_cpu=None,
    )
    with pytest.raises(ValueError, match="needs 3 pages, its page-table row has 2"):
        paged_kv_metadata(batch)


# --- registry and runtime environment --------------------------------------------------------


def test_registry_lists_flashinfer_and_says_how_to_install_it(monkeypatch):
    assert "flashinfer" in available_backends()
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # makes `import flashinfer` fail
    with pytest.raises(InitFailed, match=r"pip install flashinfer-python==0\.6\.9"):
        get_backend("flashinfer", "cuda")


def test_auto_picks_flashinfer_on_cuda_where_it_is_installed(fake_flashinfer, monkeypatch):
    from snapfn.handler.llm import kernels

    monkeypatch.setattr(kernels, "_installed", lambda name: True)
    assert get_backend("auto", "cuda").name == "flashinfer"
    assert get_backend("auto", "cpu").name == "torch"


def test_importing_the_package_does_not_import_flashinfer():
    code = (
        "import sys\n"
        "import snapfn.handler.llm.build\n"
        "from snapfn.handler.llm.kernels.flashinfer import backend\n"
        "assert 'flashinfer' not in sys.modules, 'flashinfer imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_flashinfer_jit_cache_travels_in_the_snapshot(tmp_path):
    # flashinfer/jit/env.py reads FLASHINFER_WORKSPACE_BASE at import and compiles into
    # <it>/.cache/flashinfer/<version>/<archs>/cached_ops/<module>/: a hidden folder, which
    # saving and restoring must not skip
    assert compile_caches.COMPILE_CACHES["flashinfer"] == "FLASHINFER_WORKSPACE_BASE"
    init_dir, restore_dir, snapshot = tmp_path / "init", tmp_path / "restore", tmp_path / "snap"
    so = Path(".cache/flashinfer/0.6.9/90a/cached_ops/batch_decode/batch_decode.so")
    built = compile_caches.cache_dirs(init_dir)["flashinfer"] / so
    built.parent.mkdir(parents=True)
    built.write_bytes(b"kernel")
    assert compile_caches.save_caches(init_dir, snapshot) == {"flashinfer": 1}
    assert compile_caches.restore_caches(snapshot, restore_dir) == 1
    restored = compile_caches.cache_dirs(restore_dir)["flashinfer"] / so
    assert restored.read_bytes() == b"kernel"


# --- planning, over a fake flashinfer -------------------------------------------------------


class _FakeWrapper:
    """What the backend uses of a flashinfer 0.6.9 paged wrapper (keyword names as there).

    `run` is the torch reference over the planned arrays read as flashinfer reads them:
    request b's keys are the tokens of pages `kv_indices[kv_indptr[b]:kv_indptr[b+1]]`, all
    but the last page full; its queries are the last of them (causal)."""

    def __init__(
        self,
        float_workspace_buffer,
        kv_layout="NHD",
        use_cuda_graph=False,
        paged_kv_indptr_buffer=None,
        paged_kv_indices_buffer=None,
        paged_kv_last_page_len_buffer=None,
    ):
        assert kv_layout == "NHD" and float_workspace_buffer.dtype == torch.uint8
        self.use_cuda_graph = use_cuda_graph
        self.buffers = (
            paged_kv_indptr_buffer,
            paged_kv_indices_buffer,
            paged_kv_last_page_len_buffer,
        )
        self.num_plans = 0

    def _plan(self, qo_indptr, kv_arrays, heads, page_size, sm_scale, dtypes):
        assert all(t.dtype == torch.int32 for t in (qo_indptr, *kv_arrays))
        if self.use_cuda_graph:  # flashinfer copies into the fixed buffers the graph reads
            indptr, indices, last = self.buffers
            assert len(last) == len(kv_arrays[2]), "cudagraph batch size is fixed"
            indptr.copy_(kv_arrays[0])
            indices[: len(kv_arrays[1])].copy_(kv_arrays[1])
            last.copy_(kv_arrays[2])
            kv_arrays = self.buffers
        self.qo_indptr, self.kv_arrays = qo_indptr, kv_arrays
        self.heads, self.page_size, self.scale, self.dtypes = heads, page_size, sm_scale, dtypes
        self.num_plans += 1

    def run(self, q, paged_kv_cache):
        k_cache, v_cache = paged_kv_cache  # a tuple of separate NHD caches
        assert (q.dtype, k_cache.dtype) == self.dtypes and k_cache.shape[1] == self.page_size
        assert (q.shape[1], k_cache.shape[2], q.shape[2]) == self.heads
        indptr, indices, last = (t.tolist() for t in self.kv_arrays)
        out = torch.empty_like(q)
        for b, (start, end) in enumerate(
            zip(self.qo_indptr[:-1].tolist(), self.qo_indptr[1:].tolist(), strict=True)
        ):
            pages = torch.tensor(indices[indptr[b] : indptr[b + 1]], dtype=torch.long)
            kv_len = (len(pages) - 1) * self.page_size + last[b]
            k, v = (c[pages].flatten(0, 1)[:kv_len] for c in (k_cache, v_cache))
            out[start:end] = causal_attention(
                q[start:end], k, v, kv_len - (end - start), self.scale
            )
        return out


class _FakeDecode(_FakeWrapper):
    def plan(
        self,
        indptr,
        indices,
        last_page_len,
        *,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        page_size,
        sm_scale,
        q_data_type,
        kv_data_type,
    ):
        qo_indptr = torch.arange(len(last_page_len) + 1, dtype=torch.int32)
        arrays, heads = (indptr, indices, last_page_len), (num_qo_heads, num_kv_heads, head_dim)
        self._plan(qo_indptr, arrays, heads, page_size, sm_scale, (q_data_type, kv_data_type))


class _FakePrefill(_FakeWrapper):
    def plan(
        self,
        qo_indptr,
        paged_kv_indptr,
        paged_kv_indices,
        paged_kv_last_page_len,
        *,
        num_qo_heads,
        num_kv_heads,
        head_dim_qk,
        page_size,
        causal,
        sm_scale,
        q_data_type,
        kv_data_type,
    ):
        assert causal
        arrays = (paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)
        heads = (num_qo_heads, num_kv_heads, head_dim_qk)
        self._plan(qo_indptr, arrays, heads, page_size, sm_scale, (q_data_type, kv_data_type))


@pytest.fixture
def fake_flashinfer(monkeypatch):
    fake = types.ModuleType("flashinfer")
    fake.BatchDecodeWithPagedKVCacheWrapper = _FakeDecode
    fake.BatchPrefillWithPagedKVCacheWrapper = _FakePrefill
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    # the fake takes any head dim: the tiny models' 16 too, which the real one is not built for
    monkeypatch.setattr(flashinfer_backend, "HEAD_DIMS", (*flashinfer_backend.HEAD_DIMS, 16))
    # every decode batch by flashinfer's kernel, whatever its size (the tests below check how it
    # is planned; `test_decode_attention_modes` checks who runs which batch under each mode)
    monkeypatch.setenv("SNAPFN_DECODE_ATTENTION", "flashinfer")
    return fake


def _attention_inputs(num_tokens: int, gen: torch.Generator):
    k_cache, v_cache = (torch.randn(24, 4, 2, 16, generator=gen).half() for _ in range(2))
    q = torch.randn(num_tokens, 4, 16, generator=gen).half()
    return q, k_cache, v_cache


def _reference(q, k_cache, v_cache, batch):
    want = get_backend("torch").paged_attention(
        *(t.float() for t in (q, k_cache, v_cache)), batch, 0.25
    )
    return want.half()


def _planned(backend) -> list[tuple[str, int]]:
    wrappers = {**backend._eager, **{f"graph{k}": w for k, w in backend._graphed.items()}}
    return sorted((name, w.num_plans) for name, w in wrappers.items())


def test_one_plan_per_forward_for_all_layers(fake_flashinfer):
    backend = get_backend("flashinfer")
    gen = torch.Generator().manual_seed(0)
    decode = ForwardBatch.build([[1], [2]], [6, 3], [[3, 7], [5]], 4, "cpu")
    q, k_cache, v_cache = _attention_inputs(2, gen)
    for _layer in range(3):
        got = backend.paged_attention(q, k_cache, v_cache, decode, 0.25)
        torch.testing.assert_close(got, _reference(q, k_cache, v_cache, decode), atol=2e-3, rtol=0)
    assert _planned(backend) == [("decode", 1)]

    prefill = ForwardBatch.build([[1, 2, 3], [4]], [0, 5], [[9], [2, 8]], 4, "cpu")
    q, k_cache, v_cache = _attention_inputs(4, gen)
    for _layer in range(3):
        got = backend.paged_attention(q, k_cache, v_cache, prefill, 0.25)
        torch.testing.assert_close(got, _reference(q, k_cache, v_cache, prefill), atol=2e-3, rtol=0)
    assert _planned(backend) == [("decode", 1), ("prefill", 1)]

    equal_but_new = ForwardBatch.build([[1], [2]], [6, 3], [[3, 7], [5]], 4, "cpu")
    backend.paged_attention(q[:2], k_cache, v_cache, equal_but_new, 0.25)
    assert _planned(backend) == [("decode", 2), ("prefill", 1)]


def test_graph_forward_is_planned_into_its_own_fixed_buffers(fake_flashinfer):
    backend = get_backend("flashinfer")
    gen = torch.Generator().manual_seed(1)
    q, k_cache, v_cache = _attention_inputs(4, gen)
    first = ForwardBatch.build(
        [[1]] * 4, [4, 0, 0, 0], [[3, 7, 1], [23] * 3, [23] * 3, [23] * 3], 4, "cpu"
    )
    backend.begin_forward(first, graph=True)  # attention shape not seen yet: planned at first use
    assert _planned(backend) == []
    got = backend.paged_attention(q, k_cache, v_cache, first, 0.25)
    torch.testing.assert_close(got, _reference(q, k_cache, v_cache, first), atol=2e-3, rtol=0)
    wrapper = backend._graphed[4, 3]
    assert wrapper.use_cuda_graph and [len(b) for b in wrapper.buffers] == [5, 12, 4]

    second = ForwardBatch.build(
        [[1]] * 4, [10, 2, 0, 0], [[5, 6, 2], [9, 23, 23], [23] * 3, [23] * 3], 4, "cpu"
    )
    backend.begin_forward(second, graph=True)  # a replay: planned now, before the graph runs
    assert _planned(backend) == [("graph(4, 3)", 2)]
    assert torch.equal(wrapper.buffers[0], torch.tensor([0, 3, 4, 5, 6], dtype=torch.int32))
    got = backend.paged_attention(q, k_cache, v_cache, second, 0.25)  # what the graph replays
    torch.testing.assert_close(got, _reference(q, k_cache, v_cache, second), atol=2e-3, rtol=0)
    assert _planned(backend) == [("graph(4, 3)", 2)]


@pytest.mark.parametrize("mode", ["auto", "triton", "flashinfer"])
def test_decode_attention_modes(fake_flashinfer, monkeypatch, mode):
    """`SNAPFN_DECODE_ATTENTION`: "auto" runs one-request decode batches by the Triton kernel
    (here on CPU tensors: the reference it matches) and plans nothing of flashinfer's for them;
    "triton" every decode batch; "flashinfer" none. Prefill is flashinfer's under all three."""
    monkeypatch.setenv("SNAPFN_DECODE_ATTENTION", mode)
    backend = get_backend("flashinfer")
    gen = torch.Generator().manual_seed(4)
    one = ForwardBatch.build([[1]], [5], [[3, 7]], 4, "cpu")
    two = ForwardBatch.build([[1], [2]], [6, 3], [[3, 7], [5]], 4, "cpu")
    prefill = ForwardBatch.build([[1, 2, 3]], [0], [[9]], 4, "cpu")
    for batch, rows in ((one, 1), (two, 2), (prefill, 3)):
        q, k_cache, v_cache = _attention_inputs(rows, gen)
        backend.begin_forward(batch, graph=batch is not prefill)
        got = backend.paged_attention(q, k_cache, v_cache, batch, 0.25)
        torch.testing.assert_close(got, _reference(q, k_cache, v_cache, batch), atol=2e-3, rtol=0)
    planned = {
        "auto": [("graph(2, 2)", 1), ("prefill", 1)],
        "triton": [("prefill", 1)],
        "flashinfer": [("graph(1, 2)", 1), ("graph(2, 2)", 1), ("prefill", 1)],
    }
    assert _planned(backend) == planned[mode]


def test_an_unknown_decode_attention_mode_is_refused(fake_flashinfer, monkeypatch):
    monkeypatch.setenv("SNAPFN_DECODE_ATTENTION", "fast")
    with pytest.raises(ValueError, match="decode_attention must be 'auto', 'flashinfer' or"):
        get_backend("flashinfer")


def test_no_planning_inside_graph_capture(fake_flashinfer, monkeypatch):
    backend = get_backend("flashinfer")
    q, k_cache, v_cache = _attention_inputs(1, torch.Generator().manual_seed(2))
    batch = ForwardBatch.build([[1]], [3], [[4]], 4, "cpu")
    monkeypatch.setattr(flashinfer_plan, "capturing", lambda device: True)
    with pytest.raises(RuntimeError, match="inside CUDA graph capture"):
        backend.paged_attention(q, k_cache, v_cache, batch, 0.25)


def test_what_flashinfer_does_not_cover_runs_the_reference_unplanned(fake_flashinfer):
    half = _attention_inputs(1, torch.Generator().manual_seed(3))
    batch = ForwardBatch.build([[1]], [3], [[4]], 4, "cpu")
    group_of_8 = (half[0].repeat(1, 4, 1), *half[1:])  # 16 query heads over 2 KV heads: fine
    odd_dim = tuple(t[..., :12] for t in half)  # head dim 12: no template
    for inputs in ((t.float() for t in half), odd_dim):  # float32; head dim 12
        q, k_cache, v_cache = inputs
        backend = get_backend("flashinfer")
        got = backend.paged_attention(q, k_cache, v_cache, batch, 0.25)
        want = get_backend("torch").paged_attention(q, k_cache, v_cache, batch, 0.25)
        assert torch.equal(got, want) and _planned(backend) == []
    backend = get_backend("flashinfer")
    backend.paged_attention(*group_of_8, batch, 0.25)
    assert _planned(backend) == [("decode", 1)]


def test_whole_model_greedy_over_fake_flashinfer_equals_torch(fake_flashinfer, tmp_path):
    """The engine's own batches (prefill, then decode across pages) planned by the backend:
    the same tokens as the torch backend, so the metadata is what flashinfer expects."""
    results = flashinfer_checks.greedy_results(
        {**flashinfer_checks.LLAMA_GREEDY, "preset": "tiny"},
        tmp_path,
        "cpu",
        ("torch", "flashinfer"),
    )
    flashinfer_checks.assert_same_greedy(results["flashinfer"], results["torch"], 1e-2)


# --- CUDA -------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
@pytest.mark.skipif(
    not HAS_FLASHINFER, reason="flashinfer is not installed (pip install flashinfer-python==0.6.9)"
)
@pytest.mark.parametrize("case", flashinfer_checks.CASES)
def test_cuda_flashinfer_matches_reference(case):
    flashinfer_checks.run_case(case, "cuda")
