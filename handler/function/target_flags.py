"""What a worker runs: the target flags shared by `snapfn serve` and `snapfn worker`.

Contract:
- `add_target_arguments(p, verb)` adds `--model`, `--snapshot`, `--function`, `--function-dir`;
  `add_engine_arguments(p)` adds the LLM engine flags (`--device`, `--dtype`, …). Both
  subcommands read them back with the same `serve_target(args)`.
- `serve_target(args)` is the `ServeTarget` the flags describe, validated before any worker
  starts: `--function` excludes `--model` (with `--snapshot`: the function's process snapshot,
  made by `snapfn init --function`); with none of the three, the embedded model must be built
  here. `--snapshot s3://bucket/prefix` is pulled into the local snapshot cache
  (snapshot/store/cache.py) by `snapshot_path(args)`, in the master, before any fork — except a
  cache miss of a one-rank LLM with overlap on (SNAPFN_SNAPSHOT_CACHE_OVERLAP, default on): the
  target then names the URI (`snapshot_uri`) and the cache entry's folder, and the worker that
  restores pulls it (llm/recipes/s3_restore.py: a portable snapshot restored as it arrives; a
  process snapshot pulled whole, or on a refused pull its portable tier restored as that
  arrives). A pull refused in the master leaves a folder holding only the snapshot's manifest,
  which the restore refuses and falls back from (a cold init from `--model`, else from the
  source the manifest records, verified). A refused manifest fails the command, or with
  `--model` gives no snapshot: a cold init from the model. A one-process command that restores
  in the same process opens it with `opened_snapshot(args)`. Engine settings
  are `InitConfig.from_env(os.environ)` overridden by the flags given. `check_target_flags(args)`
  is the part of that validation that imports nothing heavy (the activator runs it without torch).

Imports stay light (no flask, gunicorn or torch at import): the queue worker imports this
module without the HTTP stack, and the runtime's `InitConfig` is imported when a target is built.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from snapfn.snapshot.errors import BadRequest, BadSnapshot, IncompatibleSnapshot, one_line


def add_target_arguments(p: argparse.ArgumentParser, verb: str) -> None:
    """The target group; `verb` ("serve", "run") words its help."""
    what = p.add_argument_group(f"what to {verb} (default: the embedded model)")
    what.add_argument("--model", type=Path, help="HF model folder (cold init, or fallback)")
    add_snapshot_arguments(
        what,
        "restore from this snapshot folder "
        "(empty or missing: cold init, then write the snapshot there)",
    )
    what.add_argument("--function", help=f"{verb} a user function, module:function")
    what.add_argument("--function-dir", type=Path, help="folder searched first for its module")


def add_snapshot_arguments(group: Any, help_text: str) -> None:
    """`--snapshot DIR|s3://…` and `--cache-max-bytes`; `snapshot_path` reads them back."""
    group.add_argument(
        "--snapshot",
        metavar="DIR|s3://BUCKET/PREFIX",
        help=f"{help_text}; an s3:// snapshot is pulled into the local snapshot cache first "
        "(SNAPFN_SNAPSHOT_CACHE, endpoint from AWS_ENDPOINT_URL)",
    )
    group.add_argument(
        "--cache-max-bytes",
        help="bound of the snapshot cache, LRU eviction (default: "
        "SNAPFN_SNAPSHOT_CACHE_MAX_BYTES or 100G)",
    )


def snapshot_path(args: argparse.Namespace) -> Path | None:
    """`--snapshot` as a local folder: an s3:// URI is pulled into the snapshot cache first (a
    refused pull: a folder holding only its manifest, for the restore to refuse)."""
    from snapfn.snapshot.store.s3 import is_s3_uri

    if args.snapshot is None or not is_s3_uri(args.snapshot):
        return None if args.snapshot is None else Path(args.snapshot)
    from snapfn.snapshot.store.cache import open_snapshot

    return open_snapshot(args.snapshot, snapshot_cache_config(args)).path


def opened_snapshot(args: argparse.Namespace, streamed: tuple[str, ...]) -> Any:
    """`--snapshot` opened for a restore in this process (a cache `OpenedSnapshot`, or None):
    an s3:// cache miss is being pulled, its `pull` to be followed (store/cache.py)."""
    from snapfn.snapshot.store.cache import OpenedSnapshot, open_snapshot
    from snapfn.snapshot.store.s3 import is_s3_uri

    if args.snapshot is None or not is_s3_uri(args.snapshot):
        return None if args.snapshot is None else OpenedSnapshot(Path(args.snapshot))
    try:
        return open_snapshot(args.snapshot, snapshot_cache_config(args), streamed=streamed)
    except (BadSnapshot, IncompatibleSnapshot) as exc:
        _cold_init_instead(args, exc)
        return None


