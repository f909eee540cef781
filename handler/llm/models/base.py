"""What every model implements for the engine and the loader.

A model's parameter names mirror the Hugging Face checkpoint names, so most checkpoint tensors
map to the parameter of the same name; `map_weight` handles the rest (stacked experts) and
returns None for tensors the model does not consume. Tensors deliberately left unloaded are
listed in `not_loaded` (regexes) so the coverage check can tell them from mistakes.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from snapfn.handler.llm.config import ModelConfig
from snapfn.handler.llm.engine.batch import ForwardBatch
from snapfn.handler.llm.engine.kv_pool import KVBufferSpec, KVPool
from snapfn.handler.llm.kernels.base import Backend
from snapfn.handler.llm.models.layers import Linear, RMSNorm, is_quantized
from snapfn.handler.llm.models.tensor_parallel import (
    RowLinear,
    VocabEmbedding,
    gather_vocab,
    vocab_rows,
)
from snapfn.handler.llm.parallel import ParallelConfig
from snapfn.handler.llm.weights.quant import FP8_BLOCK
from snapfn.snapshot.errors import UnsupportedModel


@dataclass(frozen=True)
class WeightTarget:
    """Where a checkpoint tensor goes: a parameter, a row of it for stacked experts, and a
    range of rows for a fused projection (q|k|v, gate|up), whose parts the checkpoint holds
    as separate tensors."""

    param: str
    index: int | None = None
    rows: tuple[int, int] | None = None

    def dest(self, param: torch.Tensor) -> torch.Tensor:
        """The part of `param` (the parameter's data) this tensor fills."""
        dest = param if self.index is None else param[self.index]
        return dest if self.rows is None else dest[self.rows[0] : self.rows[1]]


class CausalLM(nn.Module):
    """Base class: subclasses build layers in `__init__` and implement `forward`."""

    not_loaded: tuple[str, ...] = ()
    # every rank must run each forward together: a MoE model whose experts exchange tokens
    # all-to-all across ep ranks (`expert_exchange.py`); `Engine.generate` steps them so
    lockstep: bool = False
    # MTP layers run and cached for speculative decoding (`use_draft_layers`); 0: none
    num_draft_layers: int = 0

    def __init__(
        self,
        config: ModelConfig,
        backend: Backend,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        parallel: ParallelConfig | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.backend = backend
        self.dtype = dtype
        self.device = torch.device(device)
        self.parallel = parallel or ParallelConfig()
        self._fused_targets: dict[str, WeightTarget] = {}  # checkpoint name -> fused rows

    def linear(
        self,
        name: str,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dtype: torch.dtype | None = None,
        fp8: bool | None = None,
    ) -> Linear:
        """A Linear for checkpoint module `name`: FP8 when the quant config covers it (or as
        `fp8` says, for a fused module the checkpoint has no name for)."""
        return Linear(
            in_features,
            out_features,
            self.backend,
            bias=bias,
            fp8=is_quantized(name, self.config.quant) if fp8 is None else fp8,
            dtype=dtype or self.dtype,
            device=self.device,
        )

    def row_linear(
        self, name: str, in_features: int, out_features: int, bias: bool = False
    ) -> Linear:
        """A row-parallel Linear for checkpoint module `name` (o_proj, down_proj): this rank's
        `in_features` input rows; at tp > 1 its product is all-reduced (`RowLinear`)."""
        if self.parallel.tp_size == 1:
            return self.linear(name, in_features, out_features, bias)
        return RowLinear(
            in_features,
            out_features,
            self.backend,
            bias=bias,
            fp8=is_quantized(name, self.config.quant),
            dtype=self.dtype,
            device=self.device,
            parallel=self.parallel,
        )

    def fused_linear(
        self,
        prefix: str,
        name: str,
        parts: Sequence[tuple[str, int]],
        in_features: int,
        bias: bool = False,
        pad_fp8: bool = False,
    ) -> Linear | ConcatLinear:
        """One Linear `{prefix}.{name}` for checkpoint projections that read the same input
        (`parts`: each one's name under `prefix` and this rank's output rows), stacked in that
        order: one GEMM per step where the checkpoint has several. Each part's tensors
        (weight, bias, FP8 scales) fill its rows (`map_weight`). The module's `part_spans`
        says which output columns are whose.

        FP8 parts share the weight's 128x128 scale blocks, so each must start on one. With
        `pad_fp8`, each FP8 part takes its rows rounded up to a block (GLM-5's `kv_a`: 576 rows
        in 640), the padding rows zero and its outputs in no span; without it, parts that end
        inside a block are kept apart, like a mix of FP8 and dense parts."""
        quantized = {is_quantized(f"{prefix}.{part}", self.config.quant) for part, _ in parts}
        fp8 = quantized.pop()
        if quantized or (fp8 and not pad_fp8 and any(rows % FP8_BLOCK for _, rows in parts)):
            return self._concat_linear(prefix, name, parts, in_features, bias)
        start, part_spans, padding = 0, {}, []
        for part, rows in parts:
            blocks = -(-rows // FP8_BLOCK)  # the scale rows it fills
            part_spans[part] = (start, start + rows)
            spans = {"weight": part_spans[part]}
            if bias:
                spans["bias"] = spans["weight"]
            if fp8:
                spans["weight_scale_inv"] = (start // FP8_BLOCK, start // FP8_BLOCK + blocks)
            for suffix, span in spans.items():
                self._fused_targets[f"{prefix}.{part}.{suffix}"] = WeightTarget(
                    self.param_name(f"{prefix}.{name}.{suffix}"), rows=span
                )
            end = start + (blocks * FP8_BLOCK if fp8 else rows)
            padding.append(slice(start + rows, end))
            start = end
        linear = self.linear(f"{prefix}.{name}", in_features, start, bias, fp8=fp8)
        with torch.no_grad():  # the padding: never loaded, so that it holds no garbage
            for gap in padding:
                linear.weight[gap].zero_()
                if linear.bias is not None:
                    linear.bias[gap].zero_()
        linear.part_spans = part_spans
        return linear

    def _concat_linear(self, prefix, name, parts, in_features, bias) -> ConcatLinear:
        linears = {}
        for part, rows in parts:
            linears[part] = self.linear(f"{prefix}.{part}", in_features, rows, bias)
            key = ConcatLinear.key(part)
            for suffix, _ in linears[part].named_parameters():
                target = WeightTarget(self.param_name(f"{prefix}.{name}.parts.{key}.{suffix}"))
                self._fused_targets[f"{prefix}.{part}.{suffix}"] = target
        return ConcatLinear(linears)

    def fused_targets(self) -> dict[str, WeightTarget]:
        """Checkpoint name -> the part of a fused projection it fills (`fused_linear`)."""
        return dict(self._fused_targets)

    def norm(self, dim: int) -> RMSNorm:
        return RMSNorm(dim, self.config.rms_norm_eps, self.dtype, self.device, self.backend)

    def embedding(self) -> VocabEmbedding:
        """The token embedding: `model.embed_tokens`, filled by the loader; this tp rank's rows
        of the vocabulary (`VocabEmbedding.lookup` gives every row)."""
        cfg = self.config
        emb = VocabEmbedding(
            cfg.vocab_size, cfg.hidden_size, self.parallel, dtype=self.dtype, device=self.device
        )
        emb.weight.requires_grad_(False)
        return emb

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The hidden states `[T, H]` of `input_ids [T]`, the whole vocabulary's on every rank."""
        return self.model.embed_tokens.lookup(input_ids)

    def add_lm_head(self) -> None:
        """`lm_head` (this tp rank's rows of the vocabulary), or (tied embeddings) mark a
        checkpoint's copy of it as deliberately unused."""
        cfg = self.config
        if cfg.tie_word_embeddings:
            self.not_loaded = (*self.not_loaded, r"lm_head\.weight")
        else:
            _, rows = vocab_rows(cfg.vocab_size, self.parallel)  # this rank's block, padded
            self.lm_head = self.linear("lm_head", cfg.hidden_size, rows)

    def final_logits(
        self, h: torch.Tensor, batch: ForwardBatch, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Final norm (of `h + residual` when the last layer left its residual apart), keep the
        rows logits are wanted for, project to the vocabulary (fp32). The rows are kept first
        (the norm is per row), so that the norm runs inside `lm_head`'s GEMV on a decode step
        (`RMSNorm.add_linear`); a step whose every row wants logits (decode) gathers nothing."""
        keep = batch.logits_indices
        if not batch.all_logits and keep.shape[0] != h.shape[0]:
            h = h[keep]
            residual = None if residual is None else residual[keep]
        if self.config.tie_word_embeddings:
            h, _ = self.model.norm.add(h, residual)
            logits = F.linear(h, self.model.embed_tokens.weight).float()
        else:
            logits = self.model.norm.add_linear(h, residual, self.lm_head, float_out=True)[0]
        return gather_vocab(logits, self.parallel, self.config.vocab_size)

    def use_draft_layers(self) -> None:
        """Run the model's MTP layers for speculative decoding, their KV cached after the main
        layers' (`kv_buffer_specs` counts them): called once, before the KV pool is planned.
        Refused for a model without MTP layers."""
        raise UnsupportedModel(
            f"speculative decoding drafts with the model's MTP layers, and this {self.config.arch} "
            "checkpoint has none (num_nextn_predict_layers=0): set SNAPFN_SPECULATIVE_TOKENS=0"
        )

    def kv_buffer_specs(self) -> list[KVBufferSpec]:
        raise NotImplementedError

    def forward(self, batch: ForwardBatch, kv: KVPool) -> torch.Tensor:  # [num_logits, V] fp32
        raise NotImplementedError

    def idle_forward(self) -> None:
        """A lock-step rank's step with no tokens of its own: it joins the other ranks'
        collectives (and serves the tokens they send its experts)."""
        raise NotImplementedError(f"{type(self).__name__} never runs in lock step")

    def map_weight(self, name: str) -> WeightTarget | None:
        """Default: a part of a fused projection fills its rows (`fused_linear`); any other
        checkpoint tensor fills its parameter (`param_name`), if there is one."""
        if name in self._fused_targets:
            return self._fused_targets[name]
        name = self.param_name(name)
        return WeightTarget(name) if name in self._param_names() else None

    def param_name(self, name: str) -> str:
        """The parameter name of checkpoint name `name` (module prefixes included), for a model
        whose modules sit elsewhere than the checkpoint says (GLM-5's MTP layers). Default: the
        same name."""
        return name

    def is_not_loaded(self, name: str) -> bool:
        return any(re.fullmatch(p, name) for p in self.not_loaded)

    def _param_names(self) -> set[str]:
        if not hasattr(self, "_names_cache"):
            self._names_cache = {n for n, _ in self.named_parameters()}
        return self._names_cache


class ConcatLinear(nn.Module):
    """A fused projection whose parts cannot share one weight (`CausalLM.fused_linear`): the
    parts' outputs side by side, one GEMM each."""

    def __init__(self, parts: dict[str, Linear]) -> None:
        super().__init__()
        self.parts = nn.ModuleDict({self.key(name): part for name, part in parts.items()})
        self.part_spans, start = {}, 0
        for name, part in parts.items():
            self.part_spans[name] = (start, start + part.weight.shape[0])
            start += part.weight.shape[0]

    @staticmethod
    def key(part: str) -> str:
        """A part's module name: its checkpoint name under the prefix, dots as underscores
        (`indexer.wk`: a module name takes no dots)."""
        return part.replace(".", "_")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts.values()], dim=-1)
