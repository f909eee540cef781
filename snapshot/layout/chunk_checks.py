"""Which chunk check a streamer runs, and the host-side checks of chunks against their table.

`verify_mode(verify, device, layout)` resolves a `WeightStreamer(verify=...)` argument to the
mode it runs: "auto" (or True) is "device" on CUDA when the table has `chunk_sum64`, else
"sha256"; "none" (or False) checks nothing; "device" without `chunk_sum64`, or any other
value, is a ValueError. `ChunkChecks` checks chunks read into host memory on a thread pool —
sha256 against `chunk_sha256`, or sum64 against `chunk_sum64` when given the odd weights — and
`failed(index)` is the one-line BadSnapshot that names a chunk which did not match.
"""

from __future__ import annotations

import hashlib
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from snapfn.snapshot.errors import BadSnapshot
from snapfn.snapshot.layout.checksum import Sum64Chunk
from snapfn.snapshot.layout.read_plan import Chunk
from snapfn.snapshot.layout.table import RestoreLayout

VERIFY_MODES = ("auto", "sha256", "device", "none")  # WeightStreamer(verify=...)


def verify_mode(verify: str | bool, device: torch.device, layout: RestoreLayout) -> str:
    """The mode a streamer runs: "sha256", "device" or "none" (see `WeightStreamer`)."""
    if isinstance(verify, bool):
        verify = "auto" if verify else "none"
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify {verify!r} is not one of {VERIFY_MODES} (or a bool)")
    has_sums = layout.chunk_sum64 is not None
    if verify == "auto":
        return "device" if device.type == "cuda" and has_sums else "sha256"
    if verify == "device" and not has_sums:
        raise ValueError(
            "verify='device' needs chunk_sum64 in the restore layout, which this (older) table "
            "lacks; use 'auto' or 'sha256'"
        )
    return verify


def _sha256_of(views: list[memoryview]) -> str:
    digest = hashlib.sha256()
    for view in views:
        digest.update(view)
    return digest.hexdigest()


def _sum64_of(views: list[memoryview], weights: torch.Tensor) -> int:
    digest = Sum64Chunk(weights)
    for view in views:
        digest.update(view)
    return digest.finish()


@dataclass(frozen=True)
class ChunkChecks:
    """Checks the chunks of the file at `path` against `layout`, in `mode` (a `verify_mode`)."""

    path: Path
    layout: RestoreLayout
    mode: str  # "sha256", "device" or "none"

    def failed(self, index: int) -> BadSnapshot:
        """The error for chunk `index` failing its check."""
        lo = index * self.layout.chunk_bytes
        hi = min(lo + self.layout.chunk_bytes, self.layout.file_bytes)
        check = "sum64" if self.mode == "device" else "sha256"
        return BadSnapshot(
            f"{self.path}: chunk {index} (file bytes {lo}..{hi}) failed its {check} check; "
            "the restored tensors must not be used"
        )

    def verify(self, chunk: Chunk, views: list[memoryview], weights: torch.Tensor | None) -> float:
        """Check one chunk on the host: sha256, or sum64 when `weights` are given; seconds."""
        start = time.perf_counter()
        if weights is None:
            ok = _sha256_of(views) == self.layout.chunk_sha256[chunk.index]
        else:
            ok = _sum64_of(views, weights) == (self.layout.chunk_sum64 or [])[chunk.index]
        if not ok:
            raise self.failed(chunk.index)
        return time.perf_counter() - start

    def submit(
        self,
        pool: ThreadPoolExecutor,
        chunks: tuple[Chunk, ...],
        views: list[list[memoryview]],
        weights: torch.Tensor | None,
    ) -> list[Future]:
        """`verify` each chunk (its views in `views`) on `pool`; nothing in mode "none"."""
        if self.mode == "none":
            return []
        return [pool.submit(self.verify, c, v, weights) for c, v in zip(chunks, views, strict=True)]
