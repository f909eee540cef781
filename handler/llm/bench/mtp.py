"""`snapfn bench --modes mtp`: MTP speculative decoding's decode speed against plain decode.

After a cold init with `speculative_tokens = max(DRAFT_COUNTS)` (this process: the MTP
layers' KV in the pool), one engine per draft count `k` in `(0, *DRAFT_COUNTS)` over the same
model and pool generates `--decode-tokens` greedy tokens for `BATCH` prompts, once to warm
up, then timed. Per `k`: decode ms per step (the steps after the prefill's), tokens per step
per request, ms per token, the speed-up in ms per token against `k = 0`, the acceptance rate
(drafts kept over drafts verified), and whether the tokens equal `k = 0`'s (greedy must).

A random-weight model's MTP layer rarely drafts the model's next token, so on one the figures
show the mechanism's cost, not its speed-up.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

DRAFT_COUNTS = (1, 2, 3)
BATCH = 1
PROMPT_TOKENS = 32


def mode_mtp(args: argparse.Namespace, make_function, sync) -> dict[str, Any]:
    from snapfn.snapshot.runtime import cold_init

    fn = make_function(max(DRAFT_COUNTS))  # a model without MTP layers is refused here
    cold_init(fn, log=None)
    vocab = fn.engine.model.config.vocab_size
    prompts = [
        [(7919 * i + 104729 * row + 13) % vocab for i in range(PROMPT_TOKENS)]
        for row in range(BATCH)
    ]
    runs = {k: _decode(fn.engine, k, prompts, args.decode_tokens, sync) for k in (0, *DRAFT_COUNTS)}
    base, plain = runs[0]["ms_per_token"], runs[0]["tokens"]
    for run in runs.values():
        run["speedup"] = round(base / run["ms_per_token"], 3)
        run["tokens_equal_k0"] = run["tokens"] == plain
    for run in runs.values():
        del run["tokens"]
    return {
        "batch": BATCH,
        "prompt_tokens": PROMPT_TOKENS,
        "decode_tokens": args.decode_tokens,
        "by_k": {f"k{k}": run for k, run in runs.items()},
    }


def _decode(engine, k: int, prompts: list[list[int]], n: int, sync) -> dict[str, Any]:
    """`n` greedy tokens for `prompts` through an engine drafting `k` (0: none) over `engine`'s
    model and pool, warmed by one run first."""
    from snapfn.handler.llm.engine.engine import Engine, SchedulerConfig
    from snapfn.handler.llm.engine.request import SamplingParams
    from snapfn.handler.llm.engine.speculative import SpecStats

    sched = SchedulerConfig(
        page_size=engine.kv.page_size,
        max_num_batched_tokens=engine.scheduler.max_num_batched_tokens,
        max_model_len=engine.max_model_len,
        overlap_decode=engine.overlap_decode,
        prefix_caching=False,  # every run prefills its prompt: the same work for each k
        speculative_tokens=k,
    )
    bench = Engine(engine.model, engine.kv, sched, engine.tokenizer, engine.eos_token_ids)
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    bench.generate(prompts, params)  # warm-up: every shape of the run once
    if bench.drafter is not None:
        bench.drafter.stats = SpecStats()  # the timed run's alone
    for prompt in prompts:
        bench.add_request(prompt, params)
    sync()
    bench.step()  # the prefill (and the first drafts)
    sync()
    t0, steps, tokens, outputs = time.perf_counter(), 0, 0, []
    while bench.has_work():
        outs = bench.step()
        steps += 1
        tokens += sum(len(o.new_token_ids) for o in outs)
        outputs += outs
    sync()
    seconds = time.perf_counter() - t0
    stats = bench.spec_stats() or {"acceptance_rate": None}
    return {
        "decode_ms_per_step": round(seconds / steps * 1e3, 3),
        "decode_steps": steps,
        "tokens_per_step": round(tokens / steps / len(prompts), 3),
        "ms_per_token": round(seconds / tokens * len(prompts) * 1e3, 3),
        "acceptance_rate": stats["acceptance_rate"],
        "tokens": [t for o in outputs for t in o.new_token_ids],
    }


def brief(result: dict[str, Any]) -> str:
    """One line of the report for the mode's result."""
    return "; ".join(
        f"{k}: {r['decode_ms_per_step']} ms/step, {r['tokens_per_step']} tokens/step, "
        f"{r['speedup']}x, acceptance {r['acceptance_rate']}"
        for k, r in result["by_k"].items()
    )
