"""Shared by the device probes: a callable timed as one CUDA graph of many calls, the way the
engine replays its decode steps (no launch overhead between kernels)."""

from __future__ import annotations

import torch


def graph_us(fn, calls: int, cycle: int | None = None) -> float:
    """Microseconds per call of `fn(i % cycle)` for i = 0 .. calls-1 (`cycle`: how many distinct
    inputs `fn` takes, e.g. copies of a weight kept out of L2; default `calls`), captured once
    and replayed: the best of five replays."""
    cycle = cycle or calls
    for i in range(cycle):  # compile and tune outside the capture
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i % cycle)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / calls)
    return best
