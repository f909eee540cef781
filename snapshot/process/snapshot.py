"""Tier 1 end to end: build a snapshot that holds a process image, and restore from it.

    init_process_snapshot(host, args, dest)     spawn the worker; it cold-inits and writes the
                                                tier-0 files into the snapshot being built; then
                                                checkpoint it into <snapshot>/process/ and publish
    restore_process_snapshot(snap, resume)      validate → criu restore → CUDA restore → resume
                                                (the worker remaps, streams weights, replays) →
                                                a Worker serving on its channel

A checkpoint that fails (criu missing or too old, no CUDA checkpoint API, a failed dump)
publishes the snapshot without its process image (tier 0) and records the step and reason in
the startup manifest. A restore that fails raises RestoreFailed after killing the worker; the
caller falls back to tier 0 with the manifest of the failed attempt.

The manifest gains: "tier": "process", "process": {images, inherit, uses_cuda, hooks,
image_bytes, memory (what moved to memory.bin, or null), regions, private_memory, seconds, host},
"replay": the greedy tokens + logprobs recorded at init.

Several ranks (`ranks` > 1: one worker per rank, e.g. the tensor-parallel LLM's): every worker
is spawned with its "rank", all initialise together, all are checkpointed at once (their
before-snapshot hooks meet, e.g. to close their communicators) into one image folder each
(`process`, `process-rank1`, …); "process_ranks" lists ranks 1… as "process" lists rank 0, and
`restore_process_snapshot(…, rank=K)` restores rank K's. Any rank's failed checkpoint publishes
the snapshot without a process image.

What a restore uses of the process section is checked before criu, the prefetch helper or the
validation stage use it (`process_section_problem`): `images` a plain folder name whose files
are listed; `inherit` one `pipe:[inode]` for each of the worker's pipes (what criu is handed as
`--inherit-fd`); `uses_cuda`, `mount_namespace` and `net_namespace` booleans; `host_pid` null or a pid (what
the image restores into, waited for while a restored copy exits); `memory` null or a listed file in
the images folder of its recorded size under criu's key; `regions` valid RegionSpecs that do
not overlap, whose files are listed, and which together fit the GPU the compat key records.
"""

from __future__ import annotations

import functools
import re
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from snapfn.snapshot.errors import IncompatibleSnapshot, RestoreFailed, SnapfnError, bad_snapshot
from snapfn.snapshot.portable.compat import check_compat, compat_key
from snapfn.snapshot.portable.format import (
    PROCESS_IMAGES,
    STREAM_VERIFIED,
    load_json,
    parse_manifest,
    read_manifest_bytes,
    relpath_problem,
    validate_snapshot,
)
from snapfn.snapshot.portable.signature import check_signature, configured
from snapfn.snapshot.process import criu
from snapfn.snapshot.process import worker_process as process
from snapfn.snapshot.process.code_identity import code_fingerprint
from snapfn.snapshot.stages import StageRecord, StageRunner, StartupManifest

if TYPE_CHECKING:
    from snapfn.snapshot.portable.publish import SnapshotWriter

Log = Callable[[str], None]
IMAGES = "process"
CHUNK_BYTES = 64 << 20
# image files a keeper is asked whether it holds (the rest, criu's small ones, are hashed here)
ASK_KEEPER_BYTES = 1 << 20
_PIPE = re.compile(r"pipe:\[[0-9]{1,20}\]")  # what /proc/PID/fd/N reads for a pipe


class ProcessRestoreFailed(RestoreFailed):
    """A tier-1 restore failed at `step`; `startup` is the manifest of the attempt."""

    def __init__(self, step: str, reason: str, startup: StartupManifest) -> None:
        super().__init__(f"process restore failed at {step}: {reason}".splitlines()[0])
        self.step, self.startup = step, startup


