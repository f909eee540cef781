"""Rewrite a checkpoint folder with tensors removed, added or replaced (for coverage tests)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from snapfn.handler.llm.weights.quant import quantize_fp8_block


def copy_with(src: Path, dst: Path, drop=(), add=None, config_update=None) -> Path:
    """Copy a single-file checkpoint, dropping names in `drop` and adding `add` tensors."""
    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    for name in drop:
        del tensors[name]
    tensors.update(add or {})
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    if config_update:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(config_update)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def fp8_quantize_checkpoint(
    src: Path, dst: Path, keep=("lm_head", "embed_tokens", "norm")
) -> tuple[Path, Path]:
    """Write an FP8 copy of `src` and a dense copy holding exactly the dequantized weights.

    Returns (fp8_dir, dequantized_dir): the second is the reference HF loads.
    """
    tensors = load_file(src / "model.safetensors")
    fp8, deq = {}, {}
    for name, t in tensors.items():
        if t.dim() == 2 and name.endswith(".weight") and not any(k in name for k in keep):
            q, s = quantize_fp8_block(t)
            fp8[name], fp8[name + "_scale_inv"] = q, s
            deq[name] = (
                q.float()
                * s.repeat_interleave(128, 0)[: t.shape[0]].repeat_interleave(128, 1)[
                    :, : t.shape[1]
                ]
            )
        else:
            fp8[name] = deq[name] = t
    qc = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head", "embed_tokens"],
    }
    fp8_dir = copy_with(
        src, dst / "fp8", drop=list(tensors), add=fp8, config_update={"quantization_config": qc}
    )
    deq_dir = copy_with(
        src, dst / "deq", drop=list(tensors), add={k: v.to(torch.float32) for k, v in deq.items()}
    )
    return fp8_dir, deq_dir
