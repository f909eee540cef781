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
from snapfn.snapshot.errors import BadRequest


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
    """(startup manifest, whole snapshot manifest or {}) from a snapshot dir or a JSON file."""
    from snapfn.snapshot.portable.format import read_manifest

    if path.is_dir():
        manifest = read_manifest(path)
        return manifest["startup"], manifest
    data = json.loads(path.read_text())
    return data.get("startup", data), data


def run_inspect(args: argparse.Namespace) -> int:
    startup, manifest = load_startup(args.snapshot)
    if args.json:
        print(json.dumps(startup, indent=2))
    else:
        print(format_table(startup, manifest))
    if args.plot is not None:
        from snapfn.handler.llm.recipes.waterfall import plot_waterfall

        plot_waterfall([startup], args.plot, title=str(args.snapshot))
        print(f"waterfall written to {args.plot}")
    return 0


def format_table(startup: dict[str, Any], manifest: dict[str, Any]) -> str:
    lines = [
        f"{startup['kind']} ({startup['tier']}): {startup['total_s']:.3f} s, ok={startup['ok']}"
    ]
    lines.append(f"{'stage':<18} {'start s':>8} {'seconds':>9}  figures")
    for s in startup["stages"]:
        figs = ", ".join(
            f"{k}={_short(v)}" for k, v in s["figures"].items() if not isinstance(v, dict | list)
        )
        lines.append(f"{s['name']:<18} {s['start_s']:8.3f} {s['seconds']:9.3f}  {figs}")
    lines += [
        f"fallback {f['from']} -> {f['to']} at {f['step']}: {f['reason']}"
        for f in startup["fallbacks"]
    ]
    llm = manifest.get("llm")
    if llm:
        plan = llm["memory_plan"]
        lines.append(
            f"memory plan: {plan['num_pages']} pages x {plan['page_size']} tokens "
            f"({plan['kv_bytes'] / 2**20:.1f} MiB KV, {plan['weights_bytes'] / 2**20:.1f} MiB weights, {plan['source']})"
        )
        lines.append(f"graph buckets: {llm['graph_buckets'] or 'none (eager decode)'}")
        parallel = llm.get("parallel")
        if isinstance(parallel, dict) and isinstance(llm.get("ranks"), list):
            files = ", ".join(f"weights/rank{k}.bin" for k in range(len(llm["ranks"])))
            lines.append(
                f"ranks: tp {parallel.get('tp_size')} x ep {parallel.get('ep_size')}"
                f" ({parallel.get('ep_dispatch')}), each its own weights: {files}"
            )
        lines.append(f"compile caches saved: {llm['compile_caches'] or 'none'}")
    process = manifest.get("process")
    if isinstance(process, dict):
        worker = process.get("worker", {})
        gpu = worker.get("device_in_use_bytes")
        lines.append(
            f"process image (tier 1): {process.get('image_bytes', 0) / 1e6:.1f} MB"
            + (f", {gpu / 1e9:.2f} GB left on the GPU at the checkpoint" if gpu else "")
            + f"; before-snapshot hooks: {', '.join(process.get('hooks', [])) or 'none'}"
        )
        moved = process.get("memory")
        if isinstance(moved, dict):
            lines.append(
                f"  memory moved out of the image: {moved['moved_bytes'] / 1e6:.1f} MB in"
                f" {moved['pieces']} mappings of {moved['file']}, mapped at restore"
            )
        lines += _process_memory_lines(process)
        ranks = manifest.get("process_ranks")
        if isinstance(ranks, list) and ranks:
            folders = [
                process.get("images"),
                *(r.get("images") for r in ranks if isinstance(r, dict)),
            ]
            lines.append(f"  a process image per rank: {', '.join(map(str, folders))}")
    if "compat" in manifest:
        lines.append("compat: " + ", ".join(f"{k}={v}" for k, v in manifest["compat"].items()))
        lines.append(restore_chain(manifest))
    return "\n".join(lines)


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
    from snapfn.snapshot.process.smaps import describe

    lines = [
        f"  private memory {stage}: {describe(found)}"
        for stage, found in process.get("private_memory", {}).items()
        if "private_bytes" in found
    ]
    regions = process.get("regions", [])
    if regions:
        total = sum(r["nbytes"] for r in regions) / 1e9
        fills = ", ".join(
            f"{r['name']} {r['nbytes'] / 1e9:.2f} GB {r['fill']}" for r in regions[:3]
        )
        more = f", +{len(regions) - 3} more" if len(regions) > 3 else ""
        lines.append(f"  regions kept out of the image: {total:.2f} GB ({fills}{more})")
    return lines


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
