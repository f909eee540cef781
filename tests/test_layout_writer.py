"""Writing restore-layout files: aligned offsets with zero gaps, digests and sum64s that cover
the file, refusals that leave nothing behind."""

from __future__ import annotations

import hashlib

import pytest
import torch

from snapfn.snapshot.layout.writer import write_restore_layout

from layout_files import ALIGN, CHUNK, mixed_tensors, raw, reference_sum64, write_mixed


@pytest.fixture
def written(tmp_path):
    return write_mixed(tmp_path)


def test_offsets_aligned_and_gaps_zero(written):
    path, layout, tensors = written
    data = path.read_bytes()
    assert len(data) == layout.file_bytes
    covered = bytearray(len(data))
    for name, t in tensors:
        e = layout.tensors[name]
        assert e.offset % ALIGN == 0, name
        assert data[e.offset : e.offset + e.nbytes] == raw(t).numpy().tobytes(), name
        covered[e.offset : e.offset + e.nbytes] = b"\1" * e.nbytes
    assert all(b == 0 for b, c in zip(data, covered, strict=True) if not c)


def test_digests_cover_the_file(written):
    path, layout, _ = written
    data = path.read_bytes()
    chunks = [data[i : i + CHUNK] for i in range(0, len(data), CHUNK)]
    assert layout.chunk_sha256 == [hashlib.sha256(c).hexdigest() for c in chunks]
    assert layout.file_sha256 == hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("align,chunk_bytes", [(ALIGN, CHUNK), (1, 4099), (2, 1000)])
def test_chunk_sums_cover_the_file(tmp_path, align, chunk_bytes):
    # align 1 and 2 put tensors at odd offsets, so words straddle the writer's pieces
    path = tmp_path / "w"
    layout = write_restore_layout(path, mixed_tensors(), align=align, chunk_bytes=chunk_bytes)
    data = path.read_bytes()
    chunks = [data[i : i + chunk_bytes] for i in range(0, len(data), chunk_bytes)]
    assert layout.chunk_sum64 == [reference_sum64(c) for c in chunks]
    assert len(chunks) == layout.num_chunks > 1


def test_test_data_spans_and_shares_chunks(written):
    _, layout, _ = written
    spans = [
        (e.offset // CHUNK, (e.offset + e.nbytes - 1) // CHUNK)
        for e in layout.tensors.values()
        if e.nbytes
    ]
    assert any(first != last for first, last in spans)  # a tensor across chunk boundaries
    firsts = [first for first, _ in spans]
    assert len(set(firsts)) < len(firsts)  # a chunk holding several tensors


def test_write_refuses_duplicates_and_leaves_nothing(tmp_path):
    with pytest.raises(ValueError, match="'a'"):
        write_restore_layout(tmp_path / "w", [("a", torch.ones(2)), ("a", torch.ones(2))])
    with pytest.raises(ValueError, match="complex64"):
        write_restore_layout(tmp_path / "w", [("c", torch.ones(2, dtype=torch.complex64))])
    assert list(tmp_path.iterdir()) == []