def init_process_snapshot(
    host: str,
    args: Mapping[str, Any],
    dest: Path,
    config: process.ProcessConfig,
    log: Log | None,
    ranks: int = 1,
) -> tuple[StartupManifest, dict[str, Any]]:
    """Build and publish a snapshot at `dest`; its tier is "process" unless the checkpoint failed.

    `args` are the host's; "root" (where the tier-0 files go) is added here, and "rank" where
    there are several `ranks` (rank 0's init reports the snapshot's section and files).
    """
    from snapfn.snapshot.portable.publish import SnapshotWriter  # not needed to restore

    dest = Path(dest)
    with SnapshotWriter(dest) as writer:
        extra = [{"rank": k} if ranks > 1 else {} for k in range(ranks)]
        workers = []
        try:
            for more in extra:
                spawn_args = {**args, **more, "root": str(writer.root)}
                workers.append(process.spawn(host, spawn_args, config, log))
            inits = [w.wait_event("initialized", config.init_timeout_s) for w in workers]
        except BaseException:
            for worker in workers:
                worker.kill()
            raise
        init = inits[0]
        startup = StartupManifest.from_json(init["startup"])
        for relpath, chunk_bytes, chunks, sha in init.get("registered", []):
            writer.register_chunked(relpath, chunk_bytes, chunks, sha)
        runner = StageRunner(startup, log=log, offset_s=startup.total_s)
        folders = [writer.root / rank_images(k) for k in range(ranks)]
        metas = _checkpoint_or_fall_back(workers, folders, config, runner, log)
        for meta, folder in zip(metas or [], folders, strict=False):
            from_worker = meta.pop("registered", [])  # e.g. a function's device memory image
            _register_images(writer, folder, skip={r[0] for r in from_worker})
            for relpath, chunk_bytes, chunks, sha in from_worker:
                writer.register_chunked(relpath, chunk_bytes, chunks, sha)
        name = init["function"]
        manifest: dict[str, Any] = {
            "tier": "process" if metas else "portable",
            "function": name,
            "compat": init["compat"],
            "startup": startup.to_json(),
            name: init.get("section", {}),
        }
        if metas:
            manifest.update(process={**metas[0], "host": host}, replay=init.get("replay"))
            if ranks > 1:
                manifest["process_ranks"] = [{**m, "host": host} for m in metas[1:]]
        runner.run("publish", lambda f: writer.publish(manifest))
    startup.tier = manifest["tier"]
    return startup, manifest


def rank_images(rank: int) -> str:
    """Rank `rank`'s image folder: `process` (rank 0, or the only one), `process-rankK`."""
    return IMAGES if rank == 0 else f"{IMAGES}-rank{rank}"


def _checkpoint_or_fall_back(
    workers, folders: list[Path], config, runner, log
) -> list[dict[str, Any]] | None:
    """Every worker checkpointed at once (their hooks may meet: communicators closed
    together), or None with every worker killed and the reason recorded."""
    found = criu.check(config.criu)
    try:
        if not found.ok:
            raise RestoreFailed(found.reason)
        return runner.run("checkpoint", lambda f: _checkpoint_all(workers, folders, config, log, f))
    except RestoreFailed as exc:
        for worker in workers:
            worker.kill()
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
        runner.manifest.add_fallback("process", "portable", "checkpoint", str(exc))
        if log is not None:
            log(f"no process image ({exc}); publishing the portable snapshot only")
        return None


def _checkpoint_all(workers, folders: list[Path], config, log, figures: dict) -> list[dict]:
    """Each worker's checkpoint on its own thread; the first failure's RestoreFailed after all
    ended (a worker whose checkpoint failed is killed, so the others' hooks never wait on it
    past its death)."""
    ranks, lock = [{} for _ in workers], threading.Lock()
    with ThreadPoolExecutor(len(workers), thread_name_prefix="snapfn-checkpoint") as pool:
        jobs = [
            pool.submit(_checkpoint, w, folder, config, log, ranks[k], lock)
            for k, (w, folder) in enumerate(zip(workers, folders, strict=True))
        ]
        done, errors = [], []
        for job in jobs:
            try:
                done.append(job.result())
            except RestoreFailed as exc:
                errors.append(exc)
                for worker in workers:  # its peers would wait in their hooks for it
                    worker.kill()
    if errors:
        raise errors[0]
    figures.update(ranks[0], **({"ranks": len(workers)} if len(workers) > 1 else {}))
    return done


def _checkpoint(worker, images: Path, config, log, figures: dict, lock=None) -> dict[str, Any]:
    meta = process.checkpoint(worker, images, config, log, lock)
    figures.update(meta["seconds"], image_bytes=meta["image_bytes"], **meta["worker"])
    if meta["memory"]:  # what left criu's image for memory.bin (snapshot/process/image_memory.py)
        figures.update(
            moved_bytes=meta["memory"]["moved_bytes"], moved_pieces=meta["memory"]["pieces"]
        )
    for stage, found in meta["private_memory"].items():  # the census: where the image comes from
        if "private_bytes" in found:
            figures[f"private_bytes_{stage}"] = found["private_bytes"]
    return meta


