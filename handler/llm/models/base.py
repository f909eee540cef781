"""What every model implements for the engine and the loader.

A model's parameter names mirror the Hugging Face checkpoint names, so most checkpoint tensors
map to the parameter of the same name; `map_weight` handles the rest (stacked experts) and
returns None for tensors the model does not consume. Tensors deliberately left unloaded are
listed in `not_loaded` (regexes) so the coverage check can tell them from mistakes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..engine.batch import ForwardBatch
from ..engine.kv_pool import KVBufferSpec, KVPool
from ..kernels import Backend
from ..sharding import ParallelConfig
from .layers import Linear, RMSNorm, is_quantized


@dataclass(frozen=True)
class WeightTarget:
    """Where a checkpoint tensor goes: a parameter, and a row of it for stacked experts."""

    param: str
    index: int | None = None


class CausalLM(nn.Module):
    """Base class: subclasses build layers in `__init__` and implement `forward`."""

    not_loaded: tuple[str, ...] = ()

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

    def linear(
        self,
        name: str,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dtype: torch.dtype | None = None,
    ) -> Linear:
        """A Linear for checkpoint module `name`: FP8 when the quant config covers it."""
        return Linear(
            in_features,
            out_features,
            self.backend,
            bias=bias,
            fp8=is_quantized(name, self.config.quant),
            dtype=dtype or self.dtype,
            device=self.device,
        )

    def norm(self, dim: int) -> RMSNorm:
        return RMSNorm(dim, self.config.rms_norm_eps, self.dtype, self.device, self.backend)

    def embedding(self) -> nn.Embedding:
        """The token embedding: `model.embed_tokens`, filled by the loader."""
        cfg = self.config
        emb = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=self.dtype, device=self.device)
        emb.weight.requires_grad_(False)
        return emb

    def add_lm_head(self) -> None:
        """`lm_head`, or (tied embeddings) mark a checkpoint's copy of it as deliberately unused."""
        cfg = self.config
        if cfg.tie_word_embeddings:
            self.not_loaded = (*self.not_loaded, r"lm_head\.weight")
        else:
            self.lm_head = self.linear("lm_head", cfg.hidden_size, cfg.vocab_size)

    def final_logits(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Final norm, keep the rows logits are wanted for, project to the vocabulary (fp32)."""
        h = self.model.norm(h)
        if not batch.all_logits:
            h = h[batch.logits_indices]
        if self.config.tie_word_embeddings:
            return F.linear(h, self.model.embed_tokens.weight).float()
        return self.lm_head(h).float()

    def kv_buffer_specs(self) -> list[KVBufferSpec]:
        raise NotImplementedError

    def forward(self, batch: ForwardBatch, kv: KVPool) -> torch.Tensor:  # [num_logits, V] fp32
        raise NotImplementedError

    def map_weight(self, name: str) -> WeightTarget | None:
        """Default: a checkpoint tensor fills the parameter of the same name, if there is one."""
        return WeightTarget(name) if name in self._param_names() else None

    def is_not_loaded(self, name: str) -> bool:
        return any(re.fullmatch(p, name) for p in self.not_loaded)

    def _param_names(self) -> set[str]:
        if not hasattr(self, "_names_cache"):
            self._names_cache = {n for n, _ in self.named_parameters()}
        return self._names_cache
