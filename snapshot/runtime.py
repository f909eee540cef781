"""Drive a function through cold init, checkpoint and restore, with fallback.

    init_and_snapshot(fn, dest)  cold init (timed stages) → write a tier-0 snapshot atomically
    restore(make_fn, snap)       validate → restore stages → up; on any failure: release the
                                 half-restored function, record why, cold init from a
                                 trustworthy source instead (and write a fresh snapshot)

Never serves from a snapshot that failed a check: a function is returned only after every
stage of its restore (the replay check included) passed, or after a cold init.

Validation (stage `validate`): the snapshot format's checks (portable/format.py: listing, sizes,
digests of small files, the compat key), then the manifest must hold the function's own section
(a JSON object under `fn.name`, and `function`, when recorded, must be `fn.name`), then the
function's `check_manifest(snapshot_dir, manifest)` when it has one: every field of its section
a restore uses, checked (type, range, consistency) before any stage uses it.

Fallback sources. A cold init after a refusal reads from what `fallback(recorded)` makes —
`recorded` being the snapshot's manifest when it can be read and shape-checked, else None —
which is either a source the user named (a model folder, a function spec) or a source the
manifest records whose content the function verifies against the manifest before it serves
(the LLM: the loaded model's content hash, checked right after its weights load). Never a
path taken from the snapshot unverified. When there is no such source, `fallback` raises
`NoTrustedSource` with the reason; `restore` then raises `NoTrustedSource` naming the refusal
and that reason, on one line, without cold-initialising, serving or rewriting anything — a
server should then stop (an orchestrator restarts it) rather than wait for a fix that cannot
come. A fallback from a recorded source whose init fails before that source was verified (its
`source_trusted` still False) raises `NoTrustedSource` the same way. The snapshot is
rewritten only from the trustworthy source (`rewrite_on_fallback`).

A snapshot still arriving (`arriving`, an `Arriving`: store/overlap.py's pull from S3 in
flight) is restored while it is pulled into `snapshot_dir`: stage `download_files` waits until
every file but the streamed ones is verified there, `validate` checks the snapshot against the
manifest the pull fetched (manifest.json is written only when the pull publishes), the
function's stages follow the pull (`fn.arriving` is set for them: a streamed file's reads wait
on its verified chunks), and a last stage `download` waits until the pull has passed every
check and published the snapshot. A failure of the pull fails the stage that waited on it, and
the restore falls back as for any refusal; the pull's folder is never rewritten
(`rewrite_on_fallback` does not apply).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from snapfn.snapshot.errors import InitFailed, SnapfnError, bad_snapshot, one_line
from snapfn.snapshot.function import SnapshotFunction
from snapfn.snapshot.portable import pagecache
from snapfn.snapshot.portable.compat import LAYOUT_FIELDS, cache_drift, compat_key
from snapfn.snapshot.portable.format import (
    PROCESS_IMAGES,
    parse_manifest,
    read_manifest_bytes,
    validate_snapshot,
)
from snapfn.snapshot.portable.pagecache import ReadAhead
from snapfn.snapshot.portable.publish import SnapshotWriter
from snapfn.snapshot.stages import Log, StageRunner, StartupManifest, format_stage, stderr_log

Fallback = Callable[[dict[str, Any] | None], SnapshotFunction]


class Arriving(Protocol):
    """A snapshot being pulled into the folder a restore reads (store/overlap.py)."""

    uri: str  # where it is pulled from
    manifest_bytes: bytes  # the manifest.json the pull fetched, not yet in the folder

    def wait_files(self, figures: dict[str, Any]) -> None:
        """Block until every file but the streamed ones is verified in the folder."""

    def waiter(self, relpath: str) -> Any:
        """`wait_for(lo, hi)` on a streamed file's bytes (layout/streamer.py's `arrivals`)."""

    def finish(self, figures: dict[str, Any]) -> None:
        """Stop reading the folder; block until the pull has published (or raise its error)."""

    def release(self) -> None:
        """Stop reading the folder (a failed restore): the pull goes on without its reader."""


class NoTrustedSource(InitFailed):
    """A snapshot was refused and nothing trustworthy is left to cold-init from (no source was
    named, and none recorded in the snapshot could be verified). Permanent for this process:
    the same configuration fails the same way, so a server reports it and exits."""

    code = "no_trusted_source"


def holds_files(folder: Path | None) -> bool:
    """Whether `folder` is a folder with something in it (a snapshot to restore, not one to
    write)."""
    return folder is not None and Path(folder).is_dir() and any(Path(folder).iterdir())


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
    fallback: Fallback | None = None,
    rewrite_on_fallback: bool = True,
    log: Log | None = stderr_log,
    arriving: Arriving | None = None,
) -> tuple[SnapshotFunction, StartupManifest]:
    """Restore from `snapshot_dir`, or fall back to a cold init recording the reason.

    `fallback(recorded)` makes the function the fallback cold-initialises (see the module
    docstring); by default `make_fn()`, whose `source` the caller named (None: no fallback).
    `arriving`: the snapshot is still being pulled into `snapshot_dir` (module docstring).
    Raises NoTrustedSource when the restore failed and there is nothing trustworthy to fall
    back to.
    """
    snapshot_dir = Path(snapshot_dir)
    fn = make_fn()
    runner = StageRunner(StartupManifest(kind="restore", tier="portable"), log=log)
    runner.manifest.info["versions"] = _versions()
    raw = arriving.manifest_bytes if arriving is not None else None
    ahead = _read_ahead(fn, snapshot_dir, arriving)
    try:
        # NOTE: the environment (CUDA_MODULE_LOADING, compile-cache dirs) is set before the
        # validation below, whose compat key is the first thing to import torch.
        runner.run("runtime_env", fn.prepare_runtime)
        if arriving is not None:
            runner.run("download_files", arriving.wait_files)
            fn.arriving = arriving
        manifest = runner.run("validate", lambda f: _validate(f, snapshot_dir, fn, raw))
        if fn.cache_drift is not None:  # set by _validate
            runner.manifest.add_fallback(
                "portable", "portable, caches dropped", "validate", fn.cache_drift
            )
        for name, stage in fn.restore_stages(snapshot_dir, manifest):
            runner.run(name, stage)
        if arriving is not None:
            runner.run("download", arriving.finish)
        if ahead is not None:
            runner.manifest.info["read_ahead"] = ahead.figures()
        return fn, runner.finish(ok=True)
    except Exception as exc:  # any failure of any stage: never serve from this snapshot
        failed = runner.manifest.stages[-1].name if runner.manifest.stages else "start"
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
        if ahead is not None:
            ahead.stop()  # what it read is not trusted for anything: the stream checks bytes
            runner.manifest.info["read_ahead"] = ahead.figures()
        if arriving is not None:
            arriving.release()
        join = getattr(fn, "join_failed_restore", None)
        if join is not None:  # one rank of several: the others fall back with it
            join(reason)
        fn.release()
    refused = f"restore from {snapshot_dir} failed at {failed} ({reason})"
    cold = _fallback_function(make_fn, fallback, _recorded_manifest(snapshot_dir, raw), refused)
    if log is not None:
        log(f"{refused}; falling back to a cold init from {_source(cold)}")
    startup = _cold_init_instead(cold, refused, log)
    startup.tier = "cold (fallback)"
    startup.add_fallback("portable", "cold", failed, reason)
    startup.info["failed_restore"] = runner.manifest.to_json()
    if rewrite_on_fallback and arriving is None:
        _rewrite(cold, snapshot_dir, startup, log)
    return cold, startup


def _read_ahead(fn: SnapshotFunction, snapshot_dir: Path, arriving) -> ReadAhead | None:
    """The files the restore of `fn` will read (its `restore_reads`), started into the page
    cache while the first stages run (nothing while the snapshot is still arriving: the pull
    writes them). Advice only: the bytes are checked where the restore reads them."""
    reads = getattr(fn, "restore_reads", None)
    if reads is None or arriving is not None:
        return None
    paths = reads(snapshot_dir)
    io_class = "idle" if getattr(fn, "restore_read_priority", "normal") == "idle" else None
    return pagecache.read_ahead(paths, io_class=io_class) if paths else None


def _fallback_function(make_fn, fallback, recorded, refused) -> SnapshotFunction:
    """The function to cold-init from a trustworthy source (`recorded`: the refused snapshot's
    manifest, or None); NoTrustedSource (one line, the refusal and why no source is
    trustworthy) when there is none."""
    try:
        if fallback is not None:
            return fallback(recorded)
        fn = make_fn()
        if getattr(fn, "source", None) is None:
            raise NoTrustedSource("no source was named to cold-init from")
        return fn
    except NoTrustedSource as exc:  # NOTE: not logged here: the one line is the caller's to say
        message = f"{refused}, and there is no trustworthy source for a cold init: {exc}"
        raise NoTrustedSource(one_line(message)) from None


def _recorded_manifest(snapshot_dir: Path, raw: bytes | None) -> dict[str, Any] | None:
    """The manifest (`raw`, else the folder's), shape-checked and, with a snapshot key
    configured, signed by it, for a fallback to verify a recorded source against; None
    otherwise (a manifest the key did not sign names no source to trust)."""
    from snapfn.snapshot.portable.signature import check_signature, configured

    try:
        raw = read_manifest_bytes(snapshot_dir) if raw is None else raw
        check_signature(snapshot_dir, configured(), raw)
        return parse_manifest(snapshot_dir, raw)
    except SnapfnError:
        return None


def _source(fn: SnapshotFunction) -> str:
    return str(getattr(fn, "source", None) or "its source")


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


def _validate(figures: dict, snapshot_dir: Path, fn: SnapshotFunction, raw: bytes | None) -> dict:
    from snapfn.snapshot.portable.signature import configured

    key = configured()
    # NOTE: the layout's fields need no GPU: the files are checked against them while CUDA's
    # init (begun in runtime_env) goes on, and the GPU's fields are asked for after
    layout = compat_key(fn.device, fn.world_size, light=True, gpu_fields=lambda _: {})
    manifest = validate_snapshot(
        snapshot_dir,
        {name: layout[name] for name in LAYOUT_FIELDS},
        verify="sizes",
        key=key,
        compat_fields=LAYOUT_FIELDS,
        manifest_bytes=raw,
        unread=lambda path: path.startswith(PROCESS_IMAGES),  # tier 0 reads no process image
    )
    fn.cache_drift = cache_drift(manifest["compat"], _compat_here(fn))
    figures["files"] = len(manifest["files"])
    figures["caches"] = "kept" if fn.cache_drift is None else f"dropped: {fn.cache_drift}"
    # NOTE: said in the manifest, since a snapshot's compile caches run as code
    figures["signature"] = f"{key.scheme} key {key.key_id}" if key else "not checked (no key)"
    recorded = manifest.get("function", fn.name)
    if recorded != fn.name:
        raise bad_snapshot(snapshot_dir, f"holds function {recorded!r:.80}, not {fn.name!r}")
    if not isinstance(manifest.get(fn.name), dict):
        raise bad_snapshot(snapshot_dir, f"its manifest has no {fn.name!r} section")
    check = getattr(fn, "check_manifest", None)
    if check is not None:
        check(snapshot_dir, manifest)
    return manifest


def _compat_here(fn: SnapshotFunction) -> dict[str, Any]:
    """This machine's compat key for `fn`: from the GPU fields its CUDA init read on a side
    thread where it has them (`gpu_fields`; CUDA's context is still being made), else through
    torch (which waits for the context, holding the GIL)."""
    ask = getattr(fn, "gpu_fields", None)
    if ask is not None and fn.device.startswith("cuda"):
        from snapfn.snapshot.cuda.early_context import device_index

        fields = ask(device_index(fn.device))
        if fields is not None:
            return compat_key(fn.device, fn.world_size, light=True, gpu_fields=lambda _: fields)
    return compat_key(fn.device, fn.world_size)


def _cold_init_instead(fn: SnapshotFunction, refused: str, log: Log | None) -> StartupManifest:
    """The fallback's cold init. A function whose `source_trusted` is False (a recorded source
    it verifies during its init) that fails before it verified is no trustworthy source:
    NoTrustedSource, whatever stopped it."""
    try:
        return cold_init(fn, log)
    except Exception as exc:
        fn.release()
        if getattr(fn, "source_trusted", True) is not False:
            raise
        reason = f"{type(exc).__name__}: {exc}"
        message = (
            f"{refused}, and its recorded source {_source(fn)} could not be verified: {reason}"
        )
        raise NoTrustedSource(one_line(message)) from None
    except BaseException:
        fn.release()
        raise


def _rewrite(fn: SnapshotFunction, snapshot_dir: Path, startup: StartupManifest, log) -> None:
    """A fresh snapshot from the fallback's (trustworthy) source; a failed write is recorded."""
    try:
        write_snapshot(fn, snapshot_dir, startup, log)
    except (SnapfnError, OSError) as exc:
        startup.add_fallback(
            "portable", "cold", "write_snapshot", f"could not rewrite the snapshot: {exc}"
        )


def summary(manifest: StartupManifest, stages: bool = True) -> str:
    """The manifest's headline, its stages (unless they were logged as they ran) and its
    fallbacks."""
    lines = [
        f"{manifest.kind} ({manifest.tier}) {'ok' if manifest.ok else 'FAILED'} in {manifest.total_s:.3f} s"
    ]
    lines += ["  " + format_stage(s) for s in manifest.stages] if stages else []
    lines += [
        f"  fallback {f['from']} → {f['to']} at {f['step']}: {f['reason']}"
        for f in manifest.fallbacks
    ]
    return "\n".join(lines)
