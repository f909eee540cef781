"""`snapfn bench --modes prefix`: a prefix-cache hit's time to the first token against a miss.

After a cold init (this process, the engine warm), prompts of `PREFIX_TOKENS` shared tokens (a
long system prompt: capped at what the engine accepts) and `TAIL_TOKENS` of their own are
timed to their first token: the first, whose prefix nobody computed (a miss), then `ROUNDS`
with other tails (hits: only the tail and the prefix's last partial page are prefilled),
then the same prompts once more with the cache cleared before each (misses again). The medians
and their ratio go in the result with the tokens each run found cached; every hit must give the
token a miss of the same prompt gives.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

PREFIX_TOKENS = 1536
TAIL_TOKENS = 16
ROUNDS = 5


def mode_prefix(args: argparse.Namespace, make_function, sync) -> dict[str, Any]:
    from snapfn.handler.llm.engine.request import SamplingParams
    from snapfn.snapshot.runtime import cold_init

    fn = make_function()
    cold_init(fn, log=None)
    engine = fn.engine
    if engine.prefix_cache_stats() is None:
        return {"skipped": "the prefix cache is off (SNAPFN_PREFIX_CACHING=0)"}
    vocab = engine.model.config.vocab_size
    n = min(PREFIX_TOKENS, engine.max_req_input_len - TAIL_TOKENS)
    prefix = [(7919 * i + 13) % vocab for i in range(n)]
    tails = [
        [(104729 * (r + 1) + 31 * i) % vocab for i in range(TAIL_TOKENS)] for r in range(ROUNDS + 1)
    ]
    one = SamplingParams(max_new_tokens=1, ignore_eos=True)

    def first_token(prompt: list[int]) -> tuple[float, int, int]:
        sync()
        t0 = time.perf_counter()
        rid = engine.add_request(prompt, one)
        req = engine._requests[rid]
        (result,) = [r for r in _drain(engine) if r.request_id == rid]
        sync()
        return time.perf_counter() - t0, result.new_token_ids[0], req.cached_tokens

    engine.generate([[(i * 3 + 1) % vocab for i in range(n + TAIL_TOKENS)]], one)  # shapes warm
    engine.clear_prefix_cache()
    miss = [first_token(prefix + tails[0])]
    hits = [first_token(prefix + t) for t in tails[1:]]
    misses = []
    for t in tails[1:]:
        engine.clear_prefix_cache()
        misses.append(first_token(prefix + t))
    same = [h[1] for h in hits] == [m[1] for m in misses]
    hit_s = statistics.median(h[0] for h in hits)
    miss_s = statistics.median([miss[0][0], *(m[0] for m in misses)])
    return {
        "prompt_tokens": n + TAIL_TOKENS,
        "prefix_tokens": n,
        "miss_first_token_ms": round(miss_s * 1e3, 3),
        "hit_first_token_ms": round(hit_s * 1e3, 3),
        "hit_speedup": round(miss_s / hit_s, 2),
        "hit_cached_tokens": [h[2] for h in hits],
        "miss_cached_tokens": [m[2] for m in [*miss, *misses]],
        "hit_tokens_equal_miss_tokens": same,
    }


def _drain(engine) -> list:
    """Step the engine until it is idle; the outputs that finished a request."""
    done = []
    while engine.has_work():
        done += [out for out in engine.step() if out.finished]
    return done
