"""Compile caches: where Triton, inductor, flashinfer and DeepGEMM write what they compile, set
before any heavy import (a function's `runtime_env` stage), and those caches carried into and
out of a portable snapshot, so that a restore compiles nothing.

# NOTE: these variables only take effect if set before torch / triton / flashinfer are
# imported and before CUDA is initialised; this module imports none of them at module level.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from snapfn.snapshot.imports import import_for_startup

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


def restore_caches(src: Path, cache_dir: Path) -> int:
    """Copy a snapshot's caches into the local cache dir (before any kernel import): the files
    it lacks, the number copied.

    NOTE: a file already there is never written over: caches are keyed by content, and a
    running process (a restored worker) may have it mapped, which a rewrite would corrupt.
    """
    if not src.is_dir():
        return 0
    count = 0
    for name, path in cache_dirs(cache_dir).items():
        for file in sorted(p for p in (src / name).rglob("*") if p.is_file()):
            dest = path / file.relative_to(src / name)
            if dest.exists():
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
            shutil.copy2(file, tmp)
            os.replace(tmp, dest)  # NOTE: a reader never sees half a file
            count += 1
    return count
