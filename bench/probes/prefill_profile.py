"""Where a prefill's time goes (device probe): torch.profiler over one prompt's prefill, by
kernel, and how much of the wall time the GPU was busy (the rest is the host: Python, launches,
syncs).

python3 bench/probes/prefill_profile.py MODEL_DIR [--backend flashinfer] [--tokens 2048]
    [--top 25]

Prints one JSON object: wall ms of the prefill, the kernels' summed device ms, and the top
kernels by their own device time (name, calls, microseconds), each over one prefill.
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
    parser.add_argument("--backend", default="flashinfer")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    opts = EngineOptions(
        device="cuda",
        backend=args.backend,
        num_pages=4096,
        scheduler=SchedulerConfig(page_size=16, max_num_batched_tokens=args.tokens),
    )
    engine = build_engine(args.model, opts).engine
    vocab = engine.model.config.vocab_size
    # each run a prompt of its own: a repeated one would find its full pages in the prefix cache
    prompts = [[(7919 * i + 11 + k) % vocab for i in range(args.tokens)] for k in range(3)]
    one = SamplingParams(max_new_tokens=1, ignore_eos=True)
    engine.generate([prompts[0]], one)  # warm: shapes, kernels compiled
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.generate([prompts[1]], one)
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        engine.generate([prompts[2]], one)
        torch.cuda.synchronize()
    rows = sorted(
        (
            (e.self_device_time_total, e.count, e.key)
            for e in prof.key_averages()
            if e.device_type.name == "CUDA" and e.self_device_time_total > 0
        ),
        reverse=True,
    )
    print(
        json.dumps(
            {
                "backend": args.backend,
                "tokens": args.tokens,
                "wall_ms": round(wall_ms, 3),
                "tokens_per_s": round(args.tokens / wall_ms * 1e3, 1),
                "device_ms": round(sum(r[0] for r in rows) / 1e3, 3),
                "top": [
                    {"kernel": key[:120], "calls": n, "us": round(us, 1)}
                    for us, n, key in rows[: args.top]
                ],
            }
        )
    )


if __name__ == "__main__":
    main()
