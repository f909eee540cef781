"""The protocol between the runtime and a function: named stages and snapshot hooks.

The runtime knows nothing about what a function does. A function hands it:
- `init_stages()`: the cold-init recipe, `[(name, fn(figures) -> None), …]`, run in order;
- `write_snapshot(writer, startup)`: puts its tier-0 state under `writer.root`, returns the
  function's section of manifest.json (JSON);
- `prepare_runtime(figures)`: the first stage of a restore (environment variables, compile
  cache locations, heavy imports) — run before the snapshot is validated;
- `restore_stages(snapshot_dir, manifest)`: the recipe that rebuilds the warmed state from a
  snapshot; any stage may raise to refuse it (the runtime then falls back);
- `release()`: drop everything it holds (called on a half-restored function before fallback);
- `source`: where a cold init reads from (recorded in the snapshot for fallback);
- optionally `check_manifest(snapshot_dir, manifest)`: run in the validate stage, refusing (one
  line) any field of its section the restore would use that is not what it must be;
- optionally `source_trusted`: False until a fallback from a source the snapshot recorded has
  verified it (the runtime's `fallback(recorded)` makes such a function, runtime.py);
- `cache_drift`: set by the runtime's validate stage before `restore_stages` is called — None,
  or why the snapshot's compile caches (and what else was measured on the machine that made
  it: a memory plan) do not fit this machine (compat.cache_drift). A function then restores
  without them: it compiles again, re-measures what it must, and checks its answer against
  the recorded one within the tolerance another GPU or library version allows.
- `arriving`: set by the runtime before `restore_stages` when the snapshot is still being pulled
  into `snapshot_dir` (runtime.py's `Arriving`, else left alone: None): a function that streams
  a large file from it waits on `arriving.waiter(relpath)` before each read of it.
- optionally `gpu_fields(index)`: the compat key's GPU fields (compat.driver_api_fields's)
  without waiting for the CUDA init `prepare_runtime` began (snapshot/cuda/early_context.py),
  or None when it cannot; the validate stage then builds its key from them instead of
  initialising CUDA through torch.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

Figures = dict[str, Any]
Stage = tuple[str, Callable[[Figures], Any]]


class SnapshotWriterLike(Protocol):
    root: Path

    def register_chunked(
        self, relpath: str, chunk_bytes: int, chunk_sha256: list[str], file_sha256: str | None
    ) -> None: ...


class SnapshotFunction(Protocol):
    name: str
    device: str
    world_size: int
    cache_drift: str | None

    def init_stages(self) -> list[Stage]: ...

    def write_snapshot(
        self, writer: SnapshotWriterLike, startup: dict[str, Any]
    ) -> dict[str, Any]: ...

    def prepare_runtime(self, figures: Figures) -> None: ...

    def restore_stages(self, snapshot_dir: Path, manifest: dict[str, Any]) -> list[Stage]: ...

    def release(self) -> None: ...