def _cold_init_instead(args: argparse.Namespace, exc: Exception) -> None:
    """A snapshot refused before anything was pulled (its manifest, which is then trusted for
    nothing): the model the user named is the cold init's source; none named: `exc` raised."""
    model = getattr(args, "model", None)
    if model is None:
        raise exc
    print(f"[snapfn] {one_line(str(exc))}; a cold init from {model} instead", file=sys.stderr)


def snapshot_cache_config(args: argparse.Namespace) -> Any:
    from snapfn.snapshot.store.cache import SnapshotCacheConfig

    return SnapshotCacheConfig.from_env(os.environ, max_bytes=args.cache_max_bytes)


def _llm_snapshot(args: argparse.Namespace, world_size: int) -> dict[str, Any]:
    """The LLM target's snapshot fields: `snapshot_dir`, and for a cache miss its worker pulls
    the URI and cache it pulls with (nothing is pulled here, before the fork). A refused
    manifest with `--model` named: no snapshot (a cold init from the model)."""
    from snapfn.snapshot.store.s3 import is_s3_uri

    if not is_s3_uri(args.snapshot):
        return {"snapshot_dir": snapshot_path(args)}
    from snapfn.handler.llm.recipes.s3_restore import STREAMED
    from snapfn.snapshot.store.cache import deferred_miss

    cache = snapshot_cache_config(args)
    try:
        folder = deferred_miss(args.snapshot, cache, streamed=STREAMED) if world_size == 1 else None
        if folder is not None:
            return {"snapshot_dir": folder, "snapshot_uri": args.snapshot, "snapshot_cache": cache}
        return {"snapshot_dir": snapshot_path(args)}
    except (BadSnapshot, IncompatibleSnapshot) as exc:
        _cold_init_instead(args, exc)
        return {"snapshot_dir": None}


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    engine = p.add_argument_group("engine (llm)")
    engine.add_argument("--device", help="cpu or cuda[:N] (default: SNAPFN_DEVICE or cpu)")
    engine.add_argument("--dtype", help="auto, float32, bfloat16 or float16")
    engine.add_argument("--max-model-len", type=int, help="longest sequence served")
    engine.add_argument("--max-running-requests", type=int, help="decode batch limit")
    engine.add_argument("--kv-cache-mb", type=int, help="KV pool size on CPU, MiB")
    engine.add_argument(
        "--tp-size",
        type=int,
        help="tensor-parallel ranks: this process serves as rank 0 and starts the others",
    )
    engine.add_argument(
        "--ep-size", type=int, help="expert-parallel ranks of a MoE model (times --tp-size)"
    )


def serve_target(args: argparse.Namespace) -> Any:
    """The `ServeTarget` the flags describe (validated here, in the master, before any fork)."""
    # NOTE: importing the runtime's InitConfig imports torch in the master. That is safe (CUDA
    # is not initialised by an import) and workers fork with torch already imported.
    from snapfn.handler.function.target import ServeTarget
    from snapfn.handler.llm.init_config import InitConfig

    check_target_flags(args)
    if args.function is not None:
        return ServeTarget(
            kind="function",
            function=args.function,
            function_dir=args.function_dir,
            snapshot_dir=snapshot_path(args),
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
        tp_size=args.tp_size,
        ep_size=args.ep_size,
    )
    if init_config.tp_size < 1 or init_config.ep_size < 1:
        raise BadRequest(
            f"--tp-size and --ep-size must be >= 1, got {init_config.tp_size} and {init_config.ep_size}"
        )
    snapshot = _llm_snapshot(args, init_config.world_size)
    return ServeTarget(model_dir=args.model, init_config=init_config, **snapshot)


def check_target_flags(args: argparse.Namespace) -> None:
    """Refuse flag combinations that describe no target (torch-free: nothing heavy imported)."""
    if args.function is not None:
        if args.model is not None:
            raise BadRequest("--function serves a user function: drop --model")
    elif args.model is None and args.snapshot is None:
        _require_embedded_model()


def _require_embedded_model() -> None:
    from snapfn.handler.llm.embedded import embedded_model_dir

    if not (embedded_model_dir() / "config.json").is_file():
        raise BadRequest(
            "no model given and the embedded model is not built here: "
            "pass --model DIR, --snapshot DIR or --function module:fn"
        )
