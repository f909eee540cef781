"""Helpers of the LLM function's snapshot: figures of a report, model files, config as JSON,
the model's content hash. Split from function.py."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from snapfn.handler.llm.init_config import InitConfig

LAYOUT_ALIGN = 2 << 20  # write_restore_layout's default, which write_snapshot uses
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
    tensors = {name: [e.dtype, list(e.shape)] for name, e in layout.tensors.items()}
    return _content_hash(config_raw, tensors, layout.file_sha256)


def loaded_content_hash(
    config_raw: dict[str, Any], named_tensors: Any, align: int = LAYOUT_ALIGN
) -> str:
    """`model_content_hash` of a loaded model without writing its restore layout: the same
    sha256 over the same bytes (each tensor at the next `align`-ed offset, zeros between, as
    layout/writer.py lays them out), a device tensor brought to the host 64 MiB at a time."""
    import hashlib

    import torch

    from snapfn.snapshot.layout.table import dtype_name

    weights, pos, tensors = hashlib.sha256(), 0, {}
    for name, tensor in named_tensors:
        if pad := -pos % align:
            weights.update(bytes(pad))
            pos += pad
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)  # [nbytes]
        for lo in range(0, flat.numel(), 64 << 20):
            weights.update(memoryview(flat[lo : lo + (64 << 20)].cpu().numpy()))
        pos += flat.numel()
        tensors[name] = [dtype_name(tensor.dtype), list(tensor.shape)]
    return _content_hash(config_raw, tensors, weights.hexdigest())


def _content_hash(config_raw: dict[str, Any], tensors: dict[str, Any], weights_sha256: str) -> str:
    import hashlib
    import json

    doc = {"config": config_raw, "tensors": tensors, "weights_sha256": weights_sha256}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()
