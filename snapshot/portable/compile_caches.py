"""Compile caches: where Triton, inductor, flashinfer and DeepGEMM write what they compile, set
before any heavy import (a function's `runtime_env` stage), and those caches carried into and
out of a portable snapshot, so that a restore compiles nothing.

# NOTE: these variables only take effect if set before torch / triton / flashinfer are
# imported and before CUDA is initialised; this module imports none of them at module level.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from snapfn.snapshot.errors import BadSnapshot, bad_snapshot
from snapfn.snapshot.imports import import_for_startup
from snapfn.snapshot.portable.digests import digest_ranges, sha256_fd
from snapfn.snapshot.portable.format import MANIFEST

# cache name → environment variable that points the library at it
COMPILE_CACHES = {
    "triton": "TRITON_CACHE_DIR",
    "inductor": "TORCHINDUCTOR_CACHE_DIR",
    "flashinfer": "FLASHINFER_WORKSPACE_BASE",  # JIT into <it>/.cache/flashinfer (jit/env.py)
    "deepgemm": "DG_JIT_CACHE_DIR",
}


def cache_dirs(cache_dir: Path) -> dict[str, Path]:
    return {name: Path(cache_dir) / "compile" / name for name in COMPILE_CACHES}


def set_environment(cache_dir: Path) -> None:
    """Point every compile cache at its folder under `cache_dir` (made here); lazy CUDA module
    loading unless the environment says otherwise. Imports nothing."""
    os.environ.setdefault("CUDA_MODULE_LOADING", "LAZY")
    for name, path in cache_dirs(cache_dir).items():
        path.mkdir(parents=True, exist_ok=True)
        os.environ[COMPILE_CACHES[name]] = str(path)


def prepare(cache_dir: Path, device: str) -> dict:
    """Set the environment, then import torch (the collector paused, its objects frozen after:
    `snapshot.imports`) and init CUDA, both timed; the CUDA context is made on a side thread
    meanwhile (`prepare_deferred`)."""
    figures, pending = prepare_deferred(cache_dir, device)
    if pending is not None:
        figures.update(pending.finish())
    return figures


class PendingCuda:
    """A CUDA init begun by `prepare_deferred`: `finish()` before the first CUDA call."""

    def __init__(self, device: str) -> None:
        from snapfn.snapshot.cuda.early_context import EarlyContext

        self.device = device
        self.early = EarlyContext.start(device)

    def finish(self) -> dict:
        """Wait for the context, then torch's CUDA init on it; the figures (`cuda_init_s`:
        this call's seconds, the wait included)."""
        import torch

        start = time.perf_counter()
        figures = self.early.wait()
        torch.cuda.init()
        torch.empty(1, device=self.device)
        figures["cuda_init_s"] = round(time.perf_counter() - start, 3)
        return figures


def prepare_deferred(
    cache_dir: Path, device: str, before_torch: Callable[[], None] | None = None
) -> tuple[dict, PendingCuda | None]:
    """`prepare` with CUDA's init left to the caller: on CUDA the device's context is made on a
    side thread (`snapshot/cuda/early_context.py`) from before torch's import, and the caller
    calls `finish()` on the `PendingCuda` returned before its first CUDA call (None on CPU).
    `before_torch` runs once the caches' variables are set, before torch's import: where to
    start other work that needs neither torch nor CUDA."""
    set_environment(cache_dir)  # NOTE: first: CUDA_MODULE_LOADING is read by cuInit
    pending = PendingCuda(device) if device.startswith("cuda") else None
    if before_torch is not None:
        before_torch()
    already = "torch" in sys.modules
    import_torch_s = import_for_startup(["torch"])
    figures = {"import_torch_s": round(import_torch_s, 3), "torch_preloaded": already}
    figures["cache_files"] = count_cache_files(cache_dir)
    return figures, pending


def count_cache_files(cache_dir: Path) -> int:
    return sum(
        sum(1 for p in d.rglob("*") if p.is_file())
        for d in cache_dirs(cache_dir).values()
        if d.is_dir()
    )


@contextmanager
def compiles_counted(cache_dir: Path, figures: dict) -> Iterator[None]:
    """Around a stage's work: `figures["compiled_files"]`, the compile-cache files it added
    (what it JIT-compiled; a restore must add none)."""
    before = count_cache_files(cache_dir)
    yield
    figures["compiled_files"] = count_cache_files(cache_dir) - before


