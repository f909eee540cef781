"""The built-in LLM restored from a snapshot in the S3 store (`--snapshot s3://bucket/prefix`).

    service, startup, fn = restore_llm_from_s3(uri, cache, config, named, log)

A hit in the local snapshot cache restores from local disk (process_restore.restore_llm: tier
1, else tier 0, else a cold init). A miss of a portable snapshot, with the cache's `overlap` on
(SNAPFN_SNAPSHOT_CACHE_OVERLAP, default on), restores tier 0 while the snapshot is pulled
(store/cache.py `open_snapshot`, store/overlap.py): the small files are validated as soon as
they are verified, and the weights streamer reads each chunk of `weights/rank0.bin` as soon as
the pull has verified and written it. A refusal of the pull (a missing, truncated or corrupt
object) fails the stage that waited for it, and the restore falls back to a cold init from
`named` (else the snapshot's recorded source, verified: sources.py); the cache then holds the
pull's resumable staging dir and no snapshot. The startup manifest says where the weights came
from: stage `download_files` (the small files' wait), `stream_weights`'s `download_wait_s` and
`source`, stage `download` (the pull's own figures), and `info["snapshot_source"]`.

A miss of a process snapshot is pulled whole, then restored from local disk as a hit is. When
that pull is refused, its portable tier (every file but the process images) is restored while
it is pulled, the same way, and published nowhere: the startup manifest records the refusal
first, as a fallback "process → portable" at `download`, then any fallback of that restore.
With `overlap` off the refused snapshot is restored from its manifest alone (the cache's
folder for it), which falls back to the same cold init.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from snapfn.handler.llm.init_config import InitConfig

Log = Callable[[str], None]

STREAMED = ("weights/rank0.bin",)  # function.WEIGHTS_FILE: what a one-rank restore streams


def restore_llm_from_s3(
    uri: str, cache: Any, config: InitConfig, named: Path | None, log: Log | None, on_exit=None
) -> tuple[Any, Any, Any]:
    """(service, startup, fn) of the snapshot at `uri` (`cache`: a SnapshotCacheConfig)."""
    from snapfn.handler.llm.recipes.process_restore import restore_llm
    from snapfn.snapshot.store.cache import open_snapshot

    opened = open_snapshot(uri, cache, streamed=STREAMED, log=log)
    if opened.pull is None:
        return restore_llm(opened.path, config, named, log, on_exit)
    from snapfn.handler.llm.service import LLMService

    fn, startup = restore_following(opened.pull, config, named, log)
    return LLMService(fn.engine), startup, fn


def restore_following(pull: Any, config: InitConfig, named: Path | None, log: Log | None):
    """(fn, startup): tier 0 restored from `pull` (an OverlappedPull) as it runs, else a cold
    init; returns once the pull has ended (published, or failed: resumable)."""
    from snapfn.handler.llm.recipes.function import LLMFunction
    from snapfn.handler.llm.recipes.sources import llm_fallback
    from snapfn.snapshot.runtime import restore

    try:
        fn, startup = restore(
            lambda: LLMFunction(config, named),
            pull.files,
            fallback=llm_fallback(config, named),
            log=log,
            arriving=pull,
        )
    finally:
        error = pull.close()
    if pull.refused is not None:  # NOTE: the whole snapshot's pull, refused before this one ran
        refused = {"from": "process", "to": "portable", "step": "download"}
        startup.fallbacks.insert(0, {**refused, "reason": pull.refused})
    startup.info["snapshot_source"] = {
        "uri": pull.uri,
        "overlapped": True,
        "path": str(pull.dest),
        "pull": _pull_outcome(pull, error),
    }
    if log is not None and error is not None:
        log(f"the pull of {pull.uri} failed ({error}); a later start resumes it")
    return fn, startup


def _pull_outcome(pull: Any, error: BaseException | None) -> str:
    if error is not None:
        return f"{type(error).__name__}: {error}"
    return "published" if pull.part is None else "portable tier verified, not published"
