"""snapshot/cuda/span.py on CPU: pieces mapped at a bump pointer, runs planned over them, the
memory given back and mapped again at the same addresses (CUDA: tests/test_function_gpu.py)."""

from __future__ import annotations

import pytest

from snapfn.snapshot.cuda.regions import ALIGN
from snapfn.snapshot.cuda.span import Run, Span, plan_runs
from snapfn.snapshot.errors import RestoreFailed

MiB = 1 << 20


@pytest.fixture
def span():
    return Span.reserve("cpu", 64 * MiB)


def test_pieces_are_handed_out_in_order_and_their_addresses_never_again(span):
    a = span.map_segment(1)
    b = span.map_segment(3 * MiB)
    assert (a, b) == (span.base, span.base + ALIGN)  # rounded up to the 2 MiB granularity
    assert span.segments() == [(a, ALIGN), (b, 2 * ALIGN)]
    span.unmap_segment(a)
    c = span.map_segment(ALIGN)
    assert c == b + 2 * ALIGN and span.segments() == [(b, 2 * ALIGN), (c, ALIGN)]


def test_a_full_reservation_hands_out_none(span):
    assert span.map_segment(60 * MiB) is not None
    assert span.map_segment(8 * MiB) is None
    assert span.map_segment(4 * MiB) is not None  # what is left still fits


def test_release_drops_every_page_and_runs_map_them_back_at_the_same_addresses(span):
    a, b = span.map_segment(ALIGN), span.map_segment(ALIGN)
    span.view(a, ALIGN).fill_(7)
    span.view(b, ALIGN).fill_(9)
    assert span.resident_bytes() == 2 * ALIGN
    assert span.release() == 2 * ALIGN
    assert span.resident_bytes() == 0
    span.map_runs([Run(a, 2 * ALIGN)])
    assert int(span.view(a, 2 * ALIGN).sum()) == 0  # CPU pages come back as zeros
    span.view(b, 16).fill_(1)
    assert span.resident_bytes() > 0


def test_a_run_is_unmapped_only_once_all_its_pieces_are(span):
    a, b = span.map_segment(ALIGN), span.map_segment(ALIGN)
    span.release()
    span.map_runs([Run(a, 2 * ALIGN)])
    span.view(a, 2 * ALIGN).fill_(3)
    span.unmap_segment(a)
    assert span.resident_bytes() == 2 * ALIGN  # b still lives in the run's one mapping
    span.unmap_segment(b)
    assert span.resident_bytes() == 0 and span.segments() == []


def test_runs_that_do_not_match_the_pieces_are_refused(span):
    a = span.map_segment(ALIGN)
    span.release()
    with pytest.raises(RestoreFailed, match="no run"):
        span.map_runs([Run(a + ALIGN, ALIGN)])
    with pytest.raises(RestoreFailed, match="adopts no memory"):
        span.adopt_runs([Run(a, ALIGN)], {a: _devnull()})


def test_plan_runs_joins_touching_pieces_then_the_closest_runs():
    pieces = [(0, 2), (2, 2), (10, 2), (13, 1), (30, 2)]
    assert plan_runs(pieces) == [Run(0, 4), Run(10, 2), Run(13, 1), Run(30, 2)]
    assert plan_runs(pieces, max_runs=3) == [Run(0, 4), Run(10, 4), Run(30, 2)]
    assert plan_runs(pieces, max_runs=1) == [Run(0, 32)]


def _devnull() -> int:
    import os

    return os.open(os.devnull, os.O_RDONLY)
