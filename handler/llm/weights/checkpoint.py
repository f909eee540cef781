"""A Hugging Face model folder on disk: which tensor lives in which safetensors shard.

`Checkpoint.open(dir)` reads `model.safetensors.index.json` (or the single `model.safetensors`),
checks that every indexed tensor really is in its shard and that no shard is missing, and
records each tensor's dtype and shape from the shard headers (no tensor data is read). A base
model's folder (`LlamaModel.save_pretrained`: no tensor under `model.`) is read under `model.`
names, as transformers' AutoModelForCausalLM loads it (its `base_model_prefix`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open

from snapfn.snapshot.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
BASE_MODEL_PREFIX = "model."  # transformers' base_model_prefix, every served family's


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: str  # safetensors dtype string: "BF16", "F32", "F8_E4M3", …
    shape: tuple[int, ...]
    stored_name: str = ""  # its name in the shard, where that is not `name`


class Checkpoint:
    """Index of a model folder's tensors; opens shards lazily."""

    def __init__(self, model_dir: Path, tensors: dict[str, TensorInfo]) -> None:
        self.model_dir = model_dir
        self.tensors = tensors

    @classmethod
    def open(cls, model_dir: Path | str) -> Checkpoint:
        model_dir = Path(model_dir)
        weight_map = _read_weight_map(model_dir)
        tensors: dict[str, TensorInfo] = {}
        for file_name in sorted(set(weight_map.values())):
            path = model_dir / file_name
            if not path.is_file():
                raise CheckpointError(
                    f"{model_dir}: shard {file_name} listed in the index is missing"
                )
            tensors.update(_read_header(path, weight_map))
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            raise CheckpointError(
                f"tensors listed in the index but absent from their shard: {_names(missing)}"
            )
        return cls(model_dir, _under_base_model_prefix(tensors))

    @property
    def files(self) -> list[Path]:
        return sorted({t.file for t in self.tensors.values()})

    @property
    def total_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)

    def read(
        self, names: list[str], device: str = "cpu", bounds: dict[str, tuple] | None = None
    ) -> dict[str, torch.Tensor]:
        """Read tensors grouped by shard, one open per shard; a name in `bounds` reads only
        that slice of its tensor (a tensor-parallel rank's part: the rest is never read)."""
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.tensors[name].file, []).append(name)
        out: dict[str, torch.Tensor] = {}
        for path, file_names in by_file.items():
            with safe_open(path, framework="pt", device=device) as f:
                for name in file_names:
                    part = (bounds or {}).get(name)
                    stored = self.tensors[name].stored_name or name
                    out[name] = f.get_tensor(stored) if part is None else f.get_slice(stored)[part]
        return out


def _read_weight_map(model_dir: Path) -> dict[str, str]:
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from exc
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: weight_map is empty or not an object")
        return weight_map
    single = model_dir / SINGLE_FILE
    if single.is_file():
        with safe_open(single, framework="pt") as f:
            return {name: SINGLE_FILE for name in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    raise CheckpointError(f"{model_dir}: no {INDEX_FILE} or {SINGLE_FILE}")


def _under_base_model_prefix(tensors: dict[str, TensorInfo]) -> dict[str, TensorInfo]:
    """A base model's tensors (none under `model.`) under a causal LM's names, as
    AutoModelForCausalLM reads them; its head is then the tied embedding, or missing (which the
    loader's coverage check names)."""
    if any(name.startswith(BASE_MODEL_PREFIX) for name in tensors):
        return tensors
    return {
        BASE_MODEL_PREFIX + name: replace(info, name=BASE_MODEL_PREFIX + name, stored_name=name)
        for name, info in tensors.items()
    }


def _read_header(path: Path, weight_map: dict[str, str]) -> dict[str, TensorInfo]:
    try:
        with safe_open(path, framework="pt") as f:
            infos = {}
            for name in f.keys():  # noqa: SIM118
                if weight_map.get(name) != path.name:
                    continue  # a tensor the index places elsewhere (or omits) is not this shard's
                sl = f.get_slice(name)
                infos[name] = TensorInfo(name, path, sl.get_dtype(), tuple(sl.get_shape()))
            return infos
    except Exception as exc:  # safetensors raises its own SafetensorError for corrupt headers
        raise CheckpointError(f"{path}: unreadable safetensors file ({exc})") from exc


def _names(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" … and {len(names) - limit} more" if len(names) > limit else "")
