"""`snapfn init` (cold init → tier-0 snapshot) and `snapfn inspect` (startup manifest table/plot)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

from snapfn.handler.llm.init_config import InitConfig
from snapfn.snapshot.errors import BadRequest, bad_snapshot

ABSENT = "(absent)"  # what `snapfn inspect` shows for a field missing or not of its type
MAX_PLOT_S = 1e9  # a stage drawn on a waterfall: seconds to hours of a start, never years


def add_init_config_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per InitConfig field that users tune; defaults come from the dataclass."""
    d = InitConfig()
    p.add_argument("--device", default=None, help=f"cpu or cuda[:N] (default {d.device})")
    p.add_argument(
        "--dtype", default=None, help=f"auto, float32, bfloat16, float16 (default {d.dtype})"
    )
    p.add_argument(
        "--max-running-requests", type=int, default=None, help=f"default {d.max_running_requests}"
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help=f"default {d.max_num_batched_tokens}",
    )
    p.add_argument("--max-model-len", type=int, default=None, help=f"default {d.max_model_len}")
    p.add_argument(
        "--mem-fraction-static", type=float, default=None, help=f"default {d.mem_fraction_static}"
    )
    p.add_argument("--graph-max-batch", type=int, default=None, help=f"default {d.graph_max_batch}")
    p.add_argument(
        "--cache-dir", type=Path, default=None, help="compile caches (default ~/.cache/snapfn)"
    )
    p.add_argument(
        "--tp-size",
        type=int,
        default=None,
        help="tensor-parallel ranks, one process each (started here): a snapshot of each rank",
    )
    p.add_argument(
        "--ep-size", type=int, default=None, help="expert-parallel ranks (times --tp-size)"
    )


def init_config_from_args(args: argparse.Namespace) -> InitConfig:
    names = {f.name for f in fields(InitConfig)}
    overrides = {k: v for k, v in vars(args).items() if k in names}
    return InitConfig.from_env(os.environ, **overrides)


def add_init_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", type=Path, default=None, help="HF model folder (default: the embedded model)"
    )
    p.add_argument("--snapshot", type=Path, required=True, help="snapshot directory to write")
    p.add_argument(
        "--tier",
        choices=("portable", "process"),
        default=None,
        help="portable (tier 0, default; SNAPFN_TIER) or process: also checkpoint the warmed"
        " worker with criu (+ CUDA checkpoint), falling back to portable if it cannot",
    )
    p.add_argument(
        "--function",
        default=None,
        help="snapshot a user function (module:function) instead of the LLM: its init hooks run"
        " in a checkpointable worker on --device, which is dumped with criu (+ the CUDA"
        " checkpoint, its device memory kept out of the image): tier 1, or tier 0 (its compile"
        " caches) with the reason where no process image can be written",
    )
    p.add_argument("--function-dir", type=Path, default=None, help="folder searched first")
    add_init_config_arguments(p)


def run_init(args: argparse.Namespace) -> int:
    from snapfn.handler.llm.embedded import embedded_model_dir
    from snapfn.handler.llm.recipes.function import LLMFunction
    from snapfn.snapshot.runtime import init_and_snapshot, summary

    config = init_config_from_args(args)
    model_dir = args.model or embedded_model_dir()
    if args.function is not None:
        from snapfn.handler.function.host import init_function_snapshot
        from snapfn.snapshot.stages import stderr_log

        startup = init_function_snapshot(
            args.function,
            args.snapshot,
            args.function_dir,
            stderr_log,
            device=config.device,
            cache_root=args.cache_dir,
        )
        for fallback in startup.fallbacks:
            print(f"snapfn init: no process image: {fallback['reason']}", file=sys.stderr)
    elif config.world_size > 1:
        startup = _init_ranks(config, model_dir, args.snapshot)
    elif config.tier == "process":
        startup = _init_process(config, model_dir, args.snapshot)
    elif config.tier == "portable":
        startup = init_and_snapshot(LLMFunction(config, model_dir), args.snapshot)
    else:
        raise BadRequest(f"tier must be portable or process, not {config.tier!r}")
    print(summary(startup, stages=False), file=sys.stderr)  # its stages were logged as they ran
    written = "portable" if startup.tier == "cold" else startup.tier  # a tier-0 init's own tier
    print(f"snapshot ({written}) written to {args.snapshot}")
    return 0


