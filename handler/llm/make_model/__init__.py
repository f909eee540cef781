"""`snapfn make-model`: synthetic checkpoints in the exact Hugging Face layout.

    presets (../presets.py)  named shapes: llama tiny/small/8b, qwen3/qwen2 tiny, glm tiny/5-reduced
    hf_layout.py             tensor names + shapes per architecture, storage dtypes (fp8 scales)
    hf_config.py             config.json / generation_config.json as transformers writes them
    tokenizer.py             byte-level tokenizer padded to exactly vocab_size entries
    safetensors_writer.py    shard planning + streaming writer (one tensor in RAM) + index
    build.py                 make_model(): generate, quantize, write, publish atomically
    cli.py                   MakeModelArgs, add_arguments(), run()

Public API: `make_model`, `add_arguments`, `run`, `list_presets`, `MakeModelArgs`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..presets import list_presets
from .cli import MakeModelArgs, add_arguments, run

if TYPE_CHECKING:
    from .build import make_model

__all__ = ["MakeModelArgs", "add_arguments", "list_presets", "make_model", "run"]


def __getattr__(name: str) -> Any:
    # NOTE: `build` imports torch (seconds); load it on first use so the CLI parser stays fast.
    if name == "make_model":
        from .build import make_model

        return make_model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
