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
from torch import nn

from ..config import ModelConfig
from ..engine.batch import ForwardBatch
from ..engine.kv_pool import KVBufferSpec, KVPool
from ..kernels import Backend
from ..sharding import ParallelConfig


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
