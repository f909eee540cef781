"""What a worker runs: the target flags shared by `snapfn serve` and `snapfn worker`.

Contract:
- `add_target_arguments(p, verb)` adds `--model`, `--snapshot`, `--function`, `--function-dir`;
  `add_engine_arguments(p)` adds the LLM engine flags (`--device`, `--dtype`, …). Both
  subcommands read them back with the same `serve_target(args)`.
- `serve_target(args)` is the `ServeTarget` the flags describe, validated before any worker
  starts: `--function` excludes `--model`/`--snapshot`; with none of the three, the embedded
  model must be built here. Engine settings are `InitConfig.from_env(os.environ)` overridden by
  the flags given. `check_target_flags(args)` is the part of that validation that imports
  nothing heavy (the activator runs it without torch).

Imports stay light (no flask, gunicorn or torch at import): the queue worker imports this
module without the HTTP stack, and the runtime's `InitConfig` is imported when a target is built.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from snapfn.snapshot.errors import BadRequest


def add_target_arguments(p: argparse.ArgumentParser, verb: str) -> None:
    """The target group; `verb` ("serve", "run") words its help."""
    what = p.add_argument_group(f"what to {verb} (default: the embedded model)")
    what.add_argument("--model", type=Path, help="HF model folder (cold init, or fallback)")
    what.add_argument(
        "--snapshot",
        type=Path,
        help="restore from this snapshot folder "
        "(empty or missing: cold init, then write the snapshot there)",
    )
    what.add_argument("--function", help=f"{verb} a user function, module:function")
    what.add_argument("--function-dir", type=Path, help="folder searched first for its module")


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    engine = p.add_argument_group("engine (llm)")
    engine.add_argument("--device", help="cpu or cuda[:N] (default: SNAPFN_DEVICE or cpu)")
    engine.add_argument("--dtype", help="auto, float32, bfloat16 or float16")
    engine.add_argument("--max-model-len", type=int, help="longest sequence served")
    engine.add_argument("--max-running-requests", type=int, help="decode batch limit")
    engine.add_argument("--kv-cache-mb", type=int, help="KV pool size on CPU, MiB")


def serve_target(args: argparse.Namespace) -> Any:
    """The `ServeTarget` the flags describe (validated here, in the master, before any fork)."""
    # NOTE: importing the runtime's InitConfig imports torch in the master. That is safe (CUDA
    # is not initialised by an import) and workers fork with torch already imported.
    from .llm.init_config import InitConfig
    from .runtime import ServeTarget

    check_target_flags(args)
    if args.function is not None:
        return ServeTarget(
            kind="function",
            function=args.function,
            function_dir=args.function_dir,
            init_config=InitConfig.from_env(os.environ),
        )
    kv_bytes = args.kv_cache_mb << 20 if args.kv_cache_mb is not None else None
    init_config = InitConfig.from_env(
        os.environ,
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_running_requests=args.max_running_requests,
        kv_cache_bytes_cpu=kv_bytes,
    )
    return ServeTarget(model_dir=args.model, snapshot_dir=args.snapshot, init_config=init_config)


def check_target_flags(args: argparse.Namespace) -> None:
    """Refuse flag combinations that describe no target (torch-free: nothing heavy imported)."""
    if args.function is not None:
        if args.model is not None or args.snapshot is not None:
            raise BadRequest("--function serves a user function: drop --model/--snapshot")
    elif args.model is None and args.snapshot is None:
        _require_embedded_model()


def _require_embedded_model() -> None:
    from .llm.embedded import embedded_model_dir

    if not (embedded_model_dir() / "config.json").is_file():
        raise BadRequest(
            "no model given and the embedded model is not built here: "
            "pass --model DIR, --snapshot DIR or --function module:fn"
        )
