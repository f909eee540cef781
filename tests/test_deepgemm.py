"""DeepGEMM for prefill's FP8 GEMMs (`kernels/deepgemm.py`), and when the triton backend uses it.

On CPU: the activation quantization, and the dense and grouped GEMMs over a fake deep_gemm
whose two functions take deep_gemm 2.6.1's arguments, check what DeepGEMM documents (FP8
operands, float32 1x128 / 128x128 scales, bf16 output, a grouped layout of per-row expert ids
with -1 on padding rows, each expert's run aligned) and multiply the dequantized operands; the
results are compared with the torch reference. Rows the layout marks -1 are filled with NaN, as
garbage the caller must not read. On an SM90 GPU with deep_gemm importable: the real library,
same comparisons, at GLM-5's shapes.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from snapfn.handler.llm.kernels.base import ExpertWeights
from snapfn.handler.llm.kernels.deepgemm import DeepGemm, quantize_rows
from snapfn.handler.llm.kernels.torch_ref import TorchBackend
from snapfn.handler.llm.kernels.triton.backend import FP8_FUSED_MAX_ROWS, TritonBackend
from snapfn.handler.llm.weights.quant import FP8_DTYPE, dequantize_fp8_block, quantize_fp8_block

HAS_DEEPGEMM = importlib.util.find_spec("deep_gemm") is not None
# FP8 activations (3 mantissa bits) against the reference's bf16 ones: a few percent per row
REL_TOL = 0.06


def _dequant_rows(q, s):
    m, k = q.shape
    return (q.float().view(m, k // 128, 128) * s[..., None]).view(m, k)


def _check_operands(a, b, d):
    (aq, sa), (bq, sb) = a, b
    assert aq.dtype == FP8_DTYPE and bq.dtype == FP8_DTYPE
    assert sa.dtype == torch.float32 and sb.dtype == torch.float32
    assert tuple(sa.shape) == (aq.shape[0], aq.shape[1] // 128)
    assert tuple(sb.shape[-2:]) == (bq.shape[-2] // 128, bq.shape[-1] // 128)
    assert d.dtype == torch.bfloat16 and d.shape[0] == aq.shape[0]
    assert aq.is_contiguous() and bq.is_contiguous() and d.is_contiguous()


class FakeDeepGemm:
    """deep_gemm's `fp8_gemm_nt` and `m_grouped_fp8_gemm_nt_contiguous`, in torch."""

    def __init__(self, alignment: int = 32):
        self.alignment = alignment
        self.calls: list[str] = []

    def get_mk_alignment_for_contiguous_layout(self):
        return self.alignment

    def fp8_gemm_nt(self, a, b, d, disable_ue8m0_cast=False):
        _check_operands(a, b, d)
        assert disable_ue8m0_cast, "fp32 scales on SM90 need disable_ue8m0_cast=True"
        self.calls.append("dense")
        w = dequantize_fp8_block(b[0], b[1], torch.float32)
        d.copy_(_dequant_rows(*a) @ w.T)

    def m_grouped_fp8_gemm_nt_contiguous(self, a, b, d, layout, disable_ue8m0_cast=False):
        _check_operands(a, b, d)
        assert disable_ue8m0_cast
        assert layout.dtype == torch.int32 and tuple(layout.shape) == (a[0].shape[0],)
        assert a[0].shape[0] % self.alignment == 0
        self.calls.append("grouped")
        blocks = layout.view(-1, self.alignment)
        for block in blocks:  # one expert per aligned block, its padding (-1) at the end
            live = block[block >= 0]
            assert live.unique().numel() <= 1
            assert bool((block[: live.numel()] >= 0).all())
        x = _dequant_rows(*a)
        d.fill_(float("nan"))
        for g in layout[layout >= 0].unique().tolist():
            rows = layout == g
            w = dequantize_fp8_block(b[0][g], b[1][g], torch.float32)
            d[rows] = (x[rows] @ w.T).to(d.dtype)


def _gemm(fake=None):
    fake = fake or FakeDeepGemm()
    return DeepGemm(SimpleNamespace(**{n: getattr(fake, n) for n in dir(fake) if "_" in n}), 32)


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def _fp8_experts(num_local, inter, hidden, first_expert, device="cpu"):
    torch.manual_seed(1)
    parts = {}
    for name, shape in (
        ("gate", (inter, hidden)),
        ("up", (inter, hidden)),
        ("down", (hidden, inter)),
    ):
        w = torch.randn(num_local, *shape, device=device) / shape[1] ** 0.5
        parts[name], parts[f"{name}_scale_inv"] = quantize_fp8_block(w)
    return ExpertWeights(first_expert=first_expert, **parts)


def test_quantize_rows_keeps_each_group_within_fp8_precision():
    x = torch.randn(5, 384) * torch.tensor([1e-3, 1.0, 50.0]).repeat_interleave(128)
    q, s = quantize_rows(x)
    assert q.dtype == FP8_DTYPE and tuple(s.shape) == (5, 3)
    back = _dequant_rows(q, s)
    for g in range(3):
        cols = slice(128 * g, 128 * (g + 1))
        err = (back[:, cols] - x[:, cols]).abs().amax(dim=1)
        assert bool((err <= x[:, cols].abs().amax(dim=1) / 16).all())  # e4m3: 3 mantissa bits
    assert float(q.float().abs().amax()) == 448.0  # each group's largest maps to e4m3's largest


def test_linear_matches_the_reference_within_fp8_activation_error():
    torch.manual_seed(0)
    x = torch.randn(3, 70, 256, dtype=torch.bfloat16)
    q, s = quantize_fp8_block(torch.randn(384, 256) / 16)
    fake = FakeDeepGemm()
    out = _gemm(fake).linear(x, q, s)
    ref = TorchBackend().linear(x, q, None, s)
    assert out.shape == (3, 70, 384) and out.dtype == torch.bfloat16
    assert 0 < _rel(out, ref) < REL_TOL
    assert fake.calls == ["dense"]


