"""Triton backend: the torch reference with our own Triton kernels where they cover an op.

- `linear` and `add_norm_linear` of one 16-bit row (a batch-1 decode step), 16-bit or FP8
  weight: `triton.gemv`, with the norm before and SwiGLU after fused in (`SNAPFN_GEMV=off`, or
  `gemv="off"`, turns it off), K split where its column tiles leave SMs idle
  (`SNAPFN_GEMV_SPLIT=off`, or `gemv_split="off"`, never splits);
- `linear` with an FP8 weight: up to `FP8_FUSED_MAX_ROWS` input rows (decode steps) by
  `fp8_block_linear`, which dequantizes the 128x128 block-scaled weight tile by tile in
  registers (a step reads each weight byte once); more rows (prefill, compute-bound) by
  DeepGEMM's FP8 GEMM where it is importable on an SM90 GPU (`deepgemm.py`; `deepgemm="off"`,
  or SNAPFN_DEEPGEMM=off through the registry, turns it off), else the weight is dequantized by
  a Triton kernel, then multiplied by `F.linear` like the reference does;
- `rms_norm`: one program per row (GPU-tested on the H200 as a kernel and in the models'
  whole-model greedy cases);
- `add_rms_norm`, `rope_store_kv`, `rope_part`, `norm_rope_store`, `silu_mul`: the decode
  step's elementwise work, one launch each where the reference launches five to fifteen small
  kernels (the residual add and the norm; RoPE of q and k and both cache writes; MLA's and
  DSA's partial RoPE with its concatenation; MLA's latent norm, RoPE and cache write, and
  the indexer key's (`layer_norm_rope_store`; `cache_stores="off"`, or SNAPFN_CACHE_STORES=off,
  keeps the reference's ops for these two); SwiGLU's activation);
- `moe`: `triton.moe.fused_moe`, no host sync (the reference's `.tolist()` keeps decode graphs
  from capturing a MoE model); bf16 / fp32 and FP8 block-scaled experts; one token (and the
  GEMV on) by `triton.moe.moe_gemv`, its experts as matrix-vector products. FP8 experts of more
  than `FP8_FUSED_MAX_ROWS` tokens (prefill) run DeepGEMM's grouped GEMM where it is usable;
- `route`: the MoE router in one launch (`triton.moe.route`; `router="off"`, or
  SNAPFN_MOE_ROUTER=off, keeps the reference's torch ops);
- `dsa_topk`: for decode batches `triton.indexer.indexer_topk_decode` scores only each
  request's own keys, then picks them in one launch (`select_topk_decode`; `indexer_select=
  "off"`, or SNAPFN_INDEXER_SELECT=off, keeps the reference's sort); a prefill chunk's scores by
  `triton.indexer.index_scores_prefill` (`prefill_indexer="off"`, or
  SNAPFN_PREFILL_INDEXER=off, keeps the reference's float32 GEMM), picked by the reference;
- `paged_attention` for decode batches: `triton.attention.paged_decode_attention`, which reads
  only each request's own pages;
- `mla_attention` for decode batches: `triton.mla.mla_decode_latent`, the latent attention
  with `kv_b` absorbed and the DSA selection read on the GPU (no host planning);
  `mla_decode="off"` (SNAPFN_MLA_DECODE=off) keeps the reference here and flashinfer's MLA
  kernel in the flashinfer backend (on the H200, 0.870 ms against 1.093 a GLM-5-shaped
  batch-1 step, the same at batch 8: bench/results/2026-12-01-h200-steady-glm5);
- MLA's absorbed products (`absorb_kv_b`, for `triton.mla` here and flashinfer's MLA kernel),
  with `mla_absorb="triton"` (SNAPFN_MLA_ABSORB=triton) and a decode-sized batch:
  `triton.absorb`, reading `kv_b` as stored (FP8: half the bytes); "auto", the default until
  it is timed on a GPU, keeps `torch_ref`'s bmms over a dense copy of `kv_b` in q's dtype.

Each kernel is checked against the reference on the H200 and under triton's interpreter
(tests/triton_checks.py).

Everything else is inherited from `TorchBackend`, which stays the oracle (docs/kernels.md).
Tensors off the GPU run the reference too, unless `TRITON_INTERPRET=1` (set before triton is
imported) runs the kernels on the CPU, as the CPU tests do: triton compiles for GPUs only.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from snapfn.handler.llm.kernels.deepgemm import DeepGemm
from snapfn.handler.llm.kernels.torch_ref import TorchBackend, absorb_query, expand_output


def _kernels(x: torch.Tensor, module: str = "kernels") -> ModuleType | None:
    """Our kernel module `module` for tensors like `x`, or None where they are on the CPU and
    triton does not interpret (then the caller runs the reference)."""
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        return None
    # lazy: importing triton takes seconds and the package must import without it
    import importlib

    return importlib.import_module(f"{__package__}.{module}")


# NOTE: above this many rows a GEMM is compute-bound and cuBLAS on the dequantized weight wins;
# at or below it, the weight's bytes are the cost and the fused kernel reads a fifth of them
FP8_FUSED_MAX_ROWS = 64


class TritonBackend(TorchBackend):
    name = "triton"
    capturable_moe = True  # fused_moe and the decode indexer never wait for the host

    def __init__(
        self,
        deepgemm: str = "auto",
        gemv: str = "auto",
        prefill_indexer: str = "auto",
        router: str = "auto",
        indexer_select: str = "auto",
        gemv_split: str = "auto",
        cache_stores: str = "auto",
        mla_decode: str = "auto",
        mla_absorb: str = "auto",
        moe_gemv_rows: str = "auto",
        fp8_linear_split: str = "auto",
    ) -> None:
        for name, value in (
            ("deepgemm", deepgemm),
            ("gemv", gemv),
            ("moe_gemv_rows", moe_gemv_rows),
            ("fp8_linear_split", fp8_linear_split),
            ("prefill_indexer", prefill_indexer),
            ("router", router),
            ("indexer_select", indexer_select),
            ("gemv_split", gemv_split),
            ("cache_stores", cache_stores),
        ):
            if value not in ("auto", "off"):
                raise ValueError(f"{name} must be 'auto' or 'off', not {value!r}")
        self._gemv = gemv == "auto"
        self._moe_gemv_rows = moe_gemv_rows == "auto"  # 2-4 tokens' experts as GEMVs too
        # decode-sized FP8 products' K split: `triton.kernels.fp8_split_count`'s, or none
        self._fp8_splits = "auto" if fp8_linear_split == "auto" else 1
        self._prefill_indexer = prefill_indexer == "auto"
        self._router = router == "auto"
        self._indexer_select = indexer_select == "auto"
        self._gemv_splits = None if gemv_split == "auto" else 1  # `split_count`'s, or none
        self._cache_stores = cache_stores == "auto"
        if mla_decode not in ("auto", "off", "triton"):  # triton: the opt-in before 4314b28
            raise ValueError(f"mla_decode must be 'auto' or 'off', not {mla_decode!r}")
        self._mla_decode = mla_decode != "off"
        if mla_absorb not in ("auto", "triton"):
            raise ValueError(f"mla_absorb must be 'auto' or 'triton', not {mla_absorb!r}")
        self._mla_absorb = mla_absorb == "triton"
        self._dense_kv_b: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._deepgemm_mode = deepgemm
        self._deepgemm: dict[torch.device, DeepGemm | None] = {}  # resolved per device

    def deepgemm_for(self, x: torch.Tensor) -> DeepGemm | None:
        """DeepGEMM for `x`'s device, where it is on, importable and usable there."""
        if self._deepgemm_mode == "off" or not x.is_cuda:
            return None
        if x.device not in self._deepgemm:
            self._deepgemm[x.device] = DeepGemm.load(x.device)
        return self._deepgemm[x.device]

    def deepgemm_in_use(self) -> bool:
        """Whether DeepGEMM was found usable for a device this backend ran on."""
        return any(gemm is not None for gemm in self._deepgemm.values())

    def _gemv_kernels(
        self, x: torch.Tensor, weight: torch.Tensor, scale_inv, swiglu: bool = False
    ) -> ModuleType | None:
        """`triton.gemv` where it takes this product: on, one 16-bit input row, and a 2-D
        weight of x's dtype, a float32 one, or an FP8 one that `triton.gemv.takes_fp8`."""
        if not self._gemv or weight.dim() != 2 or x.numel() != x.shape[-1]:  # one row only
            return None
        if x.dtype not in (torch.float16, torch.bfloat16):
            return None
        if scale_inv is None and weight.dtype not in (x.dtype, torch.float32):
            return None
        tg = _kernels(x, "gemv")
        if tg is not None and scale_inv is not None and not tg.takes_fp8(weight, scale_inv, swiglu):
            return None
        return tg

    def add_norm_linear(
        self,
        x,
        residual,
        norm_weight,
        eps,
        weight,
        bias=None,
        weight_scale_inv=None,
        swiglu=False,
        float_out=False,
    ):
        tg = self._gemv_kernels(x, weight, weight_scale_inv, swiglu)
        if tg is None:
            return super().add_norm_linear(
                x, residual, norm_weight, eps, weight, bias, weight_scale_inv, swiglu, float_out
            )
        out, total = tg.gemv(
            x,
            weight,
            bias,
            norm_weight=norm_weight,
            eps=eps,
            residual=residual,
            swiglu=swiglu,
            weight_scale_inv=weight_scale_inv,
            splits=self._gemv_splits,
            float_out=float_out,  # stored as float32 by the kernel: no cast launch after it
        )
        return out, x if total is None else total

    def linear(self, x, weight, bias=None, weight_scale_inv=None):
        tg = self._gemv_kernels(x, weight, weight_scale_inv)
        if tg is not None:
            splits = self._gemv_splits
            return tg.gemv(x, weight, bias, weight_scale_inv=weight_scale_inv, splits=splits)[0]
        tk = _kernels(x)
        fused = x.numel() // x.shape[-1] <= FP8_FUSED_MAX_ROWS and weight.dim() == 2
        if weight_scale_inv is not None and not fused:
            gemm = self.deepgemm_for(x)
            if gemm is not None and gemm.fits_linear(x, weight):
                out = gemm.linear(x, weight, weight_scale_inv)
                return out if bias is None else out + bias
        if weight_scale_inv is None or tk is None or not fused:
            # dequantized by `_dense_weight` (the Triton kernel for FP8), then F.linear
            return super().linear(x, weight, bias, weight_scale_inv)
        out = tk.fp8_block_linear(x, weight, weight_scale_inv, splits=self._fp8_splits)
        return out if bias is None else out + bias

    def _dense_weight(self, weight, scale_inv, dtype):
        tk = _kernels(weight)
        if scale_inv is None or tk is None:
            return super()._dense_weight(weight, scale_inv, dtype)
        return tk.dequantize_fp8_block(weight, scale_inv, dtype)

    def moe(self, x, experts, topk_ids, topk_weights):
        if x.shape[0] > FP8_FUSED_MAX_ROWS:
            gemm = self.deepgemm_for(x)
            if gemm is not None and gemm.fits_moe(x, experts):
                return gemm.moe(x, experts, topk_ids, topk_weights)
        tm = _kernels(x, "moe")
        if tm is None:
            return super().moe(x, experts, topk_ids, topk_weights)
        most = tm.MOE_GEMV_MAX_TOKENS if self._moe_gemv_rows else 1
        if self._gemv and 0 < x.shape[0] <= most:  # a decode or verify step's experts as GEMVs
            return tm.moe_gemv(x, experts, topk_ids, topk_weights)
        return tm.fused_moe(x, experts, topk_ids, topk_weights)

    def route(self, logits, correction_bias, moe):
        tm = _kernels(logits, "moe") if self._router else None
        if tm is None:
            return super().route(logits, correction_bias, moe)
        return tm.route(logits, correction_bias, moe)

    def dsa_topk(self, q, weights, k_cache, batch, topk, scale):
        ti = _kernels(q, "indexer")
        if not batch.is_decode or ti is None:
            return super().dsa_topk(q, weights, k_cache, batch, topk, scale)
        return ti.indexer_topk_decode(
            q, weights, k_cache, batch.page_table, batch.seq_lens, topk, scale, self._indexer_select
        )

    def _prefill_index_scores(self, q, weights, k, q_offset, scale):
        ti = _kernels(q, "indexer") if self._prefill_indexer else None
        if ti is None:
            return super()._prefill_index_scores(q, weights, k, q_offset, scale)
        return ti.index_scores_prefill(q, weights, k, q_offset, scale)

    def rms_norm(self, x, weight, eps):
        tk = _kernels(x)
        return super().rms_norm(x, weight, eps) if tk is None else tk.rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        tk = _kernels(x)
        if tk is None:
            return super().add_rms_norm(x, residual, weight, eps)
        return tk.add_rms_norm(x, residual, weight, eps)

    def rope_store_kv(self, q, k, v, cos, sin, interleaved, k_cache, v_cache, batch):
        tk = _kernels(q)
        if tk is None:
            return super().rope_store_kv(q, k, v, cos, sin, interleaved, k_cache, v_cache, batch)
        return tk.rope_store_kv(
            q, k, v, cos, sin, interleaved, k_cache, v_cache, batch.slot_mapping
        )

    def rope_part(self, x, cos, sin, interleaved, start):
        tk = _kernels(x)
        if tk is None:
            return super().rope_part(x, cos, sin, interleaved, start)
        return tk.rope_part(x, cos, sin, interleaved, start)

    def norm_rope_store(self, cache, x, norm_weight, eps, cos, sin, interleaved, batch):
        tk = _kernels(x) if self._cache_stores else None
        if tk is None:
            return super().norm_rope_store(cache, x, norm_weight, eps, cos, sin, interleaved, batch)
        return tk.norm_rope_store(
            x, norm_weight, eps, cos, sin, interleaved, cache, batch.slot_mapping
        )

    def layer_norm_rope_store(self, cache, x, weight, bias, eps, cos, sin, interleaved, batch):
        tk = _kernels(x) if self._cache_stores else None
        if tk is None:
            return super().layer_norm_rope_store(
                cache, x, weight, bias, eps, cos, sin, interleaved, batch
            )
        return tk.layer_norm_rope_store(
            x, weight, bias, eps, cos, sin, interleaved, cache, batch.slot_mapping
        )

    def greedy_picks(self, logits):
        ts = _kernels(logits, "sampling")
        return super().greedy_picks(logits) if ts is None else ts.greedy_picks(logits)

    def silu_mul(self, gate_up):
        tk = _kernels(gate_up)
        return super().silu_mul(gate_up) if tk is None else tk.silu_mul(gate_up)

    def mla_attention(
        self, q, latent_cache, kv_b_weight, kv_b_scale_inv, batch, scale, topk_indices=None
    ):
        tm = self._triton_mla(batch, q)
        if tm is None or not tm.takes(q, latent_cache, kv_b_weight.shape[1]):
            return super().mla_attention(
                q, latent_cache, kv_b_weight, kv_b_scale_inv, batch, scale, topk_indices
            )
        rope = latent_cache.shape[-1] - kv_b_weight.shape[1]
        q_lat, q_pe, expand = self.absorb_kv_b(q, kv_b_weight, kv_b_scale_inv, rope)
        out_latent = tm.mla_decode_latent(
            q_lat, q_pe, latent_cache, batch.page_table, batch.seq_lens, scale, topk_indices
        )
        return expand(out_latent)

    def _triton_mla(self, batch, like: torch.Tensor) -> ModuleType | None:
        """`triton.mla` where it runs `batch`'s MLA (a decode batch, `mla_decode` on, tensors
        like `like` on the GPU or interpreted), else None."""
        if not (self._mla_decode and batch.is_decode):
            return None
        return _kernels(like, "mla")

    def absorb_kv_b(self, q, kv_b_weight, kv_b_scale_inv, rope: int):
        """MLA's `kv_b` folded into `q [T, H, Dn + Dr]`: `(q_latent [T, H, R], q_pe [T, H,
        Dr], expand)`, where `expand(out_latent [T, H, R])` is each head's `W_v` applied to
        the attention's latent output. `triton.absorb` under `mla_absorb="triton"` where it
        takes the batch; else `torch_ref`'s bmms over the dense `kv_b` (`_kv_b`)."""
        nope = q.shape[2] - rope
        tab = _kernels(q, "absorb") if self._mla_absorb else None
        if tab is not None and tab.takes(q.shape[0], kv_b_weight, kv_b_scale_inv):
            q_lat = tab.absorb_query(q, kv_b_weight, kv_b_scale_inv, rope)

            def expand_stored(out_latent):
                return tab.expand_output(out_latent, kv_b_weight, kv_b_scale_inv, nope)

            return q_lat, q[..., nope:], expand_stored
        kv_b = self._kv_b(kv_b_weight, kv_b_scale_inv, q.dtype)
        q_lat, q_pe, w_v = absorb_query(q, kv_b, kv_b.shape[1], rope)

        def expand_dense(out_latent):
            return expand_output(out_latent, w_v)

        return q_lat, q_pe, expand_dense

    def _kv_b(self, weight, scale_inv, dtype):
        """`kv_b` in `dtype`; an FP8 one dequantized once, at its first use, and kept (the MLA
        reads it whole every step: H * (Dn + Dv) * R values, 29 MB a layer for GLM-5)."""
        if scale_inv is None and weight.dtype == dtype:
            return weight
        cached = self._dense_kv_b.get(weight.data_ptr())
        if cached is None or cached[0] is not weight:
            cached = (weight, self._dense_weight(weight, scale_inv, dtype))
            self._dense_kv_b[weight.data_ptr()] = cached
        return cached[1]

    def paged_attention(self, q, k_cache, v_cache, batch, scale):
        ta = _kernels(q, "attention")
        if not batch.is_decode or ta is None:
            return super().paged_attention(q, k_cache, v_cache, batch, scale)
        return ta.paged_decode_attention(
            q, k_cache, v_cache, batch.page_table, batch.seq_lens, scale
        ).to(q.dtype)
