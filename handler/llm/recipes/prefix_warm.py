"""Prompts whose KV pages the prefix cache holds before the first request (a system prompt):
configured for the init, recorded in the snapshot, warmed again by every restore.

    SNAPFN_PREFIX_WARM=FILE     a JSON list of prompt texts (InitConfig.prefix_warm)

The init reads the file (`read_warm_prompts`: InitFailed naming the file and entry), the
`prefix_warm` stage prefills each prompt once through the engine (`warm_prefixes`: a one-token
generation, so that its full pages are registered) and the "llm" section records the texts
(`prefix_warm`). A restore warms the recorded texts again, in its own `prefix_warm` stage: a
tier-0 snapshot carries no KV, and a process snapshot's KV pool does not come back with its
image, so the pages are computed where they are used. `check_warm_prompts` shape-checks the
recorded list (BadSnapshot). A prompt's pages stay cached until evicted, like any other.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from snapfn.handler.llm.init_config import read_json_file
from snapfn.snapshot.errors import BadSnapshot, InitFailed

MAX_PROMPTS = 64
MAX_PROMPT_CHARS = 1 << 20
MAX_FILE_BYTES = 16 << 20


def read_warm_prompts(path: Path | str) -> list[str]:
    """The prompt texts the file at `path` lists, each once, in order."""
    where = f"prefix_warm {path}"
    entries = read_json_file(path, where, MAX_FILE_BYTES)
    problem = _problem(entries)
    if problem:
        raise InitFailed(f"{where}: {problem}")
    return list(dict.fromkeys(entries))


def check_warm_prompts(value: Any) -> list[str]:
    """A snapshot's recorded `prefix_warm`, shape-checked (BadSnapshot)."""
    problem = _problem(value)
    if problem:
        raise BadSnapshot(f"its llm section: prefix_warm: {problem}")
    return list(value)


def warm_prefixes(engine: Any, prompts: list[str]) -> dict[str, Any]:
    """Prefill each prompt once (a one-token greedy generation) so that the prefix cache holds
    its full pages; a stage's figures."""
    from snapfn.handler.llm.engine.request import SamplingParams

    if engine.prefix_cache_stats() is None:
        return {"skipped": "the prefix cache is off", "prompts": len(prompts)}
    if engine.tokenizer is None:
        raise InitFailed("prefix_warm needs the model's tokenizer, which this snapshot lacks")
    start = time.perf_counter()
    one = SamplingParams(max_new_tokens=1, ignore_eos=True)
    ids = [engine.tokenizer.encode(text) or [0] for text in prompts]
    too_long = [k for k, p in enumerate(ids) if len(p) > engine.max_req_input_len]
    if too_long:
        raise InitFailed(
            f"prefix_warm: prompt {too_long[0]} has {len(ids[too_long[0]])} tokens, more than "
            f"the {engine.max_req_input_len} this engine accepts"
        )
    for prompt in ids:  # NOTE: one at a time: each registers its pages before the next matches
        engine.generate([prompt], one)
    return {
        "prompts": len(prompts),
        "tokens": sum(map(len, ids)),
        "cached_pages": engine.prefix_cache_stats()["cached_pages"],
        "seconds_prefill": round(time.perf_counter() - start, 4),
    }


def _problem(entries: Any) -> str | None:
    if not isinstance(entries, list) or len(entries) > MAX_PROMPTS:
        return f"not a list of at most {MAX_PROMPTS} prompt texts"
    for k, text in enumerate(entries):
        if not isinstance(text, str) or not 0 < len(text) <= MAX_PROMPT_CHARS:
            return f"entry {k} is not a prompt text of 1 to {MAX_PROMPT_CHARS} characters"
    return None