@pytest.mark.parametrize("first_expert", [0, 2])  # 2: an expert-parallel rank, some ids elsewhere
def test_grouped_moe_matches_the_reference(first_expert):
    torch.manual_seed(0)
    experts = _fp8_experts(num_local=4, inter=256, hidden=128, first_expert=first_expert)
    x = torch.randn(90, 128, dtype=torch.bfloat16)
    topk_ids = torch.randint(0, 6, (90, 2))
    topk_ids[:, 1] = (topk_ids[:, 0] + 1) % 6  # two different experts per token
    topk_weights = torch.rand(90, 2)
    fake = FakeDeepGemm()
    out = _gemm(fake).moe(x, experts, topk_ids, topk_weights)
    ref = TorchBackend().moe(x, experts, topk_ids, topk_weights)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert not out.isnan().any(), "a padding row's garbage reached the output"
    assert 0 < _rel(out, ref) < REL_TOL
    assert fake.calls == ["grouped"] * 3  # gate, up, down


def test_triton_backend_sends_prefill_sized_fp8_gemms_to_deepgemm(monkeypatch):
    backend = TritonBackend()
    fake = FakeDeepGemm()
    monkeypatch.setattr(backend, "deepgemm_for", lambda x: _gemm(fake))
    q, s = quantize_fp8_block(torch.randn(256, 128) / 16)
    rows = FP8_FUSED_MAX_ROWS + 1
    backend.linear(torch.randn(rows, 128, dtype=torch.bfloat16), q, None, s)
    assert fake.calls == ["dense"]
    backend.linear(torch.randn(rows, 128, dtype=torch.float32), q, None, s)  # float32: not bf16
    backend.linear(torch.randn(FP8_FUSED_MAX_ROWS, 128, dtype=torch.bfloat16), q, None, s)
    backend.linear(torch.randn(rows, 256, dtype=torch.bfloat16), torch.randn(8, 256), None)
    assert fake.calls == ["dense"], "decode-sized, float32 or unquantized GEMMs stayed"
    experts = _fp8_experts(num_local=2, inter=128, hidden=128, first_expert=0)
    ids, weights = torch.zeros(rows, 1, dtype=torch.long), torch.ones(rows, 1)
    backend.moe(torch.randn(rows, 128, dtype=torch.bfloat16), experts, ids, weights)
    assert fake.calls == ["dense"] + ["grouped"] * 3


def test_deepgemm_is_off_on_cpu_and_when_turned_off(monkeypatch):
    assert TritonBackend().deepgemm_for(torch.zeros(1)) is None  # CPU tensor
    assert DeepGemm.load("cpu") is None
    with pytest.raises(RuntimeError, match="SM90"):
        DeepGemm.require("cpu")
    with pytest.raises(ValueError, match="'auto' or 'off'"):
        TritonBackend(deepgemm="on")
    monkeypatch.setenv("SNAPFN_DEEPGEMM", "off")
    from snapfn.handler.llm.kernels import get_backend

    assert get_backend("triton", "cpu")._deepgemm_mode == "off"


# --- CUDA -------------------------------------------------------------------------------------


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an SM90 GPU (H100 / H200; none on this machine)")
@pytest.mark.skipif(
    not HAS_DEEPGEMM, reason="deep_gemm is not importable (docs/kernels.md: installing DeepGEMM)"
)
@pytest.mark.parametrize(
    "shape",
    [(65, 2048, 6144), (1024, 24576, 1536), (4096, 6144, 2048)],  # rows, N, K of GLM-5 linears
    ids=lambda s: "x".join(map(str, s)),
)
def test_cuda_deepgemm_linear_matches_the_reference(shape):
    m, n, k = shape
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    q, s = quantize_fp8_block(torch.randn(n, k, device="cuda") / k**0.5)
    out = DeepGemm.require("cuda").linear(x, q, s)
    ref = TorchBackend().linear(x, q, None, s)
    assert _rel(out, ref) < REL_TOL


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an SM90 GPU (H100 / H200; none on this machine)")
@pytest.mark.skipif(
    not HAS_DEEPGEMM, reason="deep_gemm is not importable (docs/kernels.md: installing DeepGEMM)"
)
@pytest.mark.parametrize("first_expert", [0, 8])
def test_cuda_deepgemm_moe_matches_the_reference(first_expert):
    torch.manual_seed(0)
    experts = _fp8_experts(16, 2048, 1024, first_expert, device="cuda")
    x = torch.randn(700, 1024, device="cuda", dtype=torch.bfloat16)
    topk_ids = torch.stack([torch.randperm(24, device="cuda")[:8] for _ in range(700)])
    topk_weights = torch.rand(700, 8, device="cuda")
    out = DeepGemm.require("cuda").moe(x, experts, topk_ids, topk_weights)
    ref = TorchBackend().moe(x, experts, topk_ids, topk_weights)
    assert not out.isnan().any()
    assert _rel(out, ref) < REL_TOL


def test_an_installed_deepgemm_that_does_not_import_is_logged_and_skipped(monkeypatch, caplog):
    from snapfn.handler.llm.kernels import deepgemm

    monkeypatch.setattr(deepgemm.importlib.util, "find_spec", lambda name: object())

    def refuse(cls, device):
        raise AssertionError("no CUDA home")  # what deep_gemm's own import asserts

    monkeypatch.setattr(DeepGemm, "require", classmethod(refuse))
    with caplog.at_level("WARNING"):
        assert DeepGemm.load("cuda") is None
    assert "DeepGEMM is installed but not used on cuda: no CUDA home" in caplog.text
