"""Where the LLM's cold init reads from after a snapshot was refused: the runtime's `fallback`.

    fallback = llm_fallback(config, named)      named: the model folder the user gave
                                                (`--model` beside `--snapshot`, or the serve /
                                                worker configuration's), else None
    restore(make_fn, snapshot, fallback=fallback)

The rules, in order:
1. a model the user named is the source, as it is;
2. else the source the snapshot records — the embedded default model when `source_embedded`,
   else the folder `source_model_dir` — but only as a candidate: its cold init checks the
   loaded model's content hash against the manifest's `model_content_hash` right after the
   weights load (stage `verify_source`) and raises NoTrustedSource on a mismatch, before it
   serves and before any snapshot is rewritten from it;
3. else (the manifest unreadable, no llm section, no content hash, no recorded folder here):
   NoTrustedSource, saying why — nothing is cold-initialised.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from snapfn.handler.llm.init_config import InitConfig
from snapfn.handler.llm.recipes.function import LLMFunction
from snapfn.snapshot.runtime import NoTrustedSource

NAME_ONE = "name the model to fall back to (--model, or the serve / worker configuration's)"
_HEX64 = re.compile(r"[0-9a-f]{64}")


def llm_fallback(
    config: InitConfig, named: Path | None, releasable: bool = False, parallel=None
) -> Callable[[dict[str, Any] | None], LLMFunction]:
    """The `fallback` for `runtime.restore`: the LLMFunction a cold init after a refusal runs
    (`parallel`: this rank's place, for one of several)."""

    def make(recorded: dict[str, Any] | None) -> LLMFunction:
        if named is not None:
            return LLMFunction(config, named, releasable, parallel=parallel)
        try:
            folder, content_hash, problem = *recorded_source(recorded, parallel), ""
        except NoTrustedSource as exc:
            problem = str(exc)
        if parallel is not None and parallel.tp_size * parallel.ep_size > 1:
            problem = first_rank_problem(problem, parallel)  # every rank falls back, or none
        if problem:
            raise NoTrustedSource(problem)
        return LLMFunction(
            config, folder, releasable, expected_content_hash=content_hash, parallel=parallel
        )

    return make


def recorded_source(recorded: dict[str, Any] | None, parallel: Any = None) -> tuple[Path, str]:
    """(candidate folder, the content hash it must load as) from a shape-checked manifest;
    NoTrustedSource (one line) when it names none that could be checked. A rank of several
    (`parallel`) loads its share of the model: the hash is that rank's, recorded under "ranks"
    by a snapshot of the same rank layout; none other can check it."""
    if recorded is None:
        raise NoTrustedSource(f"its manifest cannot be read, so it names no source; {NAME_ONE}")
    section = recorded.get("llm")
    if not isinstance(section, dict):
        raise NoTrustedSource(f"its manifest has no llm section naming a source; {NAME_ONE}")
    content_hash = _rank_content_hash(section, parallel)
    if not isinstance(content_hash, str) or not _HEX64.fullmatch(content_hash):
        raise NoTrustedSource(
            f"its manifest records no content hash to check a source against; {NAME_ONE}"
        )
    if section.get("source_embedded") is True:
        from snapfn.handler.llm.embedded import embedded_model_dir

        folder = embedded_model_dir()
    else:
        recorded_dir = section.get("source_model_dir")
        if not isinstance(recorded_dir, str) or not os.path.isabs(recorded_dir):
            raise NoTrustedSource(f"its manifest records no model folder; {NAME_ONE}")
        folder = Path(recorded_dir)
    if not (folder / "config.json").is_file():
        raise NoTrustedSource(
            f"its recorded model folder {str(folder)[:200]!r} is not a model folder here; "
            f"{NAME_ONE}"
        )
    return folder, content_hash


def first_rank_problem(problem: str, parallel: Any) -> str:
    """The first rank's `problem` ("" where none has one), on every rank."""
    from snapfn.handler.llm.models.tensor_parallel import all_gather_texts

    found = [(k, p) for k, p in enumerate(all_gather_texts(problem, parallel)) if p]
    return f"rank {found[0][0]}: {found[0][1]}" if found else ""


def _rank_content_hash(section: dict[str, Any], parallel: Any) -> Any:
    one = {"tp_size": 1, "ep_size": 1, "ep_dispatch": "replicated"}
    ours = (
        one
        if parallel is None
        else {
            "tp_size": parallel.tp_size,
            "ep_size": parallel.ep_size,
            "ep_dispatch": parallel.ep_dispatch,
        }
    )
    if section.get("parallel", one) != ours:
        raise NoTrustedSource(
            f"its recorded content hash is of another rank layout ({section.get('parallel', one)!r:.100}"
            f", this start runs {ours}); {NAME_ONE}"
        )
    if ours == one:
        return section.get("model_content_hash")
    rank = parallel.ep_rank * parallel.tp_size + parallel.tp_rank
    ranks = section.get("ranks")
    entry = ranks[rank] if isinstance(ranks, list) and rank < len(ranks) else None
    return entry.get("model_content_hash") if isinstance(entry, dict) else None
