"""Helpers of the LLM function's snapshot: figures of a report, model files, config as JSON,
the model's content hash. Split from function.py."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from snapfn.handler.llm.init_config import InitConfig

MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def report_fields(report: Any) -> dict[str, Any]:
    from dataclasses import asdict, is_dataclass

    data = asdict(report) if is_dataclass(report) else dict(vars(report))
    return {
        k: (round(v, 4) if isinstance(v, float) else v)
        for k, v in data.items()
        if not isinstance(v, list)
    }


def copy_model_files(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name in MODEL_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)


def config_json(config: InitConfig) -> dict[str, Any]:
    from dataclasses import asdict

    return {k: (str(v) if isinstance(v, os.PathLike) else v) for k, v in asdict(config).items()}


def model_content_hash(config_raw: dict[str, Any], layout: Any) -> str:
    """sha256 over the model as loaded: its config and every tensor's name, dtype, shape and
    bytes (through the restore layout's whole-file sha256, computed while it was written)."""
    import hashlib
    import json

    tensors = {name: [e.dtype, list(e.shape)] for name, e in layout.tensors.items()}
    doc = {"config": config_raw, "tensors": tensors, "weights_sha256": layout.file_sha256}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()
