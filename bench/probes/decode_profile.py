"""Where a decode step's time goes (device probe): torch.profiler over eager decode steps, by
kernel, for one backend — what to fuse or replace to approach the roofline.

python3 bench/probes/decode_profile.py MODEL_DIR [--backend torch|triton] [--batch 1]
    [--steps 16] [--device cuda] [--graphs]

Prints one JSON object: the backend, the batch, device time per decode step, and the top
kernels by their own device time per step (name, calls per step, microseconds per step).
Eager, not graph-replayed (the prefill's kernels, profiled alone, subtracted): the kernels are
the same as in the captured graphs, launch overhead is not in the device times. `--graphs` adds, with the batch's decode graph captured: the graph's
replay alone back to back (`graph_replay_ms`: the GPU's time per step) and whole engine steps
(`graph_step_ms`: the same plus what the host adds between replays — batch building, input
copies, planning, sampling).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from snapfn.handler.llm.build import EngineOptions, build_engine
from snapfn.handler.llm.engine.engine import SchedulerConfig
from snapfn.handler.llm.engine.request import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model")
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--graphs", action="store_true")
    args = parser.parse_args()
    opts = EngineOptions(
        device=args.device,
        backend=args.backend,
        num_pages=4096,
        scheduler=SchedulerConfig(page_size=16, max_num_batched_tokens=2048),
    )
    engine = build_engine(args.model, opts).engine
    span = min(1000, engine.model.config.vocab_size - 1)  # ids 1..span: any vocabulary's own
    prompts = [[(977 * i + 13 * b) % span + 1 for i in range(200)] for b in range(args.batch)]
    one = SamplingParams(max_new_tokens=1, ignore_eos=True)
    many = SamplingParams(max_new_tokens=args.steps + 1, ignore_eos=True)
    engine.generate(prompts, many)  # warm: shapes, kernels compiled
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    sync()
    t0 = time.perf_counter()
    engine.generate(prompts, one)  # the prefill alone, to subtract
    sync()
    prefill_s = time.perf_counter() - t0
    on_device = args.device.startswith("cuda")
    timed_run = {}

    def run_many():
        t0 = time.perf_counter()
        engine.generate(prompts, many)
        sync()
        timed_run["wall_s"] = time.perf_counter() - t0

    # the decode steps' kernels: the whole generation's less the prefill's alone, kernel by kernel
    decode = _kernel_times(run_many, on_device)
    for key, (us, count) in _kernel_times(lambda: engine.generate(prompts, one), on_device).items():
        left = decode.get(key, (0.0, 0))
        decode[key] = (left[0] - us, left[1] - count)
    rows = sorted(((us, n, key) for key, (us, n) in decode.items() if us > 0), reverse=True)
    wall_s = timed_run["wall_s"]
    steps = args.steps
    graph_figures = {}
    if args.graphs:
        graph_figures = _graph_times(engine, prompts, one, many, steps, args.batch)
    print(
        json.dumps(
            {
                **graph_figures,
                "backend": args.backend,
                "batch": args.batch,
                "device": args.device,
                "ms_per_step_wall": round((wall_s - prefill_s) / steps * 1e3, 3),
                "prefill_ms": round(prefill_s * 1e3, 3),
                "device_ms_per_step": round(sum(r[0] for r in rows) / steps / 1e3, 3),
                "top": [
                    {
                        "kernel": key[:120],
                        "calls_per_step": round(n / steps, 1),
                        "us": round(us / steps, 1),
                    }
                    for us, n, key in rows[: args.top]
                ],
            }
        )
    )


def _kernel_times(fn, on_device: bool) -> dict[str, tuple[float, int]]:
    """Own device time (us) and calls per kernel while `fn` runs (CPU time without a GPU)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if on_device:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        fn()
    times = {}
    for event in prof.key_averages():
        own_us = event.self_device_time_total if on_device else event.self_cpu_time_total
        if own_us > 0 and (not on_device or event.device_type.name == "CUDA"):
            times[event.key] = (own_us, event.count)
    return times


def _graph_times(engine, prompts, one, many, steps: int, batch: int) -> dict:
    engine.capture_graphs([batch], max_seq_len=512)
    engine.generate(prompts, many)  # warm through the graph
    torch.cuda.synchronize()
    graph = engine.graphs._graphs[batch]
    t0 = time.perf_counter()
    for _ in range(100):
        graph.replay()
    torch.cuda.synchronize()
    replay_ms = (time.perf_counter() - t0) / 100 * 1e3
    timings = []
    for params in (one, many):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.generate(prompts, params)
        torch.cuda.synchronize()
        timings.append(time.perf_counter() - t0)
    host_ms = _host_split(engine, prompts, many, steps)
    return {
        "graph_replay_ms": round(replay_ms, 3),
        "graph_step_ms": round((timings[1] - timings[0]) / steps * 1e3, 3),
        "host_ms_per_step": host_ms,
        "graph_replays": engine.graphs.stats.replays,
        "graph_eager_fallbacks": engine.graphs.stats.eager_fallbacks,
    }


def _host_split(engine, prompts, many, steps: int) -> dict:
    """Host time per step in each part of an engine step (the sampler's includes its wait for
    the GPU), by wrapping them for one more generation."""
    from snapfn.handler.llm.engine import engine as engine_mod

    totals: dict[str, float] = {}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[name] = totals.get(name, 0.0) + time.perf_counter() - t0

        return wrapper

    patches = [
        (engine.scheduler, "schedule"),
        (engine_mod.ForwardBatch, "build"),
        (engine.graphs, "replay"),
        (engine.graphs._graphs[next(iter(engine.graphs._graphs))], "replay"),
        (engine_mod, "sample"),
        (engine, "step"),
    ]
    saved = [(obj, name, getattr(obj, name)) for obj, name in patches]
    for obj, name, fn in saved:
        label = "cuda_graph_launch" if isinstance(obj, torch.cuda.CUDAGraph) else name
        setattr(obj, name, timed(label, fn))
    try:
        engine.generate(prompts, many)
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)
    return {k: round(v / (steps + 1) * 1e3, 3) for k, v in totals.items()}


if __name__ == "__main__":
    main()
