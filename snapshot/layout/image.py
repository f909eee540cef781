"""A span's memory as a restore layout: what a process snapshot keeps of a function's device pool.

    image = save_image(span, live, zeroed, path)   runs planned over the span's pieces; every byte
                                                   outside a live block, and every `zeroed` range,
                                                   set to zero; then the pieces (and the gaps a
                                                   run spans) written in address order, so that
                                                   each run is an image of one range of the file
    span.release()                                 (the caller's) the memory given back
    report = load_image(span, image, path)         the runs mapped again, the file streamed into
                                                   them, every chunk verified
    check_image(span, image)                       runs a restorer mapped and filled (snapshot/
                                                   keeper/region_prefetch.py), checked against the
                                                   chunk sums; the index of a bad chunk, or None
    image.region_specs(path)                       what a restorer makes and fills beside criu

The layout's tensors are uint8, one per piece or gap, named by their address in hex; chunks are
`CHUNK_BYTES` (2 MiB) so that no chunk straddles two runs (runs are whole pieces, and pieces are
multiples of the mapping granularity), which lets each run be checked alone.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from snapfn.snapshot.cuda.regions import ALIGN
from snapfn.snapshot.cuda.span import Run, Span, plan_runs
from snapfn.snapshot.errors import BadSnapshot, one_line
from snapfn.snapshot.layout.checksum import first_bad_chunk
from snapfn.snapshot.layout.streamer import StreamReport, WeightStreamer
from snapfn.snapshot.layout.table import RestoreLayout
from snapfn.snapshot.layout.writer import write_restore_layout

CHUNK_BYTES = ALIGN  # one chunk per 2 MiB: a chunk never straddles two runs
MAX_RUNS = 4096  # what an image read back may hold (save_image plans 128 by default)


@dataclass(frozen=True)
class PoolImage:
    """The runs of a released span and the restore layout their bytes were written as."""

    runs: tuple[Run, ...]
    layout: RestoreLayout

    def file_offset(self, run: Run) -> int:
        return self.layout.tensors[_name(run.address)].offset

    def dest(self, span: Span) -> dict[str, torch.Tensor]:
        """The layout's tensors as views of the span's (mapped) runs."""
        return {
            name: span.view(int(name, 16), entry.nbytes)
            for name, entry in self.layout.tensors.items()
        }

    def region_specs(self, path: str, device_index: int) -> list[dict[str, Any]]:
        """Each run as a region a restorer makes and fills from `path` (relative to the
        snapshot) beside criu."""
        from snapfn.snapshot.keeper.region_prefetch import RegionSpec

        return [
            RegionSpec(
                f"run{i}",
                run.address,
                run.nbytes,
                device_index,
                "file",
                path,
                self.file_offset(run),
            ).to_json()
            for i, run in enumerate(self.runs)
        ]

    def to_json(self) -> dict[str, Any]:
        return {
            "runs": [[r.address, r.nbytes] for r in self.runs],
            "layout": json.loads(self.layout.to_json()),
        }

    @classmethod
    def from_json(cls, doc: Any) -> PoolImage:
        """BadSnapshot, one line, for anything that is not a pool image: at most `MAX_RUNS`
        runs, each [address, nbytes] exact positive integers below 2^64."""
        try:
            runs = tuple(_parse_run(pair) for pair in doc["runs"])
            if len(runs) > MAX_RUNS:
                raise ValueError(f"{len(runs)} runs, more than {MAX_RUNS}")
            if not isinstance(doc["layout"], dict):
                raise TypeError("its layout is not a JSON object")
            layout = RestoreLayout.from_json(json.dumps(doc["layout"]))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise BadSnapshot(one_line(f"the device memory image is unreadable: {exc}")) from None
        image = cls(runs, layout)
        image.check()
        return image

    def check(self) -> None:
        """The runs and the layout agree: runs in address order, not overlapping, each starts
        an entry, and its bytes are one contiguous range of the file in whole chunks."""
        for before, run in zip(self.runs, self.runs[1:], strict=False):
            if run.address < before.address + before.nbytes:
                raise BadSnapshot(f"run at {run.address:#x} overlaps or precedes the one before")
        for run in self.runs:
            entry = self.layout.tensors.get(_name(run.address))
            if entry is None or run.nbytes % CHUNK_BYTES or entry.offset % CHUNK_BYTES:
                raise BadSnapshot(f"run at {run.address:#x} is not in the memory image's table")
            if entry.offset + run.nbytes > self.layout.file_bytes:
                raise BadSnapshot(f"run at {run.address:#x} runs past the memory image's end")
        if self.layout.chunk_bytes != CHUNK_BYTES:
            raise BadSnapshot(f"the memory image's chunks are {self.layout.chunk_bytes} bytes")


def save_image(
    span: Span,
    live: Sequence[tuple[int, int]],
    zeroed: Sequence[tuple[int, int]],
    path: Path,
    max_runs: int = 128,
) -> PoolImage:
    """Write the span's mapped pieces to `path` (the caller releases the span after)."""
    pieces = span.segments()
    if not pieces:
        raise ValueError("the span holds no memory to save")
    runs = plan_runs(pieces, max_runs)
    _zero_all_but(span, pieces, live, zeroed)
    path.parent.mkdir(parents=True, exist_ok=True)
    layout = write_restore_layout(
        path, _run_tensors(span, runs, pieces), align=ALIGN, chunk_bytes=CHUNK_BYTES
    )
    image = PoolImage(tuple(runs), layout)
    image.check()
    return image


