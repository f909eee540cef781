"""DeepGEMM for the FP8 GEMMs of prefill: block-scaled dense linears and grouped (MoE) experts.

    gemm = DeepGemm.load(device)              # None where deep_gemm is not importable or usable
    y = gemm.linear(x, q, scale_inv)          # x [..., K] bf16, q [N, K] fp8, scales [N/128, K/128]
    y = gemm.moe(x, experts, topk_ids, topk_weights)

deep_gemm multiplies FP8 by FP8 on the Hopper tensor cores. The weights keep their 128x128
block scales; the activations are quantized here per row in 1x128 groups, with a float32 scale
each: the recipe DeepSeek-V3 was trained with, and transformers' fine-grained FP8 `act_quant`.
That quantization is the one numerical difference from the reference (`F.linear` on the
dequantized weight in bf16): about 2-3% relative error per output row, where bf16 alone is 0.4%.

`TritonBackend` sends only prefill-sized GEMMs here (more than `FP8_FUSED_MAX_ROWS` rows or
tokens): those are compute-bound, where FP8 tensor cores run at twice bf16's rate. Decode steps
stay on our Triton kernels, which read each weight byte once and keep the activations in bf16,
and which CUDA graphs capture.

Grouped experts use DeepGEMM's contiguous layout: the (token, slot) pairs sorted by local expert
(`triton.moe.align_by_expert`), each expert's run padded to DeepGEMM's M alignment, and a
per-row expert index with -1 on padding rows, which DeepGEMM skips. No host sync.

Only SM90 (H100 / H200) with float32 scales is supported: DeepGEMM on SM100 wants UE8M0 scales.
deep_gemm JIT-compiles each kernel on first use into `DG_JIT_CACHE_DIR`, which the runtime_env
stage points into the snapshot's cache, so a restore compiles none (docs/kernels.md).
NOTE: `import deep_gemm` happens in `load`, not at module import: it loads CUDA libraries.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from snapfn.handler.llm.kernels.base import ExpertWeights
from snapfn.handler.llm.weights.quant import FP8_BLOCK, FP8_DTYPE, FP8_MAX

# NOTE: deep_gemm's FP8 kernels write bf16 (or float32) outputs only
DTYPES = (torch.bfloat16,)
_log = logging.getLogger(__name__)


@dataclass
class DeepGemm:
    """deep_gemm, imported and checked usable on one device."""

    lib: ModuleType
    m_alignment: int  # each expert's run of rows in the grouped layout is a multiple of this

    @classmethod
    def load(cls, device: torch.device | str) -> DeepGemm | None:
        """deep_gemm for `device`, or None: not installed, or installed but not usable here
        (not an SM90 GPU, or its import fails: logged with the reason, which `require`
        raises for callers that need it)."""
        if importlib.util.find_spec("deep_gemm") is None:
            return None
        try:
            return cls.require(device)
        except (ImportError, OSError, RuntimeError, AssertionError) as exc:
            # NOTE: deep_gemm's __init__ asserts that it finds a CUDA home
            _log.warning("DeepGEMM is installed but not used on %s: %s", device, exc)
            return None

    @classmethod
    def require(cls, device: torch.device | str) -> DeepGemm:
        device = torch.device(device)
        if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
            raise RuntimeError(f"DeepGEMM's FP8 path here needs an SM90 GPU, not {device}")
        lib = importlib.import_module("deep_gemm")
        return cls(lib, int(lib.get_mk_alignment_for_contiguous_layout()))

    @staticmethod
    def fits_linear(x: torch.Tensor, q: torch.Tensor) -> bool:
        n, k = q.shape[-2:]
        return x.dtype in DTYPES and q.dim() == 2 and n % FP8_BLOCK == 0 and k % FP8_BLOCK == 0

    @staticmethod
    def fits_moe(x: torch.Tensor, experts: ExpertWeights) -> bool:
        inter, hidden = experts.gate.shape[1:]
        return (
            x.dtype in DTYPES
            and experts.gate_scale_inv is not None
            and inter % FP8_BLOCK == 0
            and hidden % FP8_BLOCK == 0
        )

    def linear(self, x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
        """`x [..., K] @ dequant(q [N, K]).T` with x quantized per 1x128 group."""
        n, k = q.shape
        rows = x.reshape(-1, k)
        out = torch.empty(rows.shape[0], n, dtype=x.dtype, device=x.device)
        if rows.shape[0]:
            self.lib.fp8_gemm_nt(
                quantize_rows(rows), (q, scale_inv.float()), out, disable_ue8m0_cast=True
            )
        return out.view(*x.shape[:-1], n)

    def moe(
        self,
        x: torch.Tensor,  # [T, H]
        experts: ExpertWeights,
        topk_ids: torch.Tensor,  # [T, k] global expert ids
        topk_weights: torch.Tensor,  # [T, k]
    ) -> torch.Tensor:  # [T, H] in x's dtype: this rank's experts' contributions
        # NOTE: imported here: triton.moe imports triton, which only GPU runs need
        from snapfn.handler.llm.kernels.triton.moe import align_by_expert

        num_tokens, hidden = x.shape
        topk = topk_ids.shape[1]
        num_pairs = num_tokens * topk
        pair_of_row, expert_of_block = align_by_expert(
            topk_ids, experts.first_expert, experts.num_local, self.m_alignment
        )
        pair = pair_of_row.long()  # [R]; num_pairs on padding rows
        live = pair < num_pairs
        expert_of_row = expert_of_block.repeat_interleave(self.m_alignment)  # [R]
        layout = torch.where(live, expert_of_row, -1).to(torch.int32).contiguous()
        token = torch.where(live, pair // topk, 0)
        rows = torch.where(live[:, None], x[token], 0)  # [R, H], zeros on padding rows
        a = quantize_rows(rows)
        gate = self._grouped(a, experts.gate, experts.gate_scale_inv, layout)
        up = self._grouped(a, experts.up, experts.up_scale_inv, layout)
        act = F.silu(gate) * up  # in x's dtype, as the reference
        y = self._grouped(quantize_rows(act), experts.down, experts.down_scale_inv, layout)
        weights = torch.cat([topk_weights.reshape(-1), topk_weights.new_zeros(1)])[pair]
        y = (y * weights[:, None]).float()  # rounded to x's dtype first, as the reference
        out = torch.zeros(num_pairs + 1, hidden, dtype=torch.float32, device=x.device)
        out.index_copy_(0, pair, y)  # padding rows (garbage: DeepGEMM skips them) -> spare row
        return out[:num_pairs].view(num_tokens, topk, hidden).sum(dim=1).to(x.dtype)

    def _grouped(self, a, weight, scale_inv, layout) -> torch.Tensor:
        out = torch.empty(layout.numel(), weight.shape[1], dtype=torch.bfloat16, device=a[0].device)
        self.lib.m_grouped_fp8_gemm_nt_contiguous(
            a, (weight, scale_inv.float()), out, layout, disable_ue8m0_cast=True
        )
        return out


def quantize_rows(x: torch.Tensor, group: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """`x [M, K]` -> (fp8 e4m3 [M, K], float32 scales [M, K/group]): each row's 1x`group`
    slices scaled so that their largest magnitude maps to e4m3's largest, `x ~ q * scale`."""
    m, k = x.shape
    groups = x.float().view(m, k // group, group)
    scale = groups.abs().amax(dim=-1).clamp(min=1e-10) / FP8_MAX  # [M, K/group]
    q = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, k), scale
