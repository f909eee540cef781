"""Model registry: architecture name → CausalLM class (imported lazily)."""

from __future__ import annotations

import importlib

from snapfn.handler.llm.models.base import CausalLM
from snapfn.snapshot.errors import UnsupportedModel

_MODELS = {
    "llama": ("llama", "LlamaForCausalLM"),
    "glm_moe_dsa": ("glm_moe_dsa", "GlmMoeDsaForCausalLM"),
}


def model_class(arch: str) -> type[CausalLM]:
    if arch not in _MODELS:
        raise UnsupportedModel(f"architecture {arch!r} has no model implementation")
    module, name = _MODELS[arch]
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