def load_image(span: Span, image: PoolImage, path: Path, **streamer: Any) -> StreamReport:
    """Map the image's runs at their addresses and stream `path` into them, verified
    (BadSnapshot when a chunk does not match: the span's contents must then be discarded)."""
    span.map_runs(image.runs)
    with WeightStreamer(path, image.layout, device=span.device, **streamer) as reader:
        return reader.stream_into(image.dest(span))


def check_image(span: Span, image: PoolImage) -> int | None:
    """The first chunk (of the file) whose bytes in the mapped runs do not match its sum64, or
    None; ValueError when the layout has no sums to check with."""
    sums = image.layout.chunk_sum64
    if sums is None:
        raise ValueError("the memory image's layout has no sum64 table")
    for run in image.runs:
        lo = image.file_offset(run) // CHUNK_BYTES
        expected = sums[lo : lo + run.nbytes // CHUNK_BYTES]
        bad = first_bad_chunk(span.view(run.address, run.nbytes), CHUNK_BYTES, expected)
        if bad is not None:
            return lo + bad
    return None


def _name(address: int) -> str:
    return f"{address:x}"


def _parse_run(pair: Any) -> Run:
    if not isinstance(pair, list) or len(pair) != 2:
        raise TypeError(f"a run is [address, nbytes], not {pair!r}")
    address, nbytes = pair
    for value in pair:
        if type(value) is not int or not 0 < value < 1 << 64:
            raise ValueError(f"run {pair!r}: not a positive 64-bit address and size")
    return Run(address, nbytes)


def _zero_all_but(
    span: Span,
    pieces: Sequence[tuple[int, int]],
    live: Sequence[tuple[int, int]],
    zeroed: Sequence[tuple[int, int]],
) -> None:
    """Zero each piece's bytes outside `live` blocks, and the `zeroed` ranges inside pieces."""
    for address, nbytes in pieces:
        end = address + nbytes
        keep = _clip(live, address, end)
        for lo, hi in _gaps(keep, address, end) + _clip(zeroed, address, end):
            span.view(lo, hi - lo).zero_()
    if span.device.type == "cuda":
        torch.cuda.synchronize(span.device)


def _clip(ranges: Sequence[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """(address, nbytes) ranges cut to [lo, hi), as sorted [start, end) pairs."""
    cut = [(max(a, lo), min(a + n, hi)) for a, n in ranges]
    return sorted((a, b) for a, b in cut if a < b)


def _gaps(kept: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    gaps, pos = [], lo
    for a, b in kept:
        if a > pos:
            gaps.append((pos, a))
        pos = max(pos, b)
    if pos < hi:
        gaps.append((pos, hi))
    return gaps


def _run_tensors(span: Span, runs: Sequence[Run], pieces: Sequence[tuple[int, int]]):
    """(name, tensor) per piece and per gap inside a run, in address order."""
    mapped = dict(pieces)
    for run in runs:
        address = run.address
        while address < run.end:
            nbytes = mapped.get(address)
            if nbytes is not None:
                yield _name(address), span.view(address, nbytes)
            else:  # a gap the run spans: the next piece's start, or the run's end
                nbytes = min([a for a in mapped if address < a < run.end] + [run.end]) - address
                yield _name(address), torch.zeros(nbytes, dtype=torch.uint8)
            address += nbytes
