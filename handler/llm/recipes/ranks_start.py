"""How each rank of a tensor- or expert-parallel LLM comes up: the same steps on every rank, in
the same order, since their forwards are collectives.

    snapshot holds files → restore it (tier 0: every rank its own weights file; any rank's
                           failure before the collective stages falls back on every rank)
                           → on a fallback, the cold init rewrites it
    snapshot empty/None  → cold init → write the snapshot there (when one is named)
    fresh (`snapfn init`) → cold init → write the snapshot

Rank 0 writes the snapshot (`runtime.write_snapshot`); the others write their weights files
into its staging folder (`LLMFunction.write_rank_files`). Tier 1 (a process image of several
ranks) is not made: such a request is refused before any rank starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from snapfn.handler.llm.init_config import InitConfig
from snapfn.snapshot.stages import Log, StartupManifest


def start_rank(
    config: InitConfig,
    model_dir: Path | None,
    snapshot_dir: Path | None,
    parallel: Any,
    log: Log | None,
    fresh: bool = False,
) -> tuple[Any, StartupManifest]:
    """(this rank's LLMFunction, its startup manifest), the snapshot restored or written;
    `fresh` (`snapfn init`): a cold init that writes the snapshot whatever the folder holds."""
    from snapfn.handler.llm.recipes.function import LLMFunction
    from snapfn.handler.llm.recipes.sources import llm_fallback
    from snapfn.snapshot.runtime import cold_init, holds_files, restore, write_snapshot

    rank0 = parallel.tp_rank == 0 and parallel.ep_rank == 0
    if holds_files(snapshot_dir) and not fresh:
        fn, startup = restore(
            lambda: LLMFunction(config, model_dir, parallel=parallel),
            snapshot_dir,
            fallback=llm_fallback(config, model_dir, parallel=parallel),
            rewrite_on_fallback=False,  # every rank takes part in the write: below
            log=log,
        )
        write = startup.tier.startswith("cold")
    else:
        fn = LLMFunction(config, model_dir, parallel=parallel)
        startup = cold_init(fn, log)
        write = snapshot_dir is not None
    if write and rank0:
        write_snapshot(fn, snapshot_dir, startup, log)
    elif write:
        fn.write_rank_files()
    startup.info["parallel"] = {"tp_size": parallel.tp_size, "ep_size": parallel.ep_size}
    return fn, startup
