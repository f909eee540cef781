"""Streaming safetensors writer: shards planned up front from shapes, tensors written one by one.

File format (safetensors): 8-byte little-endian header length N, then N bytes of JSON
`{"__metadata__": {"format": "pt"}, name: {"dtype", "shape", "data_offsets": [begin, end]}}`
padded with spaces to a multiple of 8, then the data region (offsets relative to its start, no
gaps). Within a shard the layout puts wider dtypes first, so every tensor starts aligned to its
element size. Tensors may arrive in any order (each goes to its planned offset with
`os.pwrite`), so an fp8 weight can be written before its float32 scale without holding either.
Only one tensor's bytes are ever in memory.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from snapfn.handler.llm.make_model.hf_layout import DTYPE_BYTES, TensorEntry

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 4 << 30
MAX_WRITE_BYTES = 1 << 30  # Linux write(2) moves at most ~2 GiB per call


@dataclass(frozen=True)
class ShardPlan:
    """One shard file: its units (tensors that travel together) in writing order."""

    file_name: str
    units: tuple[tuple[TensorEntry, ...], ...]

    @property
    def layout(self) -> list[TensorEntry]:
        """Entries in file order: widest dtype first, writing order within a dtype."""
        entries = [entry for unit in self.units for entry in unit]
        return sorted(entries, key=lambda e: -DTYPE_BYTES[e.dtype])

    @property
    def nbytes(self) -> int:
        return sum(entry.nbytes for unit in self.units for entry in unit)


def plan_shards(units: list[tuple[TensorEntry, ...]], max_shard_bytes: int) -> list[ShardPlan]:
    """Cut `units` into shards of at most `max_shard_bytes` (a unit larger than that gets its
    own shard), named like `save_pretrained` names them."""
    groups: list[list[tuple[TensorEntry, ...]]] = [[]]
    size = 0
    for unit in units:
        unit_bytes = sum(entry.nbytes for entry in unit)
        if groups[-1] and size + unit_bytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(unit)
        size += unit_bytes
    if len(groups) == 1:
        return [ShardPlan(SINGLE_FILE, tuple(groups[0]))]
    n = len(groups)
    return [
        ShardPlan(f"model-{i + 1:05d}-of-{n:05d}.safetensors", tuple(group))
        for i, group in enumerate(groups)
    ]


def index_json(shards: list[ShardPlan]) -> dict[str, Any]:
    """`model.safetensors.index.json` for multi-shard checkpoints (names sorted, like HF)."""
    entries = {e.name: (e, shard.file_name) for shard in shards for e in shard.layout}
    return {
        "metadata": {
            "total_parameters": sum(e.nbytes // DTYPE_BYTES[e.dtype] for e, _ in entries.values()),
            "total_size": sum(e.nbytes for e, _ in entries.values()),
        },
        "weight_map": {name: entries[name][1] for name in sorted(entries)},
    }


def encode_header(entries: list[TensorEntry]) -> tuple[bytes, dict[str, int]]:
    """(length prefix + padded JSON header, data offset of each tensor)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offsets, pos = {}, 0
    for entry in entries:
        header[entry.name] = {
            "dtype": entry.dtype,
            "shape": list(entry.shape),
            "data_offsets": [pos, pos + entry.nbytes],
        }
        offsets[entry.name] = pos
        pos += entry.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, offsets


class ShardWriter:
    """Writes one shard: header at open, each tensor's bytes at its planned offset."""

    def __init__(self, path: Path, entries: list[TensorEntry]) -> None:
        header, offsets = encode_header(entries)
        self.path = path
        self._sizes = {entry.name: entry.nbytes for entry in entries}
        self._offsets = {name: len(header) + offset for name, offset in offsets.items()}
        self._pending = set(self._sizes)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(self._fd, len(header) + sum(self._sizes.values()))
        _pwrite_all(self._fd, memoryview(header), 0)

    def write(self, name: str, data: memoryview) -> int:
        """Write tensor `name`'s raw little-endian bytes; returns the byte count."""
        view = memoryview(data).cast("B")
        if name not in self._pending:
            raise ValueError(f"{self.path.name}: {name} is not planned here or was already written")
        if view.nbytes != self._sizes[name]:
            raise ValueError(f"{name}: got {view.nbytes} bytes, planned {self._sizes[name]}")
        _pwrite_all(self._fd, view, self._offsets[name])
        self._pending.discard(name)
        return view.nbytes

    def close(self) -> None:
        os.close(self._fd)
        if self._pending:
            raise ValueError(f"{self.path.name}: never written: {sorted(self._pending)[:8]}")

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is None:
            self.close()
        else:
            os.close(self._fd)  # the caller's error wins; the file is in a staging dir


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < view.nbytes:
        done += os.pwrite(fd, view[done : done + MAX_WRITE_BYTES], offset + done)