def save_caches(cache_dir: Path, dest: Path) -> dict[str, int]:
    """Copy each non-empty compile cache into `dest/<name>`; returns files per cache."""
    saved = {}
    for name, path in cache_dirs(cache_dir).items():
        files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else []
        if files:
            shutil.copytree(path, dest / name, dirs_exist_ok=True)
            saved[name] = len(files)
    return saved


def restore_caches(src: Path, cache_dir: Path, listed: dict[str, Any] | None = None) -> int:
    """Copy a snapshot's caches into the local cache dir (before any kernel import): the files
    it lacks, the number copied.

    Only regular files are copied, each opened without following a link and without blocking
    (BadSnapshot, one line, for a symlink, FIFO, socket or device found there: the caches are
    code Triton and inductor load). With `listed` (the manifest's "files", their digests
    checked by the validation before), each file copied is hashed as it is copied and installed
    only when those bytes are the listed ones: a file changed or added since the validation is
    refused, never planted.

    NOTE: a file already there is never written over: caches are keyed by content, and a
    running process (a restored worker) may have it mapped, which a rewrite would corrupt.
    """
    if src.is_symlink():
        raise _refused(src, "caches", "is a symlink")
    if not src.is_dir():
        return 0
    count = 0
    for name, path in cache_dirs(cache_dir).items():
        for relpath in _regular_files(src, name):
            dest = path / relpath
            if dest.exists():
                continue
            entry = None if listed is None else _listed_entry(src, listed, f"{name}/{relpath}")
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
            try:
                _copy_checked(src, f"{name}/{relpath}", tmp, entry)
                os.replace(tmp, dest)  # NOTE: a reader never sees half a file
            finally:
                tmp.unlink(missing_ok=True)
            count += 1
    return count


def _regular_files(src: Path, name: str) -> list[str]:
    """The files under `src/name`, relative to it, sorted; BadSnapshot for anything but a
    regular file or a directory (links are not followed)."""
    top = src / name
    if top.is_symlink() or (top.exists() and not top.is_dir()):
        raise _refused(src, f"caches/{name}", "is not a directory")
    found: list[str] = []
    pending = [(top, "")] if top.is_dir() else []
    while pending:
        folder, prefix = pending.pop()
        with os.scandir(folder) as entries:
            for entry in entries:
                relpath = prefix + entry.name
                if entry.is_dir(follow_symlinks=False):
                    pending.append((Path(entry.path), relpath + "/"))
                elif entry.is_file(follow_symlinks=False):
                    found.append(relpath)
                else:
                    raise _refused(src, f"caches/{name}/{relpath}", "is not a regular file")
    return sorted(found)


def _listed_entry(src: Path, listed: dict[str, Any], relpath: str) -> dict[str, Any]:
    entry = listed.get(f"caches/{relpath}")
    if not isinstance(entry, dict):
        raise _refused(src, f"caches/{relpath}", f"is not listed in {MANIFEST}")
    return entry


def _copy_checked(src: Path, relpath: str, tmp: Path, entry: dict[str, Any] | None) -> None:
    """`src/caches/relpath` (a regular file, opened without following a link or blocking)
    copied to `tmp`, the copy's bytes checked against `entry`'s size and digests when one is
    given (at most one byte past its size is read: a file still growing is refused)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(src / relpath, flags)
    except OSError as exc:
        raise _refused(src, f"caches/{relpath}", f"cannot be opened ({exc.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _refused(src, f"caches/{relpath}", "is not a regular file")
        limit = sys.maxsize if entry is None else entry["size"] + 1
        with open(tmp, "wb") as out:
            while limit > 0 and (block := os.read(fd, min(1 << 20, limit))):
                out.write(block)
                limit -= len(block)
        os.chmod(tmp, stat.S_IMODE(info.st_mode) & 0o755)
        os.utime(tmp, ns=(info.st_atime_ns, info.st_mtime_ns))
    finally:
        os.close(fd)
    if entry is not None and not _holds(tmp, relpath, entry):
        raise _refused(src, f"caches/{relpath}", f"does not hold the bytes {MANIFEST} lists")


def _holds(copy: Path, relpath: str, entry: dict[str, Any]) -> bool:
    """Whether `copy` (a private copy: nobody else writes it) is `entry`'s size and digests."""
    if copy.stat().st_size != entry["size"]:
        return False
    fd = os.open(copy, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return all(sha256_fd(fd, r) == r.sha256 for r in digest_ranges(relpath, entry))
    finally:
        os.close(fd)


def _refused(src: Path, relpath: str, why: str) -> BadSnapshot:
    return bad_snapshot(src.parent, f"{relpath!r} {why}")