def _init_ranks(config: InitConfig, model_dir: Path, dest: Path):
    """A snapshot of every rank of a tensor/expert-parallel model. Tier 0: this process is
    rank 0 and starts the others (`ranks.py`); all cold-init, then write it together. Tier 1:
    a checkpointable worker per rank (`process_ranks.py`)."""
    import dataclasses

    from snapfn.handler.llm.lockstep import Lockstep
    from snapfn.handler.llm.ranks import parallel_ranks
    from snapfn.handler.llm.recipes.ranks_start import start_rank
    from snapfn.snapshot.stages import stderr_log

    if config.tier == "process":
        from snapfn.handler.llm.recipes.process_ranks import init_process_ranks

        return init_process_ranks(config, model_dir, dest, stderr_log)
    command = [sys.executable, "-m", "snapfn.handler.llm.follower", str(model_dir), str(dest)]
    ranks = parallel_ranks(
        config.tp_size,
        config.ep_size,
        config.ep_dispatch,
        config.device,
        command=[*command, "init"],
        extra_env=config.to_env(),
    )
    with ranks as (parallel, device):
        config = dataclasses.replace(config, device=device)
        _, startup = start_rank(config, Path(model_dir), Path(dest), parallel, stderr_log, True)
        Lockstep(parallel).send({"stop": True})  # the others wait to follow: they are done
    return startup


def _init_process(config: InitConfig, model_dir: Path, dest: Path):
    """Cold init in a checkpointable worker, then its process image (or tier 0 if it cannot)."""
    from snapfn.handler.llm.recipes.snapshot_files import config_json
    from snapfn.snapshot.process.snapshot import init_process_snapshot
    from snapfn.snapshot.process.worker_process import ProcessConfig
    from snapfn.snapshot.stages import stderr_log

    args = {"model_dir": str(Path(model_dir).absolute()), "init_config": config_json(config)}
    host = "snapfn.handler.llm.recipes.process_host:make"
    process_config = ProcessConfig.from_env(os.environ).for_device(config.device)
    startup, _ = init_process_snapshot(host, args, dest, process_config, stderr_log)
    return startup


def add_inspect_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "snapshot", type=Path, help="snapshot directory (or a startup-manifest JSON file)"
    )
    p.add_argument("--plot", type=Path, default=None, help="write the stage waterfall to this PNG")
    p.add_argument("--json", action="store_true", help="print the startup manifest as JSON")


