"""Where a tier-0 restore's stages spend their time, in this process (the imports done first,
as a zygote has them).

python3 bench/probes/warmup_profile.py SNAPSHOT [--model DIR] [--device cuda] [--cache-dir D]
    [--top 30]

SNAPSHOT: a portable snapshot (`snapfn init --snapshot SNAPSHOT`). The restore runs with the
stages in PROFILED (cache restore, model build, weights' stream, warmup, capture) under
cProfile; each Triton kernel launch is timed on the host (a
first launch in a process finds or builds its binary and loads it). Then the warmup runs once
more, every kernel loaded. Prints one JSON object: each stage's seconds, the warm second
warmup's, the profile's top functions by own time and by cumulative time within each stage,
the modules each profiled stage imported,
and per Triton kernel its launches and the host time of its slow ones (over 1 ms).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from collections import defaultdict
from pathlib import Path

# the restore stages run under cProfile (each `LLMFunction.stage_<name>`)
PROFILED = ("restore_caches", "build_model", "stream_weights", "warmup", "capture_graphs")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("snapshot", type=Path)
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--cache-dir", type=Path, default=None)
    p.add_argument("--top", type=int, default=30)
    a = p.parse_args()

    import torch  # noqa: F401  (the zygote's imports, before the clock)

    from snapfn.handler.llm.init_config import InitConfig
    from snapfn.handler.llm.recipes.function import LLMFunction
    from snapfn.snapshot.runtime import restore

    launches = _time_triton_launches()
    profiles: dict[str, dict] = {}

    def profiled(name, method):
        def run(self, *args, **kwargs):
            prof = cProfile.Profile()
            known = set(sys.modules)
            t0 = time.perf_counter()
            prof.enable()
            try:
                return method(self, *args, **kwargs)
            finally:
                prof.disable()
                profiles[name] = {
                    "seconds": round(time.perf_counter() - t0, 4),
                    "imported": sorted(set(sys.modules) - known),
                    **_top(prof, a.top),
                }

        return run

    stage_warmup = LLMFunction.stage_warmup
    for name in PROFILED:
        setattr(LLMFunction, f"stage_{name}", profiled(name, getattr(LLMFunction, f"stage_{name}")))
    config = InitConfig.from_env({}, device=a.device, cache_dir=a.cache_dir)
    t0 = time.perf_counter()
    fn, startup = restore(lambda: LLMFunction(config, a.model), a.snapshot, log=None)
    restore_s = time.perf_counter() - t0
    first_launches = {k: dict(v) for k, v in launches.items()}
    launches.clear()
    t1 = time.perf_counter()
    stage_warmup(fn, {})  # the restore's own warmup stage again, unprofiled
    again_s = time.perf_counter() - t1
    stages = {s["name"]: round(s["seconds"], 4) for s in startup.to_json()["stages"]}
    print(
        json.dumps(
            {
                "restore_s": round(restore_s, 4),
                "stages": stages,
                "warmup_again_s": round(again_s, 4),
                "profiles": profiles,
                "triton_first_process": _summary(first_launches),
                "triton_again": _summary({k: dict(v) for k, v in launches.items()}),
            },
            indent=1,
        )
    )


def _time_triton_launches() -> dict:
    """Per Triton kernel name: launches, and count and host seconds of those over 1 ms."""
    stats: dict = defaultdict(lambda: defaultdict(float))
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return stats
    run = JITFunction.run

    def timed(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return run(self, *args, **kwargs)
        finally:
            dt = time.perf_counter() - t0
            entry = stats[getattr(self, "__name__", repr(self))]
            entry["launches"] += 1
            if dt > 1e-3:
                entry["slow"] += 1
                entry["slow_s"] += dt

    JITFunction.run = timed
    return stats


def _summary(stats: dict) -> dict:
    slow = sorted(stats.items(), key=lambda kv: -kv[1].get("slow_s", 0.0))
    return {
        "kernels": len(stats),
        "slow_s": round(sum(v.get("slow_s", 0.0) for v in stats.values()), 4),
        "by_kernel": {
            k: {
                "launches": int(v["launches"]),
                "slow": int(v.get("slow", 0)),
                "slow_s": round(v.get("slow_s", 0.0), 4),
            }
            for k, v in slow
        },
    }


def _top(prof: cProfile.Profile, n: int) -> dict:
    out = {}
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(n)
        out[f"by_{key}"] = [line for line in buf.getvalue().splitlines() if line.strip()][-n:]
    return out


if __name__ == "__main__":
    main()
