"""The CUDA path's copies, queued on the streamer's copy stream with no host sync per chunk.

`enqueue_copies` queues pinned slot → tensor copies of one unit's tensor pieces (padding
skipped) and returns the event after which the slot may be refilled. `StagedCopies` is the
"device" check: per unit, pinned slot → device staging slot, each chunk's sum64 into a device
vector, staging → tensors; `first_mismatch` then compares the vector with the table's sums
once, the one host sync. `Ship` is what the streamer's ring pump calls per unit:
`StagedCopies.ship`, or the streamer's direct ship built on `enqueue_copies`.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

import torch

from snapfn.snapshot.layout.checksum import sum64_bytes
from snapfn.snapshot.layout.read_plan import Unit
from snapfn.snapshot.layout.table import RestoreLayout

# (unit, ring slot index, pinned slot, its bytes) → (event after which the pinned slot may be
# refilled, host checks that must pass first)
Ship = Callable[[Unit, int, torch.Tensor, memoryview], tuple[torch.cuda.Event, list[Future]]]


class StagedCopies:
    """The "device" check on CUDA, queued on one copy stream with no host sync per chunk.

    Per ring slot: pinned slot → staging slot (H2D), each chunk's sum64 → `sums[chunk]`,
    staging → tensors (D2D, padding skipped). `first_mismatch` then compares `sums` with the
    table's once, at the end.
    """

    def __init__(
        self,
        layout: RestoreLayout,
        ring: list[tuple[torch.Tensor, memoryview]],
        weights: torch.Tensor,
        dest: dict[str, torch.Tensor],
        stream: torch.cuda.Stream,
    ) -> None:
        device = weights.device
        self._weights, self._dest, self._stream = weights, dest, stream
        self._staging = [  # the device twin of the pinned ring
            torch.empty(slot.numel(), dtype=torch.uint8, device=device) for slot, _ in ring
        ]
        self._scratch = torch.empty_like(weights)  # [chunk words] products
        self._sums = torch.zeros(layout.num_chunks, dtype=torch.int64, device=device)
        self._expected = torch.tensor(layout.chunk_sum64, dtype=torch.int64, device=device)

    def ship(
        self, unit: Unit, k: int, pinned: torch.Tensor, view: memoryview
    ) -> tuple[torch.cuda.Event, list[Future]]:
        num_bytes, staging = unit.file_hi - unit.file_lo, self._staging[k]
        # NOTE: one stream runs everything in order: staging slot k's previous sums and D2D
        # copies were queued before this H2D copy overwrites it, so it needs no event of its own
        with torch.cuda.stream(self._stream):
            staging[:num_bytes].copy_(pinned[:num_bytes], non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self._stream)  # the pinned slot may be refilled once this has passed
            for c in unit.chunks:
                chunk = staging[c.file_lo - unit.file_lo : c.file_hi - unit.file_lo]
                sum64_bytes(chunk, self._weights, scratch=self._scratch, out=self._sums[c.index])
            _copy_pieces(unit, staging, self._dest)
        return copied, []

    def first_mismatch(self) -> int | None:
        """The first chunk whose sum64 is not the table's; the one host sync of the stream."""
        with torch.cuda.stream(self._stream):
            mismatch = (self._sums != self._expected).tolist()  # waits for all queued work
        return mismatch.index(True) if True in mismatch else None


def _copy_pieces(unit: Unit, src: torch.Tensor, dest: dict[str, torch.Tensor]) -> None:
    """Queue copies of the unit's tensor pieces from `src` (the unit's bytes); padding skipped."""
    for p in unit.copies:
        piece = src[p.file_lo - unit.file_lo : p.file_hi - unit.file_lo]
        dest[p.name][p.tensor_lo : p.tensor_lo + piece.numel()].copy_(piece, non_blocking=True)


def enqueue_copies(
    unit: Unit, slot: torch.Tensor, dest: dict[str, torch.Tensor], stream: torch.cuda.Stream
) -> torch.cuda.Event:
    """Queue host slot → device copies of the unit's tensor pieces; padding is skipped."""
    with torch.cuda.stream(stream):
        _copy_pieces(unit, slot, dest)
        copied = torch.cuda.Event()
        copied.record(stream)
    return copied
