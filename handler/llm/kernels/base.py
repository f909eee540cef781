"""The backend seam: every attention, GEMM and MoE call of the models goes through a Backend.

A backend is chosen by name from a registry (`kernels.get_backend`), never by sniffing paths.
The torch reference backend runs on CPU and CUDA and is the oracle the faster ones (FlashInfer,
Triton, DeepGEMM, DeepEP — a later issue) are checked against. A new backend subclasses
`Backend`, overrides what it accelerates and inherits the rest.

Tensor conventions: tokens are flattened across requests (`T` rows, see `ForwardBatch`);
caches are one layer's `[num_pages, page_size, *token_shape]` view of the KV pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from snapfn.handler.llm.config import MoEConfig
from snapfn.handler.llm.engine.batch import ForwardBatch
from snapfn.handler.llm.engine.sampler import greedy_picks


@dataclass
class ExpertWeights:
    """One MoE layer's local experts, stacked: expert `first_expert + i` is row `i`."""

    gate: torch.Tensor  # [E_local, I, H]
    up: torch.Tensor  # [E_local, I, H]
    down: torch.Tensor  # [E_local, H, I]
    gate_scale_inv: torch.Tensor | None = None  # [E_local, ceil(I/128), ceil(H/128)] for fp8
    up_scale_inv: torch.Tensor | None = None
    down_scale_inv: torch.Tensor | None = None
    first_expert: int = 0

    @property
    def num_local(self) -> int:
        return self.gate.shape[0]


