"""Drive a function through cold init, checkpoint and restore, with fallback.

    init_and_snapshot(fn, dest)  cold init (timed stages) → write a tier-0 snapshot atomically
    restore(make_fn, snap)       validate → restore stages → up; on any failure: release the
                                 half-restored function, record why, cold init instead (and
                                 write a fresh snapshot when the function knows its source)

Never serves from a snapshot that failed a check: a function is returned only after every
stage of its restore (the replay check included) passed, or after a cold init.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from snapfn.snapshot.errors import SnapfnError
from snapfn.snapshot.function import SnapshotFunction
from snapfn.snapshot.portable.compat import compat_key
from snapfn.snapshot.portable.format import validate_snapshot
from snapfn.snapshot.portable.publish import SnapshotWriter
from snapfn.snapshot.stages import Log, StageRunner, StartupManifest, format_stage, stderr_log


def cold_init(
    fn: SnapshotFunction, log: Log | None = stderr_log, startup: StartupManifest | None = None
) -> StartupManifest:
    """Run `fn`'s init stages; `startup` (made by the caller) holds the failed stage if one
    raises."""
    runner = StageRunner(startup or StartupManifest(kind="init", tier="cold"), log=log)
    runner.manifest.info["versions"] = _versions()
    for name, stage in fn.init_stages():
        runner.run(name, stage)
    return runner.finish(ok=True)


def write_snapshot(
    fn: SnapshotFunction, dest: Path, startup: StartupManifest, log: Log | None = stderr_log
) -> dict:
    """Write `fn`'s tier-0 snapshot to `dest`, atomically; the write is timed as a stage."""
    runner = StageRunner(startup, log=log, offset_s=startup.total_s)
    manifest: dict[str, Any] = {}
    recorded = startup.to_json()  # the init as it finished, before this stage began

    def checkpoint(figures: dict) -> None:
        with SnapshotWriter(Path(dest)) as writer:
            section = fn.write_snapshot(writer, recorded)
            manifest.update(
                tier="portable",
                function=fn.name,
                compat=compat_key(fn.device, fn.world_size),
                startup=recorded,
                **{fn.name: section},
            )
            writer.publish(manifest)
        figures["path"] = str(dest)

    runner.run("write_snapshot", checkpoint)
    return manifest


def init_and_snapshot(
    fn: SnapshotFunction, dest: Path, log: Log | None = stderr_log
) -> StartupManifest:
    startup = cold_init(fn, log)
    write_snapshot(fn, dest, startup, log)
    return startup


def restore(
    make_fn: Callable[[], SnapshotFunction],
    snapshot_dir: Path,
    *,
    rewrite_on_fallback: bool = True,
    log: Log | None = stderr_log,
) -> tuple[SnapshotFunction, StartupManifest]:
    """Restore from `snapshot_dir`, or fall back to a cold init recording the reason."""
    snapshot_dir = Path(snapshot_dir)
    fn = make_fn()
    runner = StageRunner(StartupManifest(kind="restore", tier="portable"), log=log)
    runner.manifest.info["versions"] = _versions()
    try:
        # NOTE: the environment (CUDA_MODULE_LOADING, compile-cache dirs) is set before the
        # validation below, whose compat key is the first thing to import torch.
        runner.run("runtime_env", fn.prepare_runtime)
        manifest = runner.run("validate", lambda f: _validate(f, snapshot_dir, fn))
        for name, stage in fn.restore_stages(snapshot_dir, manifest):
            runner.run(name, stage)
        return fn, runner.finish(ok=True)
    except Exception as exc:  # any failure of any stage: never serve from this snapshot
        failed = runner.manifest.stages[-1].name if runner.manifest.stages else "start"
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
        if log is not None:
            log(
                f"restore from {snapshot_dir} failed at {failed} ({reason}); falling back to a cold init"
            )
        fn.release()
    return _fallback(
        make_fn, snapshot_dir, runner.manifest, failed, reason, rewrite_on_fallback, log
    )


def _versions() -> dict[str, str]:
    import platform
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version()}
    for name in ("snapfn", "torch", "triton", "safetensors", "tokenizers", "flashinfer-python"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            continue
    return found


def _validate(figures: dict, snapshot_dir: Path, fn: SnapshotFunction) -> dict:
    manifest = validate_snapshot(snapshot_dir, compat_key(fn.device, fn.world_size), verify="sizes")
    figures["files"] = len(manifest.get("files", {}))
    return manifest


def _fallback(make_fn, snapshot_dir, failed_manifest, step, reason, rewrite, log):
    fn = make_fn()
    if getattr(fn, "source", None) is None:
        raise SnapfnError(
            f"restore failed at {step} ({reason}) and no model folder is known for a cold init"
        )
    startup = cold_init(fn, log)
    startup.tier = "cold (fallback)"
    startup.add_fallback("portable", "cold", step, reason)
    startup.info["failed_restore"] = failed_manifest.to_json()
    if rewrite:
        try:
            write_snapshot(fn, snapshot_dir, startup, log)
        except (SnapfnError, OSError) as exc:
            startup.add_fallback(
                "portable", "cold", "write_snapshot", f"could not rewrite the snapshot: {exc}"
            )
    return fn, startup


def summary(manifest: StartupManifest) -> str:
    lines = [
        f"{manifest.kind} ({manifest.tier}) {'ok' if manifest.ok else 'FAILED'} in {manifest.total_s:.3f} s"
    ]
    lines += ["  " + format_stage(s) for s in manifest.stages]
    lines += [
        f"  fallback {f['from']} → {f['to']} at {f['step']}: {f['reason']}"
        for f in manifest.fallbacks
    ]
    return "\n".join(lines)