def _register_images(writer: SnapshotWriter, images: Path, skip: set[str]) -> None:
    """Record chunk digests for the process image files now (a restore hashes them before criu
    starts: `_validate`); `pull` and `validate_snapshot(verify="full")` check every chunk too."""
    from snapfn.snapshot.portable.digests import DigestRange, num_chunks, run_parallel, sha256_range

    root = writer.root
    for path in sorted(p for p in images.rglob("*") if p.is_file() and p.stat().st_size):
        rel, size = str(path.relative_to(root)), path.stat().st_size
        if rel in skip:  # the worker digested it as it wrote it
            continue
        ranges = [
            DigestRange(
                rel, False, i, i * CHUNK_BYTES, min(CHUNK_BYTES, size - i * CHUNK_BYTES), ""
            )
            for i in range(num_chunks(size, CHUNK_BYTES))
        ]
        digests = run_parallel(lambda r: sha256_range(root, r), ranges, None)
        writer.register_chunked(rel, CHUNK_BYTES, digests, None)


def has_process_image(snapshot_dir: Path) -> bool:
    """Whether the snapshot says it holds a process image (read cheaply, with the manifest's
    bounds, not validated: a special file there reads as no)."""
    try:
        manifest = load_json(read_manifest_bytes(snapshot_dir))
    except (SnapfnError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("tier") == "process"


def restore_process_snapshot(
    snapshot_dir: Path,
    resume: Mapping[str, Any],
    *,
    device: str,
    config: process.ProcessConfig,
    log: Log | None,
    world_size: int = 1,
    accept: Callable[[dict[str, Any]], None] | None = None,
    aside: Callable[[], None] | None = None,
    rank: int = 0,
    on_restored: Callable[[int], None] | None = None,
) -> tuple[process.Worker, StartupManifest, dict[str, Any]]:
    """Restore the worker (`rank`'s, of a snapshot of several); RestoreFailed (its manifest
    in `.startup`) on any failure.

    `accept(manifest)` runs in the validate stage: the caller's own refusal (e.g. a snapshot of
    another function) raises there. `aside()` is called once the CUDA restore is under way (or
    the worker resumed, without CUDA), to start the caller's own work beside it: Python work
    started earlier holds the GIL while the restore is being launched.
    `on_restored(pid)` is told the restored worker's pid then (a restore of several ranks kills
    them all when one fails, before they wait for each other).
    Validation (the manifest, and every image file this rank reads hashed chunk by chunk) ends
    before criu starts, since a restored task runs at once; the compat key (cuInit) and the
    prefetch helper run beside it and criu, the worker resumes only once the compat key
    matches (stage "gate"), and a failure is reported as the validate step's. With a keeper
    (snapshot/keeper/daemon.py) answering, the compat key's GPU fields, the regions and the
    CUDA restore are the keeper's."""
    snapshot_dir = Path(snapshot_dir)
    runner = StageRunner(StartupManifest(kind="restore", tier="process"), log=log)
    # NOTE: without a keeper the compat key needs cuInit (~0.3 s on the H200), which the CUDA
    # checkpoint calls need anyway: it runs beside the criu restore, and the worker resumes
    # only if it matches.
    pool = ThreadPoolExecutor(max_workers=3, thread_name_prefix="snapfn-restore-side")
    current = pool.submit(_current_compat, device, world_size, config)
    validated = pool.submit(
        runner.run,
        "validate",
        lambda f: _validate(snapshot_dir, accept, rank, config.keeper_address, f),
    )
    # what the prefetch helper starts on, unvalidated (it checks what it fills by its sums)
    unchecked = rank_view(_read_manifest(snapshot_dir), rank)
    prefetching = None
    if device.startswith("cuda"):  # NOTE: beside criu too (spawning took 0.04 s)
        prefetch = functools.partial(_start_prefetch, unchecked, snapshot_dir, config)
        prefetching = pool.submit(runner.run, "prefetch", prefetch)
    pool.shutdown(wait=False)

    def resume_message() -> dict[str, Any]:  # sent once criu restored the worker
        helper = prefetching.result() if prefetching is not None else None
        regions = {"regions": helper.address} if helper is not None else {}
        return {**resume, **regions, "snapshot_dir": str(snapshot_dir.absolute())}

    try:
        # NOTE: criu starts only once every image file is hashed: a restored task runs as soon
        # as criu has restored it (its code and heap from the image), so a tampered image must
        # be refused before criu maps any of it
        meta = validated.result()["process"]

        def gate(figures: dict) -> None:
            if on_restored is not None:
                on_restored(runner.manifest.stage("criu_restore").figures["pid"])
            manifest = validated.result()
            try:
                check_compat(manifest["compat"], current.result())
            except IncompatibleSnapshot as exc:
                raise IncompatibleSnapshot(f"snapshot {snapshot_dir}: {exc}") from None

        worker, restored = process.restore(
            snapshot_dir / meta["images"],
            meta,
            resume_message,
            config,
            runner.run,
            log,
            gate,
            beside=aside,
        )
    except Exception as exc:
        # NOTE: the stage that failed, not the last one recorded: validate, on a side thread,
        # may finish after criu failed
        failed_stages = [s.name for s in runner.manifest.stages if not s.ok]
        cause, failed = exc, failed_stages[-1] if failed_stages else "start"
        if validated.done() and validated.exception() is not None:
            cause, failed = validated.exception(), "validate"  # the root cause of what followed
        runner.finish(ok=False)
        raise ProcessRestoreFailed(failed, str(cause), runner.manifest) from cause
    finally:
        _close_prefetch(prefetching)  # the worker has taken its regions or made its own by now
    _merge_worker_stages(runner.manifest, restored)
    return worker, runner.finish(ok=True), validated.result()


def _read_manifest(snapshot_dir: Path) -> dict[str, Any]:
    """manifest.json shape-checked (format.parse_manifest) and, with a snapshot key configured,
    its signature checked, its files not yet verified ({} when any of that fails: criu and the
    helper then wait for validate, which says why)."""
    try:
        raw = read_manifest_bytes(snapshot_dir)
        check_signature(snapshot_dir, configured(), raw)
        return parse_manifest(snapshot_dir, raw)
    except SnapfnError:
        return {}


def process_section_problem(manifest: dict[str, Any]) -> str | None:
    """Why the process section of a (shape-checked) manifest may not be used, or None."""
    meta = manifest.get("process")
    if manifest.get("tier") != "process" or not isinstance(meta, dict):
        return "holds no process image (tier is not 'process')"
    files = manifest.get("files", {})
    images = meta.get("images")
    if not isinstance(images, str) or "/" in images or relpath_problem(images):
        return f"its process image folder {images!r:.64} is not a plain folder name"
    if not any(relpath.startswith(f"{images}/") for relpath in files):
        return f"no file of its process image folder {images!r} is listed"
    inherit = meta.get("inherit")
    if not isinstance(inherit, dict) or sorted(inherit) != sorted(process.PIPES):
        return f"its process image does not inherit one pipe each for {process.PIPES}"
    for name, key in inherit.items():
        if not isinstance(key, str) or not _PIPE.fullmatch(key):
            return f"its process image inherits {name} as {key!r:.64}, not as pipe:[inode]"
    for key in ("uses_cuda", "mount_namespace", "net_namespace"):
        if not isinstance(meta.get(key, False), bool):
            return f"its process section's {key} is {meta[key]!r:.64}, not true or false"
    if "uses_cuda" not in meta:
        return "its process section does not say whether the worker uses CUDA"
    pid = meta.get("host_pid")
    if pid is not None and (type(pid) is not int or not 0 < pid < 1 << 22):
        return f"its process section's host_pid is {pid!r:.64}, not a pid"
    code = meta.get("code")
    if code != code_fingerprint():
        return (
            f"its process image holds other snapfn code (fingerprint {str(code)[:12]!r}, "
            f"installed {code_fingerprint()[:12]!r}): it restores from its portable tier"
        )
    return _memory_problem(meta.get("memory"), images, files) or _regions_problem(
        meta.get("regions", []), files, manifest.get("compat", {})
    )


def _memory_problem(memory: Any, images: str, files: dict[str, Any]) -> str | None:
    """What moved out of criu's image (image_memory.MovedMemory), or null."""
    from snapfn.snapshot.process.image_memory import MEMORY_KEY

    if memory is None:
        return None
    if not isinstance(memory, dict):
        return "its process image's memory is not a JSON object"
    name, entry = memory.get("file"), files.get(f"{images}/{memory.get('file')}")
    if not isinstance(name, str) or "/" in name or relpath_problem(name) or entry is None:
        return f"its process image's memory file {name!r:.64} is not a listed image file"
    if STREAM_VERIFIED.fullmatch(f"{images}/{name}"):  # a name validation does not hash
        return f"its process image's memory file {name!r:.64} has a device memory file's name"
    if memory.get("key") != MEMORY_KEY:
        return f"its process image's memory key is {memory.get('key')!r:.64}, not {MEMORY_KEY!r}"
    if memory.get("file_bytes") != entry["size"]:
        return (
            f"its process image's memory file is {entry['size']} bytes, its record says otherwise"
        )
    return None


def _regions_problem(docs: Any, files: dict[str, Any], compat: dict[str, Any]) -> str | None:
    from snapfn.snapshot.keeper.region_prefetch import RegionSpec

    try:
        specs = RegionSpec.list_from_json(docs)
    except ValueError as exc:
        return f"its process image's regions: {exc}"
    for spec in specs:
        if spec.fill == "file" and spec.path not in files:
            return f"region {spec.name!r} is filled from {spec.path!r}, which is not listed"
        if spec.fill == "file" and spec.offset > files[spec.path]["size"]:
            return f"region {spec.name!r} starts past the end of {spec.path!r}"
    total, memory = sum(s.nbytes for s in specs), compat.get("gpu_total_memory_bytes")
    if specs and isinstance(memory, int) and total > memory:
        return f"its regions take {total} bytes, more than the GPU's {memory}"
    return None


def _close_prefetch(prefetching) -> None:
    if prefetching is None:
        return
    try:
        helper = prefetching.result()
    except Exception:  # noqa: BLE001 - a helper that never started has nothing to close
        return
    if helper is not None:
        helper.close()


def _start_prefetch(
    manifest: dict[str, Any], snapshot_dir: Path, config: process.ProcessConfig, figures
):
    """Spawn the helper that makes and fills a CUDA worker's regions while criu restores it
    (snapshot/keeper/region_prefetch.py), or None — the worker then does it after its restore — when
    it is off or the (unvalidated) manifest records no regions (the reason goes in the figures)."""
    from snapfn.snapshot.keeper.client import KeeperPrefetch
    from snapfn.snapshot.keeper.region_prefetch import PrefetchHelper, RegionSpec, prefetch_doc

    if config.prefetch == "off":
        figures["skipped"] = "SNAPFN_PROCESS_PREFETCH=off"
        return None
    problem = process_section_problem(manifest) if manifest else "unreadable manifest"
    if problem is not None:  # validate says it too
        figures["skipped"] = f"not started on a process section that fails its checks: {problem}"
        return None
    specs = RegionSpec.list_from_json(manifest["process"].get("regions", []))
    if not specs:
        figures["skipped"] = "the process image records no regions"
        return None
    figures.update(regions=len(specs), region_bytes=sum(s.nbytes for s in specs))
    figures.update(threads=config.prefetch_threads, read=config.prefetch_read)
    doc = prefetch_doc(
        specs,
        snapshot_dir.absolute(),
        config.restore_timeout_s,
        num_threads=config.prefetch_threads,
        read=config.prefetch_read,
        pinned=config.pinned_socket,
    )
    if config.keeper_address:
        try:
            helper = KeeperPrefetch(config.keeper_address, doc)
        except RestoreFailed as exc:  # no keeper, or it refused: a helper of our own
            figures["keeper"] = str(exc)
        else:
            figures["by"] = "keeper"
            return helper
    return PrefetchHelper(doc)


def _current_compat(device: str, world_size: int, config: process.ProcessConfig) -> dict:
    """This machine's compat key. On CUDA, the GPU's fields from the keeper when one answers
    (it does the CUDA restore too: nothing here needs the driver), else from the driver here."""
    if device.startswith("cuda") and config.keeper_address:
        from snapfn.snapshot.keeper import client as keeper

        try:
            ask = functools.partial(keeper.device_fields, config.keeper_address)
            return compat_key(device, world_size, light=True, gpu_fields=ask)
        except RestoreFailed:
            pass  # no keeper: the driver here
    key = compat_key(device, world_size, light=True)
    if device.startswith("cuda"):
        from snapfn.snapshot.cuda import checkpoint as cuda_checkpoint

        cuda_checkpoint.available()  # cuInit now, not on the restore's critical path
    return key


def rank_view(manifest: dict[str, Any], rank: int) -> dict[str, Any]:
    """`manifest` with rank `rank`'s process section as its "process" (rank 0's is); a rank the
    manifest has no image for reads as none (`process_section_problem` says so)."""
    if rank == 0 or not manifest:
        return manifest
    ranks = manifest.get("process_ranks")
    entry = ranks[rank - 1] if isinstance(ranks, list) and 0 < rank <= len(ranks) else None
    return {**manifest, "process": entry, "tier": manifest.get("tier") if entry else None}


def _validate(
    snapshot_dir: Path,
    accept: Callable[[dict[str, Any]], None] | None,
    rank: int = 0,
    keeper_address: str = "",
    figures: dict | None = None,
) -> dict:
    # NOTE: every image file this rank's restore reads is hashed here, before criu starts
    # (restore_process_snapshot): a tampered image is refused before any of it runs. Those a
    # keeper hashed and holds unchanged (snapshot/keeper/verified_images.py) are not hashed again.
    mine = f"{rank_images(rank)}/"
    raw = read_manifest_bytes(snapshot_dir)
    asked_at = time.perf_counter()
    held = _held_by_keeper(snapshot_dir, raw, mine, keeper_address)
    checked_at = time.perf_counter()
    if figures is not None and keeper_address:
        figures["images_held_by_keeper"] = len(held)
        figures["keeper_s"] = round(checked_at - asked_at, 4)

    def not_hashed(path: str) -> bool:  # the other ranks' images, and those the keeper holds
        return (path.startswith(PROCESS_IMAGES) and not path.startswith(mine)) or path in held

    checked = validate_snapshot(snapshot_dir, None, "sizes", unread=not_hashed, manifest_bytes=raw)
    if figures is not None:  # the signature, listing and the hashing of what is not held
        figures["check_s"] = round(time.perf_counter() - checked_at, 4)
    manifest = rank_view(checked, rank)
    problem = process_section_problem(manifest)
    if problem is None and manifest["process"]["images"] != mine.rstrip("/"):
        # NOTE: the folder hashed above is the one criu is given: no other rank's, unhashed
        problem = f"its process image folder is {manifest['process']['images']!r:.64}, not {mine}"
    if problem is not None:
        raise bad_snapshot(snapshot_dir, problem)
    if f"{manifest['process']['images']}/inventory.img" not in manifest["files"]:
        raise bad_snapshot(snapshot_dir, "the process image has no inventory.img")
    if accept is not None:
        accept(manifest)
    return manifest


def _held_by_keeper(snapshot_dir: Path, raw: bytes, mine: str, keeper_address: str) -> set[str]:
    """The image files under `mine` of at least ASK_KEEPER_BYTES that the keeper at
    `keeper_address` hashed and holds unchanged (none without a keeper, or when the manifest
    does not parse: validation then says why)."""
    if not keeper_address:
        return set()
    from snapfn.snapshot.keeper import client as keeper
    from snapfn.snapshot.keeper.verified_images import ask

    try:
        files = parse_manifest(snapshot_dir, raw)["files"]
    except SnapfnError:
        return set()
    costly = [
        p
        for p, entry in files.items()
        if p.startswith(mine)
        and entry["size"] >= ASK_KEEPER_BYTES
        and not STREAM_VERIFIED.fullmatch(p)
    ]
    if not costly:
        return set()
    root = Path(snapshot_dir).absolute()
    found = keeper.verified_images(keeper_address, ask(root, files, costly))
    return {str(Path(p).relative_to(root)) for p in found}


def _merge_worker_stages(manifest: StartupManifest, restored: dict[str, Any]) -> None:
    """The worker's own timed stages (remap, stream_weights, replay_check), on our time axis."""
    offset = float(restored.get("t0", manifest.started_at)) - manifest.started_at
    for stage in restored.get("stages", []):
        record = StageRecord(**stage)
        record.start_s += offset
        record.name = f"worker.{record.name}"
        manifest.stages.append(record)
    manifest.info["identity"] = restored.get("identity", {})