def load_startup(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(startup manifest, the JSON object that holds it) from a snapshot dir or a JSON file.

    A file is read as a snapshot's manifest.json is: a regular file of at most
    MAX_MANIFEST_BYTES, UTF-8 JSON, nested within bounds. BadSnapshot (one line) unless it is a
    JSON object and its `startup` (or, without that key, the object itself) is one too; the
    fields inside are `format_table`'s to show or mark absent."""
    from snapfn.snapshot.portable.format import (
        MAX_MANIFEST_BYTES,
        load_json,
        read_manifest,
        read_regular_file,
    )

    if path.is_dir():
        manifest = read_manifest(path)
        startup = manifest.get("startup")
    else:
        file = path.resolve()  # the user's own path: a symlink to a JSON file is followed
        try:
            manifest = load_json(read_regular_file(file.parent, file.name, MAX_MANIFEST_BYTES))
        except ValueError as e:
            raise bad_snapshot(path, f"it is {e}") from None
        if not isinstance(manifest, dict):
            raise bad_snapshot(path, "it is not a JSON object")
        startup = manifest.get("startup", manifest)
    if not isinstance(startup, dict):
        raise bad_snapshot(path, "it holds no startup manifest (a JSON object at 'startup')")
    return startup, manifest


def run_inspect(args: argparse.Namespace) -> int:
    startup, manifest = load_startup(args.snapshot)
    if args.json:
        print(json.dumps(startup, indent=2))
    else:
        print(format_table(startup, manifest))
    if args.plot is not None:
        from snapfn.handler.llm.recipes.waterfall import plot_waterfall

        plot_waterfall([_plottable(startup)], args.plot, title=str(args.snapshot))
        print(f"waterfall written to {args.plot}")
    return 0


def _plottable(startup: dict[str, Any]) -> dict[str, Any]:
    """The startup manifest's stages that a waterfall can draw: a name, and a start and a
    length in seconds within MAX_PLOT_S."""
    stages = startup.get("stages")
    drawable = [
        {"name": _text(s.get("name")), "start_s": s["start_s"], "seconds": s["seconds"]}
        for s in (stages if isinstance(stages, list) else ())
        if isinstance(s, dict)
        and all(_is_number(s.get(k)) and abs(s[k]) <= MAX_PLOT_S for k in ("start_s", "seconds"))
    ]
    kind, tier = _text(startup.get("kind")), _text(startup.get("tier"))
    return {"kind": kind, "tier": tier, "stages": drawable}


def format_table(startup: dict[str, Any], manifest: dict[str, Any]) -> str:
    """The startup manifest's stages and the snapshot's sections, a line each; a field that is
    missing, or not of its type, reads ABSENT."""
    lines = _startup_lines(startup)
    llm = manifest.get("llm")
    if llm is not None:
        lines += _llm_lines(llm)
    process = manifest.get("process")
    if isinstance(process, dict):
        lines += _process_lines(process, manifest.get("process_ranks"))
    compat = manifest.get("compat")
    if isinstance(compat, dict):
        lines.append("compat: " + ", ".join(f"{k}={v}" for k, v in compat.items()))
        lines.append(restore_chain(manifest))
    return "\n".join(lines)


def _startup_lines(startup: dict[str, Any]) -> list[str]:
    kind, tier, ok = (_text(startup.get(k)) for k in ("kind", "tier", "ok"))
    lines = [f"{kind} ({tier}): {_number(startup.get('total_s'), '.3f')} s, ok={ok}"]
    lines.append(f"{'stage':<18} {'start s':>8} {'seconds':>9}  figures")
    stages = startup.get("stages")
    for s in stages if isinstance(stages, list) else ():
        figures = _get(s, "figures")
        figs = ", ".join(
            f"{k}={_short(v)}"
            for k, v in (figures.items() if isinstance(figures, dict) else ())
            if not isinstance(v, dict | list)
        )
        start_s, seconds = _number(_get(s, "start_s"), ".3f"), _number(_get(s, "seconds"), ".3f")
        lines.append(f"{_text(_get(s, 'name')):<18} {start_s:>8} {seconds:>9}  {figs}")
    if not isinstance(stages, list):
        lines.append(f"stages: {ABSENT}")
    fallbacks = startup.get("fallbacks")
    if not isinstance(fallbacks, list):
        return [*lines, f"fallbacks: {ABSENT}"]
    return lines + [
        f"fallback {_text(_get(f, 'from'))} -> {_text(_get(f, 'to'))} at"
        f" {_text(_get(f, 'step'))}: {_text(_get(f, 'reason'))}"
        for f in fallbacks
    ]


def _llm_lines(llm: Any) -> list[str]:
    if not isinstance(llm, dict):
        return [f"llm: {ABSENT}"]
    plan = llm.get("memory_plan")
    if isinstance(plan, dict):
        pages, page_size = _text(plan.get("num_pages")), _text(plan.get("page_size"))
        kv_mib = _number(plan.get("kv_bytes"), ".1f", 2**20)
        weights_mib = _number(plan.get("weights_bytes"), ".1f", 2**20)
        lines = [
            f"memory plan: {pages} pages x {page_size} tokens ({kv_mib} MiB KV,"
            f" {weights_mib} MiB weights, {_text(plan.get('source'))})"
        ]
    else:
        lines = [f"memory plan: {ABSENT}"]
    lines.append(f"graph buckets: {llm.get('graph_buckets', ABSENT) or 'none (eager decode)'}")
    parallel = llm.get("parallel")
    if isinstance(parallel, dict) and isinstance(llm.get("ranks"), list):
        files = ", ".join(f"weights/rank{k}.bin" for k in range(len(llm["ranks"])))
        lines.append(
            f"ranks: tp {parallel.get('tp_size')} x ep {parallel.get('ep_size')}"
            f" ({parallel.get('ep_dispatch')}), each its own weights: {files}"
        )
    lines.append(f"compile caches saved: {llm.get('compile_caches', ABSENT) or 'none'}")
    return lines


def _process_lines(process: dict[str, Any], ranks: Any) -> list[str]:
    gpu = _get(process.get("worker"), "device_in_use_bytes")
    hooks = process.get("hooks", [])
    lines = [
        f"process image (tier 1): {_number(process.get('image_bytes', 0), '.1f', 1e6)} MB"
        + (f", {_number(gpu, '.2f', 1e9)} GB left on the GPU at the checkpoint" if gpu else "")
        + "; before-snapshot hooks: "
        + ((", ".join(map(str, hooks)) or "none") if isinstance(hooks, list) else ABSENT)
    ]
    moved = process.get("memory")
    if isinstance(moved, dict):
        lines.append(
            f"  memory moved out of the image: {_number(moved.get('moved_bytes'), '.1f', 1e6)} MB"
            f" in {_text(moved.get('pieces'))} mappings of {_text(moved.get('file'))},"
            " mapped at restore"
        )
    lines += _process_memory_lines(process)
    if isinstance(ranks, list) and ranks:
        folders = [process.get("images"), *(_get(r, "images") for r in ranks)]
        lines.append(f"  a process image per rank: {', '.join(map(str, folders))}")
    return lines


def restore_chain(manifest: dict[str, Any], current: dict[str, Any] | None = None) -> str:
    """What a restore on this machine would do, tier by tier (`compat.restore_steps`), against
    `current` or this machine's key for the recorded device type and rank count."""
    from snapfn.snapshot.errors import SnapfnError
    from snapfn.snapshot.portable.compat import compat_key, restore_steps

    recorded = manifest["compat"] if isinstance(manifest.get("compat"), dict) else {}
    if current is None:
        kind = "cuda" if recorded.get("device_type") == "cuda" else "cpu"
        world_size = recorded.get("world_size", 1)
        try:
            current = compat_key(kind, world_size if isinstance(world_size, int) else 1, light=True)
        except (SnapfnError, ValueError, OSError) as exc:
            return f"restore chain here: unknown ({exc})"
    steps = restore_steps(recorded, current, manifest.get("tier") == "process")
    return "restore chain here: " + " → ".join(steps)


def _process_memory_lines(process: dict[str, Any]) -> list[str]:
    """Where the image's bytes come from (the census taken at the checkpoint) and the regions a
    restorer makes for the worker."""
    censuses = process.get("private_memory")
    lines = [
        f"  private memory {stage}: {_census(found)}"
        for stage, found in (censuses.items() if isinstance(censuses, dict) else ())
        if isinstance(found, dict) and "private_bytes" in found
    ]
    regions = process.get("regions", [])
    if isinstance(regions, list) and regions:
        sizes = [_get(r, "nbytes") for r in regions]
        total = _number(sum(n for n in sizes if _is_number(n)), ".2f", 1e9)
        fills = ", ".join(
            f"{_text(_get(r, 'name'))} {_number(n, '.2f', 1e9)} GB {_text(_get(r, 'fill'))}"
            for r, n in zip(regions[:3], sizes, strict=False)
        )
        more = f", +{len(regions) - 3} more" if len(regions) > 3 else ""
        lines.append(f"  regions kept out of the image: {total} GB ({fills}{more})")
    return lines


def _census(found: dict[str, Any]) -> str:
    """smaps.describe's line for a census of the shape it reads, else ABSENT."""
    from snapfn.snapshot.process.smaps import describe

    top = found.get("top")
    readable = _is_number(found["private_bytes"]) and isinstance(top, list)
    readable = readable and all(
        isinstance(t, list) and len(t) == 2 and isinstance(t[0], str) and _is_number(t[1])
        for t in top
    )
    return describe(found) if readable else ABSENT


# ---------------------------------------------------------------- fields of a JSON document


def _get(section: Any, key: str) -> Any:
    """section[key]; None where `section` is not a JSON object or lacks `key`."""
    return section.get(key) if isinstance(section, dict) else None


def _is_number(value: Any) -> bool:
    """A JSON number a float holds (not a bool, not NaN or infinite, not an int past 1e308)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return abs(value) <= sys.float_info.max


def _number(value: Any, spec: str, scale: float = 1.0) -> str:
    """`value / scale` in the format `spec`, or ABSENT."""
    return format(value / scale, spec) if _is_number(value) else ABSENT


def _text(value: Any) -> str:
    """A JSON scalar as text, or ABSENT (missing, null, or a list or object)."""
    return str(value) if isinstance(value, str | int | float | bool) else ABSENT


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