class Backend:
    """Interface and registry entry. Subclasses implement every method below."""

    name = "abstract"
    # whether `moe` and `dsa_topk` run without host syncs (decode CUDA graphs of MoE models need
    # it; the reference's MoE loops over the experts hit, on the host)
    capturable_moe = False

    def begin_forward(self, batch: ForwardBatch, graph: bool = False) -> None:
        """Announce a forward over `batch`, outside any CUDA graph capture, so that a backend
        whose kernels need host-side planning plans once for all layers. `graph=True`: the
        forward is a decode CUDA graph over exactly this batch's rows and page-table width,
        captured next or replayed now, so what its kernels read must be planned into buffers
        fixed for that graph. `DecodeGraphs` calls this before each capture and each replay;
        eager forwards are not announced (warmup and the memory profile run the model
        directly), so a backend plans those at its first call with a new batch. Default: no
        planning."""

    def greedy_picks(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's argmax of `logits [B, V]` and its logprob, on their device, with no host
        sync: `(tokens [B] int64, [B, 2] float64 of token id and logprob)`. Default: the
        sampler's torch ops (`engine.sampler.greedy_picks`, the oracle)."""
        return greedy_picks(logits)

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        weight_scale_inv: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`x @ W.T + b`; W may be fp8 with a 128x128 block `weight_scale_inv`. A float32 `W`
        (a module Hugging Face keeps in float32, `_keep_in_fp32_modules`: GLM-5's indexer
        `weights_proj`, the MoE router) multiplies `x` upcast to float32, and the product is
        float32, whatever `x`'s dtype."""
        raise NotImplementedError

    def add_norm_linear(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        weight_scale_inv: torch.Tensor | None = None,
        swiglu: bool = False,
        float_out: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's entry: `h = x + residual` (`x` when `residual` is None), then
        `(linear(rms_norm(h)), h)`; with `swiglu`, `silu_mul` of the projection (a fused
        gate | up); with `float_out`, the product (rounded to its dtype, as ever) as float32,
        as the final logits are. Default: `add_rms_norm` (or `rms_norm`), `linear`,
        `silu_mul`, as the models ran them before the fused kernel (`triton.gemv`) took them
        on."""
        if residual is None:
            normed, h = self.rms_norm(x, norm_weight, eps), x
        else:
            normed, h = self.add_rms_norm(x, residual, norm_weight, eps)
        out = self.linear(normed, weight, bias, weight_scale_inv)
        out = self.silu_mul(out) if swiglu else out
        return (out.float() if float_out else out), h

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dim of `x [..., H]` with `weight [H]` (float32 statistics,
        cast back to `x`'s dtype, then times the weight)."""
        raise NotImplementedError

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream's step: `h = x + residual` (in `x`'s dtype), then
        `(rms_norm(h), h)`."""
        raise NotImplementedError

    def rope_store_kv(
        self,
        q: torch.Tensor,  # [T, Hq, D], may be a strided view (of a fused qkv projection)
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, Dv]
        cos: torch.Tensor,  # [T, D/2]
        sin: torch.Tensor,  # [T, D/2]
        interleaved: bool,
        k_cache: torch.Tensor,  # [P, S, Hkv, D]
        v_cache: torch.Tensor,  # [P, S, Hkv, Dv]
        batch: ForwardBatch,
    ) -> torch.Tensor:  # [T, Hq, D], q rotated
        """Rotate `q` and `k` by RoPE (`apply_rotary`), write the rotated `k` and `v` into the
        caches at `batch.slot_mapping` and return the rotated `q`."""
        raise NotImplementedError

    def rope_part(
        self,
        x: torch.Tensor,  # [T, H, D], may be a strided view (of a projection's output)
        cos: torch.Tensor,  # [T, R/2]
        sin: torch.Tensor,  # [T, R/2]
        interleaved: bool,
        start: int,
    ) -> torch.Tensor:  # [T, H, D], contiguous
        """`x` with dims `start : start + R` of each head rotated by RoPE (`apply_rotary`) and
        the rest copied: MLA's `q_nope | rope(q_rope)`, DSA's `rope(q_rot) | q_pass`."""
        raise NotImplementedError

    def norm_rope_store(
        self,
        cache: torch.Tensor,  # [P, S, R + Dr]
        x: torch.Tensor,  # [T, R + Dr], may be a strided view (of a fused projection)
        norm_weight: torch.Tensor,  # [R]
        eps: float,
        cos: torch.Tensor,  # [T, Dr/2]
        sin: torch.Tensor,
        interleaved: bool,
        batch: ForwardBatch,
    ) -> None:
        """Write `rms_norm(x[:, :R]) | rope(x[:, R:])` (`R`: the norm's width) into `cache` at
        `batch.slot_mapping`: MLA's latent, `kv_a_layernorm(c) | rope(k_rope)`. Default: the
        norm, the rotation (`rope_part`), their concatenation and `store_kv`."""
        rank = norm_weight.shape[0]
        rotated = self.rope_part(x[:, None, rank:], cos, sin, interleaved, 0)[:, 0]
        normed = self.rms_norm(x[:, :rank], norm_weight, eps)
        self.store_kv(cache, torch.cat([normed, rotated], dim=-1), batch)

    def layer_norm_rope_store(
        self,
        cache: torch.Tensor,  # [P, S, D]
        x: torch.Tensor,  # [T, D], may be a strided view (of a fused projection)
        weight: torch.Tensor,  # [D]
        bias: torch.Tensor,  # [D]
        eps: float,
        cos: torch.Tensor,  # [T, R/2]
        sin: torch.Tensor,
        interleaved: bool,
        batch: ForwardBatch,
    ) -> None:
        """Write `layer_norm(x)` with its first `R` dims rotated (`rope_part` from dim 0) into
        `cache` at `batch.slot_mapping`: the DSA indexer's key. Default: torch's layer_norm,
        `rope_part` and `store_kv`."""
        normed = F.layer_norm(x, weight.shape, weight, bias, eps)
        self.store_kv(cache, self.rope_part(normed[:, None], cos, sin, interleaved, 0)[:, 0], batch)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SwiGLU's activation: `silu(gate) * up` for `gate_up [T, 2I]` = `gate | up`."""
        raise NotImplementedError

    def store_kv(self, cache: torch.Tensor, values: torch.Tensor, batch: ForwardBatch) -> None:
        """Write `values [T, *token_shape]` into `cache` at `batch.slot_mapping`."""
        raise NotImplementedError

    def paged_attention(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k_cache: torch.Tensor,  # [P, S, Hkv, D]
        v_cache: torch.Tensor,  # [P, S, Hkv, Dv]
        batch: ForwardBatch,
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, Dv]
        """Causal attention of the new tokens over each request's cached tokens."""
        raise NotImplementedError

    def gather_seq(self, cache: torch.Tensor, batch: ForwardBatch, seq: int) -> torch.Tensor:
        """The first `seq_lens[seq]` cached tokens of request `seq`: `[L, *token_shape]`."""
        raise NotImplementedError

    def moe(
        self,
        x: torch.Tensor,  # [T, H]
        experts: ExpertWeights,
        topk_ids: torch.Tensor,  # [T, k] global expert ids
        topk_weights: torch.Tensor,  # [T, k]
    ) -> torch.Tensor:  # [T, H], contributions of the local experts only
        """Routed-expert SwiGLU MLPs weighted by the router; experts off this rank add nothing."""
        raise NotImplementedError

    def route(
        self,
        logits: torch.Tensor,  # [T, E] float32 router logits
        correction_bias: torch.Tensor,  # [E] float32 e_score_correction_bias
        moe: MoEConfig,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, k] int64 global expert ids, [T, k] float32)
        """The MoE router's choice (DeepSeek-V3's `noaux_tc`, `torch_ref.noaux_tc_route`): each
        token's `num_experts_per_tok` experts and their weights. Which order the `k` slots
        come in is not part of the contract (the reference's `topk(sorted=False)`)."""
        raise NotImplementedError

    def dsa_topk(
        self,
        q: torch.Tensor,  # [T, Hi, Di] rotated indexer queries
        weights: torch.Tensor,  # [T, Hi] float32 per-head weights (already times Hi^-0.5)
        k_cache: torch.Tensor,  # [P, S, Di] indexer keys
        batch: ForwardBatch,
        topk: int,
        scale: float,
    ) -> torch.Tensor:  # [T, topk] int32 key positions within the request, -1 = no key
        """DSA indexer: per query, the `topk` causal keys scoring highest on
        `sum_h weights[h] * relu(scale * q[h] . k)`, highest first; a query with at most
        `topk` causal keys gets them all, in position order, padded with -1 (the FlashMLA
        sparse-index layout; attention reads a selection as a set). Among equal scores the
        earlier key wins, as `torch.topk` on a GPU picks them, so a query's selection never
        depends on how its prompt was chunked. On a CPU the torch backend breaks exact ties as
        transformers does there (`torch_ref.pick_as_cpu_topk`), a function of the position and
        the prompt's length (`batch.prompt_lens_cpu`), so still not of the chunking."""
        raise NotImplementedError

    def mla_attention(
        self,
        q: torch.Tensor,  # [T, H, Dn + Dr] (nope | rotated rope)
        latent_cache: torch.Tensor,  # [P, S, R + Dr] (normalised kv latent | rotated k_rope)
        kv_b_weight: torch.Tensor,  # [H * (Dn + Dv), R], maybe fp8
        kv_b_scale_inv: torch.Tensor | None,
        batch: ForwardBatch,
        scale: float,
        topk_indices: torch.Tensor | None = None,  # [T, topk] int32 from `dsa_topk`; None = dense
    ) -> torch.Tensor:  # [T, H, Dv]
        """Causal multi-head latent attention over each request's cached latents, restricted
        to the `topk_indices` keys when given. `kv_b` expands a latent into per-head
        `k_nope | v`; every head shares the latent's `k_rope`."""
        raise NotImplementedError
