"""Restore-layout test data shared by the tests of the layout table, its writer, checksum, streamer and
bandwidth: a mix of dtypes and shapes small enough that tensors span chunks and chunks hold
several tensors, bitwise comparison and byte-flipping helpers, and a Python-int sum64."""

from __future__ import annotations

import random

import pytest
import torch

from snapfn.snapshot.layout.table import RestoreLayout
from snapfn.snapshot.layout.writer import write_restore_layout

ALIGN, CHUNK = 512, 4096  # small, so tensors span chunks and chunks hold several tensors

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (none here)"
)


def mixed_tensors(device: str = "cpu") -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    tensors = [
        ("fp32", torch.randn(33, 17, generator=g)),  # 2244 bytes
        ("bf16", torch.randn(3000, generator=g).bfloat16()),  # 6000 bytes: spans 2+ chunks
        ("fp8", torch.randn(64, 9, generator=g).to(torch.float8_e4m3fn)),
        ("int64", torch.randint(-(2**40), 2**40, (700,), generator=g)),
        ("scalar", torch.tensor(2.5, dtype=torch.float64)),  # 0-d
        ("empty", torch.empty(0, 7)),
        ("flags", torch.rand(13, generator=g) > 0.5),
        ("fp16_tail", torch.randn(5, generator=g).half()),
    ]
    return [(name, t.to(device)) for name, t in tensors]


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().reshape(-1).view(torch.uint8)


def assert_bitwise_equal(expected: list[tuple[str, torch.Tensor]], got: dict) -> None:
    assert sorted(got) == sorted(name for name, _ in expected)
    for name, t in expected:
        assert (got[name].dtype, got[name].shape) == (t.dtype, t.shape), name
        assert torch.equal(raw(got[name]), raw(t)), name


def empty_like_table(layout: RestoreLayout, device: str = "cpu") -> dict[str, torch.Tensor]:
    return {
        name: torch.empty(e.shape, dtype=getattr(torch, e.dtype), device=device)
        for name, e in layout.tensors.items()
    }


def flip_byte(path, pos: int) -> None:
    with open(path, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)
        f.seek(pos)
        f.write(bytes([byte[0] ^ 0xFF]))


def reference_sum64(data: bytes) -> int:
    """sum64 with Python ints: Σ w[i]·(2i+1) mod 2^64 over zero-padded little-endian words."""
    data = data + bytes(-len(data) % 8)
    words = [int.from_bytes(data[i : i + 8], "little", signed=True) for i in range(0, len(data), 8)]
    total = sum(w * (2 * i + 1) for i, w in enumerate(words)) % 2**64
    return total - 2**64 if total >= 2**63 else total


def random_words(n: int, seed: int) -> list[int]:
    """int64 values, half of them at or near the extremes so that products and sums overflow."""
    rng = random.Random(seed)
    extremes = [2**63 - 1, -(2**63), -1, 2**62 + 12345, -(2**62) - 3]
    return [
        rng.choice(extremes) if rng.random() < 0.5 else rng.randrange(-(2**63), 2**63)
        for _ in range(n)
    ]


def write_mixed(tmp_path):
    """`mixed_tensors()` written as one restore-layout file: (path, layout, tensors)."""
    tensors = mixed_tensors()
    path = tmp_path / "rank0.weights"
    layout = write_restore_layout(path, tensors, align=ALIGN, chunk_bytes=CHUNK)
    return path, layout, tensors
