"""Bring the built-in LLM up from a snapshot: tier 1 (process image) first, then tier 0.

    service, startup, fn = restore_llm(snapshot_dir, config, named, log)

- the snapshot holds a process image (and SNAPFN_PROCESS_RESTORE is not "off"): restore the
  worker (snapshot/process/snapshot.py) and serve through a ProcessLLMService; `fn` is None;
- that fails at any step (the worker is already killed): record the step and reason as a
  fallback "process → portable" and restore tier 0 in this process, which itself falls back to
  a cold init — the returned startup manifest says every step that failed and why.

`named` is the model folder the user named, or None: the cold fallback's source
(sources.py: else the snapshot's recorded source, verified by its content hash; else
NoTrustedSource is raised, nothing served).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from snapfn.handler.llm.init_config import InitConfig
from snapfn.snapshot.errors import RestoreFailed

Log = Callable[[str], None]


def process_restore_enabled(snapshot_dir: Path | None, environ=os.environ) -> bool:
    from snapfn.snapshot.process.snapshot import has_process_image

    if environ.get("SNAPFN_PROCESS_RESTORE", "auto") == "off":
        return False
    return snapshot_dir is not None and has_process_image(Path(snapshot_dir))


def restore_process(snapshot_dir: Path, config: InitConfig, log: Log | None, on_exit=None):
    """Tier 1 only: (ProcessLLMService, startup manifest); RestoreFailed (with `.startup`)."""
    from concurrent.futures import Future, ThreadPoolExecutor

    from snapfn.snapshot.process.snapshot import ProcessRestoreFailed, restore_process_snapshot
    from snapfn.snapshot.process.worker_process import ProcessConfig

    tokenizer: list[Future] = []

    def load_tokenizer() -> Any:  # on its own thread: the module's import too
        from snapfn.handler.llm.tokenizer import load_tokenizer

        return load_tokenizer(Path(snapshot_dir) / "model")

    def load_tokenizer_aside() -> None:
        # NOTE: the tokenizer (0.1-0.2 s for a 128k vocabulary, its import included) loads
        # beside the CUDA restore, started once the keeper has its request: started before
        # criu, it held the GIL while the restore was being launched (0.15-0.4 s later on the
        # H200, commit ffa93c9); started in the gate, before the request, a zygote's child
        # (tokenizers already imported) parsed the file holding the GIL and the gate took
        # 0.12 s (H100, 2026-12-07, `2026-12-07-h100-tiers-llama8b-prefill-rows`).
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapfn-tokenizer")
        tokenizer.append(pool.submit(load_tokenizer))
        pool.shutdown(wait=False)

    worker, startup, _ = restore_process_snapshot(
        Path(snapshot_dir),
        {},
        device=config.device,
        config=ProcessConfig.from_env(os.environ),
        log=log,
        aside=load_tokenizer_aside,
    )
    from snapfn.handler.llm.recipes.process_service import ProcessLLMService
    from snapfn.snapshot.process.client import ProcessClient
    from snapfn.snapshot.stages import StageRunner

    runner = StageRunner(startup, log=log, offset_s=startup.total_s)
    try:
        client = ProcessClient(worker, on_exit=on_exit)
        service = runner.run("connect", lambda f: ProcessLLMService(client, tokenizer[0].result()))
    except Exception as exc:
        worker.kill()
        raise ProcessRestoreFailed("connect", str(exc), runner.finish(ok=False)) from exc
    return service, runner.finish(ok=True)


def restore_llm(
    snapshot_dir: Path, config: InitConfig, named: Path | None, log: Log | None, on_exit=None
) -> tuple[Any, Any, Any]:
    """(service, startup, fn): tier 1 when possible, else tier 0 (→ cold init) in this process.

    Raises NoTrustedSource when every tier was refused and no trustworthy source is left."""
    from snapfn.handler.llm.recipes.function import LLMFunction
    from snapfn.handler.llm.recipes.sources import llm_fallback
    from snapfn.snapshot.runtime import restore

    failed = None
    if process_restore_enabled(snapshot_dir):
        try:
            service, startup = restore_process(snapshot_dir, config, log, on_exit)
            return service, startup, None
        except RestoreFailed as exc:
            failed = exc
            if log is not None:
                log(f"{exc}; falling back to the portable snapshot")
    from snapfn.handler.llm.service import LLMService

    fn, startup = restore(
        lambda: LLMFunction(config, named),
        Path(snapshot_dir),
        fallback=llm_fallback(config, named),
        log=log,
    )
    if failed is not None:
        startup.add_failed_process_restore(failed, "portable", first=True)
    return LLMService(fn.engine), startup, fn
