"""`snapfn bench --modes structured`: a structured request's latency, first against later.

Four fresh processes, two pairs: a cold init that writes a snapshot, then a restore of it, once
with the bench's schema configured (`SNAPFN_STRUCTURED_SCHEMAS`: compiled by the init's
`grammars` stage, recorded in the snapshot, compiled again by the restore's) and once without.
In each process the same structured request (`BENCH_SCHEMA`, greedy, so every run writes the
same tokens) is timed `REQUESTS` times; the result holds the first, the tenth and the median of
the later ones, with the compile cache's counters (a configured restore's first request must be
a hit). The restore's first request against its tenth is the figure that matters: a restored
worker's first structured request compiles nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REQUESTS = 10
MAX_NEW_TOKENS = 48
BENCH_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
RUNS = (("configured", True), ("unconfigured", False))


def mode_structured_init(args: argparse.Namespace, make_function) -> dict[str, Any]:
    """A cold init (schemas as the environment configures them), the latencies, the snapshot."""
    from snapfn.snapshot.runtime import cold_init, write_snapshot

    fn = make_function(Path(args.model))
    startup = cold_init(fn, log=None)
    result = structured_latency(fn.engine, args.device)
    write_snapshot(fn, Path(args.snapshot), startup, log=None)
    return {**result, "grammars_stage": startup.stage("grammars").figures}


def mode_structured_restore(args: argparse.Namespace, make_function) -> dict[str, Any]:
    """A tier-0 restore of `mode_structured_init`'s snapshot, then the latencies."""
    from snapfn.snapshot.runtime import restore

    fn, startup = restore(lambda: make_function(None), Path(args.snapshot), log=None)
    result = structured_latency(fn.engine, args.device)
    return {
        **result,
        "tier": startup.tier,
        "fallbacks": startup.fallbacks,
        "grammars_stage": startup.stage("grammars").figures,
    }


def structured_latency(engine, device: str) -> dict[str, Any]:
    """The same structured request `REQUESTS` times: ms of the first, the tenth, the later ones'
    median; the output's text and the compile cache's counters."""
    from snapfn.handler.llm.engine.request import SamplingParams
    from snapfn.handler.llm.structured.spec import spec_from_fields

    spec = spec_from_fields({"guided_json": BENCH_SCHEMA})
    params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, guide=spec)
    prompt = engine.tokenizer.encode("The record is")
    times_ms, texts = [], set()
    for _ in range(REQUESTS):
        start = time.perf_counter()
        (result,) = engine.generate([prompt], params)
        _sync(device)
        times_ms.append(round((time.perf_counter() - start) * 1e3, 3))
        texts.add(result.text)
    return {
        "first_ms": times_ms[0],
        "tenth_ms": times_ms[-1],
        "later_median_ms": round(statistics.median(times_ms[1:]), 3),
        "first_over_tenth": round(times_ms[0] / times_ms[-1], 2),
        "times_ms": times_ms,
        "tokens": len(result.token_ids),
        "text": result.text,
        "parses": _parses(result.text),
        "same_text_every_time": len(texts) == 1,
        "cache": engine.grammars.stats(),
    }


def run_structured_modes(args: argparse.Namespace, workdir: Path, run_process) -> dict[str, Any]:
    """Each of `RUNS`: the init then the restore, each in a fresh process (module docstring)."""
    from snapfn.handler.llm.bench.child import child_command, restore_argv  # NOTE: child imports us

    workdir.mkdir(parents=True, exist_ok=True)
    schemas = workdir / "structured-schemas.json"
    schemas.write_text(json.dumps([{"guided_json": BENCH_SCHEMA}]))
    out = {}
    for name, configured in RUNS:
        env = {k: v for k, v in os.environ.items() if k != "SNAPFN_STRUCTURED_SCHEMAS"}
        if configured:
            env["SNAPFN_STRUCTURED_SCHEMAS"] = str(schemas)
        snapshot = workdir / f"snapshot-structured-{name}"
        for child_mode in ("structured_init", "structured_restore"):
            cache = workdir / f"cache-{name}"
            cmd = child_command(restore_argv(child_mode, args.model, snapshot, args.device, cache))
            mode = f"{child_mode}_{name}"
            out[mode] = run_process(mode, cmd, args.timeout_s, env=env)
            print(f"[snapfn bench] {mode}: {brief(out[mode])}", file=sys.stderr, flush=True)
    return out


def brief(result: dict[str, Any]) -> str:
    if "first_ms" not in result:
        return result.get("error") or result.get("skipped") or "no figures"
    cache = result["cache"]
    return (
        f"first {result['first_ms']} ms, tenth {result['tenth_ms']} ms "
        f"({result['first_over_tenth']}x); cache {cache['hits']} hits, {cache['misses']} misses"
    )


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()
