"""How a streamer reads a restore-layout file: the read plan and the byte views reads fill.

The file is cut into chunks (the table's digest units) and consecutive chunks are grouped into
units of at most `unit_bytes` (one `preadv` each; on CUDA, one ring slot). A chunk lists its
pieces — file bytes that land at an offset of one tensor, or padding (`name` None) — covering
it exactly and in order; a unit lists its tensor copies, a tensor's consecutive pieces merged
across chunk boundaries. `host_bytes` / `device_bytes`, `piece_view` and `slot_views` are the
views the reads (`preads.preadv_exact`) and copies target. No threads, no CUDA calls.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from snapfn.snapshot.layout.table import RestoreLayout


@dataclass(frozen=True)
class Piece:
    """File bytes [file_lo, file_hi) that land at byte `tensor_lo` of `name` (None: padding)."""

    file_lo: int
    file_hi: int
    name: str | None
    tensor_lo: int


@dataclass(frozen=True)
class Chunk:
    """Chunk `index` of the table: file bytes [file_lo, file_hi), covered by `pieces`."""

    index: int
    file_lo: int
    file_hi: int
    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class Unit:
    """Consecutive chunks read by one `preadv` (CUDA: into one ring slot)."""

    file_lo: int
    file_hi: int
    chunks: tuple[Chunk, ...]
    copies: tuple[Piece, ...]  # tensor pieces, merged across the unit's chunk boundaries


def _file_spans(layout: RestoreLayout) -> list[Piece]:
    """Tensor and padding pieces covering the whole file, in order."""
    spans, pos = [], 0
    for name, e in sorted(layout.tensors.items(), key=lambda kv: kv[1].offset):
        if e.nbytes == 0:
            continue
        if e.offset > pos:
            spans.append(Piece(pos, e.offset, None, 0))
        spans.append(Piece(e.offset, e.offset + e.nbytes, name, 0))
        pos = e.offset + e.nbytes
    if pos < layout.file_bytes:
        spans.append(Piece(pos, layout.file_bytes, None, 0))
    return spans


def _cut(span: Piece, lo: int, hi: int) -> Piece:
    a, b = max(span.file_lo, lo), min(span.file_hi, hi)
    return Piece(a, b, span.name, span.tensor_lo + a - span.file_lo)


def _plan_chunks(layout: RestoreLayout) -> list[Chunk]:
    spans, k, chunks = _file_spans(layout), 0, []
    for index in range(layout.num_chunks):
        lo = index * layout.chunk_bytes
        hi = min(lo + layout.chunk_bytes, layout.file_bytes)
        pieces = []
        while k < len(spans) and spans[k].file_lo < hi:
            pieces.append(_cut(spans[k], lo, hi))
            if spans[k].file_hi > hi:
                break
            k += 1
        chunks.append(Chunk(index, lo, hi, tuple(pieces)))
    return chunks


def _merge_copies(chunks: tuple[Chunk, ...]) -> tuple[Piece, ...]:
    """The chunks' tensor pieces, a tensor's consecutive pieces joined into one copy."""
    copies: list[Piece] = []
    for p in (p for c in chunks for p in c.pieces if p.name is not None):
        prev = copies[-1] if copies else None
        if prev and prev.name == p.name and prev.file_hi == p.file_lo:
            copies[-1] = Piece(prev.file_lo, p.file_hi, p.name, prev.tensor_lo)
        else:
            copies.append(p)
    return tuple(copies)


def plan_units(layout: RestoreLayout, unit_bytes: int) -> list[Unit]:
    """The whole file as units of whole chunks, up to `unit_bytes` each (at least one chunk)."""
    per_unit = max(1, unit_bytes // layout.chunk_bytes)
    chunks = _plan_chunks(layout)
    groups = [tuple(chunks[i : i + per_unit]) for i in range(0, len(chunks), per_unit)]
    return [Unit(g[0].file_lo, g[-1].file_hi, g, _merge_copies(g)) for g in groups]


def host_bytes(dest: Mapping[str, torch.Tensor]) -> dict[str, memoryview]:
    """Writable byte views of CPU tensors' memory (zero-copy)."""
    flat = {n: t.detach().reshape(-1).view(torch.uint8) for n, t in dest.items() if t.numel()}
    return {n: memoryview(t.numpy()) for n, t in flat.items()}


def device_bytes(dest: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Flat uint8 views of tensors on any device (empty tensors left out)."""
    return {n: t.detach().reshape(-1).view(torch.uint8) for n, t in dest.items() if t.numel()}


def piece_view(piece: Piece, dest: dict[str, memoryview]) -> memoryview:
    """Where a piece is read to: its bytes of `dest` (`host_bytes`), or scratch for padding."""
    n = piece.file_hi - piece.file_lo
    if piece.name is None:
        return memoryview(bytearray(n))  # padding: read only to be hashed
    return dest[piece.name][piece.tensor_lo : piece.tensor_lo + n]


def slot_views(unit: Unit, slot: memoryview) -> list[list[memoryview]]:
    """Each of the unit's chunks as one view of `slot`, which holds the unit's bytes."""
    return [[slot[c.file_lo - unit.file_lo : c.file_hi - unit.file_lo]] for c in unit.chunks]
