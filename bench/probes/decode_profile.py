"""Where a decode step's time goes (device probe): torch.profiler over eager decode steps, by
kernel, for one backend — what to fuse or replace to approach the roofline.

python3 bench/probes/decode_profile.py MODEL_DIR [--backend torch|triton] [--batch 1]
    [--steps 16] [--device cuda]

Prints one JSON object: the backend, the batch, device time per decode step, and the top
kernels by their own device time per step (name, calls per step, microseconds per step).
Eager, not graph-replayed: the kernels are the same as in the captured graphs, launch overhead
is not in the device times.
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
    args = parser.parse_args()
    opts = EngineOptions(
        device=args.device,
        backend=args.backend,
        num_pages=4096,
        scheduler=SchedulerConfig(page_size=16, max_num_batched_tokens=2048),
    )
    engine = build_engine(args.model, opts).engine
    prompts = [[(977 * i + 13 * b) % 1000 + 1 for i in range(200)] for b in range(args.batch)]
    one = SamplingParams(max_new_tokens=1, ignore_eos=True)
    many = SamplingParams(max_new_tokens=args.steps + 1, ignore_eos=True)
    engine.generate(prompts, many)  # warm: shapes, kernels compiled
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    sync()
    t0 = time.perf_counter()
    engine.generate(prompts, one)  # the prefill alone, to subtract
    sync()
    prefill_s = time.perf_counter() - t0
    activities = [torch.profiler.ProfilerActivity.CPU]
    if args.device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        t0 = time.perf_counter()
        engine.generate(prompts, many)
        sync()
        wall_s = time.perf_counter() - t0
    on_device = args.device.startswith("cuda")
    rows = []
    for event in prof.key_averages():
        own_us = event.self_device_time_total if on_device else event.self_cpu_time_total
        if own_us > 0 and (not on_device or event.device_type.name == "CUDA"):
            rows.append((own_us, event.count, event.key))
    rows.sort(reverse=True)
    steps = args.steps  # the prefill of the profiled run is in these totals too (see prefill_ms)
    print(
        json.dumps(
            {
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


if __name__ == "__main__":
    main()
