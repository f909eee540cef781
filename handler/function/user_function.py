"""A user's function (`module:handler`) as a snapshot function: its cold init, the portable
snapshot (tier 0) that init leaves, and the restore from it.

    fn = UserFunction(spec, function_dir, device, cache_dir)
    cold_init(fn)                        runtime_env → import_function → init_hooks
    fn.write_snapshot(writer, startup)   caches/ (everything the init compiled: inductor,
                                         Triton, ...) and function/ (the --function-dir files)
    restore(make_fn, snapshot_dir)       runtime_env → validate → restore_caches →
                                         import_function → init_hooks, against warm caches:
                                         `compiled_files` says what it still compiled (0)

`device` is what the function runs on: it reads it as `api.device()` (SNAPFN_DEVICE is set
before its module is imported). In a process snapshot's worker (`host.py`) the init hooks run
with `memory` routing their CUDA allocations into a releasable pool. A tier-0 restore imports
the module from `--function-dir` when one is given, else from the snapshot's copy of it; its
after-restore hooks do not run (nothing was restored: the init ran again).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

from snapfn.handler.api import DEVICE_VARIABLE, LoadedFunction, load_function
from snapfn.snapshot.errors import BadRequest, IncompatibleSnapshot, SnapfnError
from snapfn.snapshot.portable import compile_caches

USER_FUNCTION = "user_function"  # its section's key in manifest.json
SOURCE_DIR = "function"  # the --function-dir files, in the snapshot
_NOT_COPIED = shutil.ignore_patterns(
    "__pycache__", "*.pyc", ".git", ".venv", "venv", "node_modules", ".pytest_cache"
)


def _not_copied(root: Path):
    """copytree's ignore for the --function-dir files: caches and environments, the snapshot
    being written (it may lie inside the folder) and any other snapshot there."""
    target = root.resolve()

    def ignore(folder: str, names: list[str]) -> set[str]:
        skipped = set(_NOT_COPIED(folder, names))
        for name in names:
            path = Path(folder, name)
            if path.resolve() == target or (path / "manifest.json").is_file():
                skipped.add(name)
        return skipped

    return ignore


def function_cache_dir(spec: str, cache_root: Path | None = None) -> Path:
    """Where `spec`'s compile caches live: `<cache root>/functions/<key of spec>`, the cache root
    being SNAPFN_CACHE_DIR, else ~/.cache/snapfn. NOTE: one stable path per function, not a
    temporary one: a process image maps the compiled libraries from there (inductor's .so
    files), and criu reopens them by path at every restore."""
    import hashlib

    if cache_root is None:
        from snapfn.handler.llm.init_config import default_cache_dir

        cache_root = Path(os.environ.get("SNAPFN_CACHE_DIR") or default_cache_dir(os.environ))
    return Path(cache_root) / "functions" / hashlib.sha256(spec.encode()).hexdigest()[:16]


class UserFunction:
    name = USER_FUNCTION
    world_size = 1

    def __init__(
        self,
        spec: str,
        function_dir: Path | str | None = None,
        device: str = "cpu",
        cache_dir: Path | str | None = None,
        memory_for: Any = None,
    ) -> None:
        """`cache_dir`: its compile caches (default `function_cache_dir(spec)`);
        `memory_for(device)`: a DeviceMemory the init hooks route their allocations into (made
        once CUDA is up), or None."""
        self.spec, self.device = spec, device
        self.function_dir = Path(function_dir) if function_dir is not None else None
        self.cache_dir = Path(cache_dir) if cache_dir is not None else function_cache_dir(spec)
        self.memory_for, self.memory = memory_for, None
        self.loaded: LoadedFunction | None = None
        self.cache_drift: str | None = None  # set by the runtime's validate (snapshot/function.py)

    @property
    def source(self) -> str:
        return self.spec  # what a cold init after a failed restore loads again

    # ---- cold init -----------------------------------------------------------------------------
    def init_stages(self):
        return [
            ("runtime_env", self.prepare_runtime),
            ("import_function", lambda f: self._import(f, self.function_dir)),
            ("init_hooks", self._init_hooks),
        ]

    def prepare_runtime(self, figures: dict[str, Any]) -> None:
        """SNAPFN_DEVICE and the compile caches' folders, before the function is imported; on
        CUDA, torch imported and the CUDA context made."""
        os.environ[DEVICE_VARIABLE] = self.device
        compile_caches.set_environment(self.cache_dir)
        figures.update(
            device=self.device, cache_files=compile_caches.count_cache_files(self.cache_dir)
        )
        if self.device.startswith("cuda"):
            figures.update(compile_caches.prepare(self.cache_dir, self.device))

    def _import(self, figures: dict[str, Any], function_dir: Path | None) -> None:
        put_on_import_path(function_dir)
        self.loaded = load_function(self.spec)
        module = self.loaded.module
        figures.update(module=module.__name__, hooks_declared=len(self.loaded.hooks))

    def _init_hooks(self, figures: dict[str, Any]) -> None:
        if self.memory_for is not None and self.memory is None:
            try:
                self.memory = self.memory_for(self.device)
            except (AttributeError, RuntimeError, SnapfnError) as exc:  # e.g. an older torch
                figures["pool"] = f"none ({type(exc).__name__}: {exc})".splitlines()[0]
        routing = self.memory.routing() if self.memory is not None else contextlib.nullcontext()
        with compile_caches.compiles_counted(self.cache_dir, figures), routing:
            figures["hooks"] = self.loaded.run_init()
        if self.memory is not None:
            figures["pool_bytes"] = self.memory.pool_bytes()

    # ---- the portable snapshot -----------------------------------------------------------------
    def write_snapshot(self, writer: Any, startup: dict[str, Any]) -> dict[str, Any]:
        root = Path(writer.root)
        caches = compile_caches.save_caches(self.cache_dir, root / "caches")
        source_files = 0
        if self.function_dir is not None and self.function_dir.is_dir():
            shutil.copytree(self.function_dir, root / SOURCE_DIR, ignore=_not_copied(root))
            source_files = sum(1 for p in (root / SOURCE_DIR).rglob("*") if p.is_file())
        return {
            "spec": self.spec,
            "device": self.device,
            "function_dir": str(self.function_dir) if self.function_dir is not None else None,
            "source_files": source_files,
            "cache_dir": str(self.cache_dir.absolute()),
            "caches": caches,
            "health_event": self.loaded.health_event if self.loaded is not None else {},
        }

    def restore_stages(self, snapshot_dir: Path, manifest: dict[str, Any]):
        section = manifest.get(USER_FUNCTION)
        if not isinstance(section, dict) or section.get("spec") != self.spec:
            recorded = section.get("spec") if isinstance(section, dict) else None
            raise IncompatibleSnapshot(
                f"snapshot {snapshot_dir} holds function {recorded!r}, not {self.spec!r}"
            )
        folder = self.function_dir
        if folder is None and (Path(snapshot_dir) / SOURCE_DIR).is_dir():
            folder = Path(snapshot_dir) / SOURCE_DIR

        def restore_caches(figures: dict[str, Any]) -> None:
            if self.cache_drift is not None:  # made for another GPU, driver or library
                figures.update(restored_files=0, dropped=self.cache_drift)
                return
            src = Path(snapshot_dir) / "caches"
            figures["restored_files"] = compile_caches.restore_caches(
                src, self.cache_dir, manifest["files"]
            )

        return [
            ("restore_caches", restore_caches),
            ("import_function", lambda f: self._import(f, folder)),
            ("init_hooks", self._init_hooks),
        ]

    def release(self) -> None:
        self.loaded = None


def restore_image_caches(
    snapshot_dir: Path, manifest: dict[str, Any], cache_dir: Path
) -> int | str:
    """Before a tier-1 restore: the compile caches its process image maps (inductor's .so
    files), put back where the init had them if they are missing there — criu reopens them by
    path. Only into `cache_dir`, the folder this runtime keeps the function's caches in (never
    a path the manifest names): when the image recorded another one, nothing is copied and the
    reason comes back as a string (criu then says what it misses, and the restore falls back).
    Before anything is copied, the snapshot holds only what `manifest` lists, and every file to
    copy has its recorded digest (BadSnapshot if not).
    The files copied; OSError when `cache_dir` cannot be written here."""
    from snapfn.snapshot.portable.format import check_listing, verify_files

    section = manifest.get(USER_FUNCTION)
    recorded = section.get("cache_dir") if isinstance(section, dict) else None
    if recorded != str(Path(cache_dir).absolute()):
        return f"not put back: the image's caches were at {str(recorded)[:200]!r}, not {str(cache_dir)!r}"
    dirs = compile_caches.cache_dirs(cache_dir)
    missing = []
    for relpath in manifest["files"]:
        top, name, rest = (relpath.split("/", 2) + ["", ""])[:3]
        if top == "caches" and rest and name in dirs and not (dirs[name] / rest).exists():
            missing.append(relpath)
    if not missing:
        return 0
    check_listing(Path(snapshot_dir), manifest["files"])  # nothing unlisted is copied either
    verify_files(snapshot_dir, manifest, missing)
    return compile_caches.restore_caches(
        Path(snapshot_dir) / "caches", Path(cache_dir), manifest["files"]
    )


DEVICE = re.compile(r"cpu|cuda(:[0-9]{1,3})?")  # what a snapshot's recorded device may be


def recorded_device(section: Any, default: str, check: bool = True) -> str:
    """The device a function's snapshot records (its section's "device"), when it is a device
    name (`DEVICE`) this machine has, else `default` (the target's). `check=False` skips
    asking the driver whether the GPU is here (cuInit: 0.15-0.2 s on the H200): a process
    restore's compat check asks it beside criu, or its keeper answers for it."""
    device = section.get("device") if isinstance(section, dict) else None
    if not isinstance(device, str) or not DEVICE.fullmatch(device):
        return default
    if not check:
        return device
    try:
        check_device(device)
    except BadRequest:
        return default
    return device


def put_on_import_path(function_dir: Path | None) -> None:
    """The function's module is looked up in `function_dir` first, then in the current
    directory (as `python -m` does: `examples.hello` from the repository root), then on the
    Python path. NOTE: a worker process serves one function; its folder goes first, as Lambda's
    task root does."""
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)
    if function_dir is not None and str(function_dir) not in sys.path:
        sys.path.insert(0, str(function_dir))


def check_device(device: str) -> None:
    """BadRequest, one line, for a device this machine cannot run a function on."""
    kind, _, index = device.partition(":")
    if kind == "cpu" and not index:
        return
    if kind != "cuda" or (index and not index.isdigit()):
        raise BadRequest(f"--device must be cpu or cuda[:N], not {device!r}")
    from snapfn.snapshot.cuda.driver import driver, ok
    from snapfn.snapshot.errors import RestoreFailed

    try:
        count = ok(driver().cuDeviceGetCount(), "cuDeviceGetCount")
    except RestoreFailed as exc:
        raise BadRequest(
            f"--device {device}: this machine has no usable CUDA GPU ({exc})"
        ) from None
    if int(index or 0) >= count:
        raise BadRequest(f"--device {device}: this machine has {count} CUDA GPU(s)")
