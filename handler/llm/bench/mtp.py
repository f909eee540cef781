"""`snapfn bench --modes mtp`: MTP speculative decoding's decode speed against plain decode.

After a cold init with `speculative_tokens = max(DRAFT_COUNTS)` (this process: the MTP
layers' KV in the pool), one engine per draft count `k` in `(0, *DRAFT_COUNTS)` over the same
model and pool generates `--decode-tokens` greedy tokens for `BATCH` prompts, once to warm
up, then timed. On CUDA, where the model's decode captures, each engine runs from its CUDA
graphs (`k = 0`: the decode graph; `k > 0`: the verify and draft graphs, `spec_graphs.py`) of
batch `BATCH`, as a served one does. Per `k`: decode ms per step (the steps after the
prefill's), tokens per step per request, ms per token, the speed-up in ms per token against
`k = 0`, the acceptance rate (drafts kept over drafts verified), the graph replays by use and
eager fallbacks, and where its tokens first differ from `k = 0`'s.

A random-weight model's MTP layer rarely drafts the model's next token, so its rows show the
mechanism's cost, not a speed-up. The `known` rows time the engine of the largest `k` with
drafts of known acceptance: the MTP layer runs and its drafts are read back as always, then
replaced by that engine's own greedy tokens at their places (the `k` row's), a share `r` of
the places off by one (`r` in `WRONG_SHARES`, the places fixed by a hash of the position).
They give the speed-up a checkpoint whose MTP layer drafts that well gets, with the acceptance
each measured.

Greedy speculative output is plain decode's wherever the kernels give a row the same bits
whatever rows share its batch (CPU, float32; tests/test_speculative.py). With bf16 or FP8 on
a GPU, the verify's rows run batched GEMMs where plain batch-1 decode runs GEMVs, as plain
decode does once a second request joins: two figures put a first difference in that light,
plain decode's own (`k0_batch4_first_difference`: its prompt as one of 4 rows of a batch) and
how near a tie `k = 0`'s pick was there (`k0_top2_gap_there`: its logprob over the
runner-up's, beside the run's median).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

DRAFT_COUNTS = (1, 2, 3)
BATCH = 1
PROMPT_TOKENS = 32
WRONG_SHARES = (0.0, 0.2, 0.5)  # the known-acceptance drafts: the share of places drafted wrong


def mode_mtp(args: argparse.Namespace, make_function, sync) -> dict[str, Any]:
    from snapfn.snapshot.runtime import cold_init

    fn = make_function(max(DRAFT_COUNTS))  # a model without MTP layers is refused here
    cold_init(fn, log=None)
    vocab = fn.engine.model.config.vocab_size
    prompts = [
        [(7919 * i + 104729 * row + 13) % vocab for i in range(PROMPT_TOKENS)]
        for row in range(BATCH)
    ]
    graphs = fn.uses_graphs()
    n = args.decode_tokens
    runs = {f"k{k}": _decode(fn.engine, k, prompts, n, sync, graphs) for k in (0, *DRAFT_COUNTS)}
    plain, k = runs["k0"]["tokens"], max(DRAFT_COUNTS)
    own = runs[f"k{k}"]["tokens"]  # the drafts of known acceptance are this engine's own tokens
    refs = {tuple(p): own[i * n : (i + 1) * n] for i, p in enumerate(prompts)}
    known = {
        f"k{k}_wrong_{w}": _decode(fn.engine, k, prompts, n, sync, graphs, (refs, w))
        for w in WRONG_SHARES
    }
    base = runs["k0"]["ms_per_token"]
    for run in (*runs.values(), *known.values()):
        run["speedup"] = round(base / run["ms_per_token"], 3)
        run["first_difference_from_k0"] = _first_difference(run["tokens"], plain)
    for run in known.values():
        run["tokens_equal_own"] = run["tokens"] == own
    gaps = _top2_gaps(fn.engine, prompts[0], n, graphs)
    for run in (*runs.values(), *known.values()):
        at = run["first_difference_from_k0"]
        run["tokens_equal_k0"] = at is None
        run["k0_top2_gap_there"] = round(gaps[at], 5) if at is not None else None
        del run["tokens"]
    return {
        "batch": BATCH,
        "prompt_tokens": PROMPT_TOKENS,
        "decode_tokens": n,
        "graphs": graphs,
        "by_k": runs,
        "known": known,
        # plain decode's own spread: the first prompt as 4 rows of one batch against batch 1
        "k0_batch4_first_difference": _batch_difference(fn.engine, prompts[0], n, graphs, plain),
        "k0_top2_gap_median": round(sorted(gaps)[len(gaps) // 2], 5),
    }


def _first_difference(tokens: list[int], want: list[int]) -> int | None:
    """The first place where `tokens` is not `want`; None where they are equal."""
    at = next((i for i, (a, b) in enumerate(zip(tokens, want, strict=False)) if a != b), None)
    return at if at is not None or len(tokens) == len(want) else min(len(tokens), len(want))


def _plain_engine(engine, graphs: bool, batch: int, max_seq_len: int):
    from snapfn.handler.llm.engine.engine import Engine, SchedulerConfig

    sched = SchedulerConfig(
        page_size=engine.kv.page_size,
        max_num_batched_tokens=engine.scheduler.max_num_batched_tokens,
        max_model_len=engine.max_model_len,
        prefix_caching=False,
    )
    plain = Engine(engine.model, engine.kv, sched, engine.tokenizer, engine.eos_token_ids)
    if graphs:
        plain.capture_graphs([batch], max_seq_len)
    return plain


def _top2_gaps(engine, prompt: list[int], n: int, graphs: bool) -> list[float]:
    """Plain decode's margin at each token of `prompt`'s greedy output: its logprob over the
    runner-up's (how near a tie each pick was)."""
    from snapfn.handler.llm.engine.request import SamplingParams

    plain = _plain_engine(engine, graphs, 1, PROMPT_TOKENS + n + 1)
    params = SamplingParams(max_new_tokens=n, ignore_eos=True, top_logprobs=2)
    plain.add_request(prompt, params)
    tops = []
    while plain.has_work():
        tops += [top for out in plain.step() for top in out.new_top_logprobs]
    return [top[0][1] - top[1][1] for top in tops]


def _batch_difference(engine, prompt: list[int], n: int, graphs: bool, want: list[int]):
    """Where plain greedy decode of `prompt` as row 0 of a batch of 4 copies first differs from
    batch 1's tokens `want` (None: nowhere)."""
    from snapfn.handler.llm.engine.request import SamplingParams

    plain = _plain_engine(engine, graphs, 4, PROMPT_TOKENS + n + 1)
    results = plain.generate([prompt] * 4, SamplingParams(max_new_tokens=n, ignore_eos=True))
    return _first_difference(list(results[0].token_ids), want[:n])


def known_drafts(drafter, refs: dict[tuple[int, ...], list[int]], wrong, vocab: int) -> None:
    """`drafter` drafting as always (the MTP layer's forwards and its drafts read back), then
    its drafts replaced by the tokens of `refs` (by prompt) at their places, off by one at the
    places `wrong(index)` names (the tests' oracle too)."""
    propose = drafter.propose

    def known(rows, ahead=None) -> None:
        propose(rows, ahead)
        for row in rows:
            req, ref = row.req, refs[tuple(row.req.prompt_ids)]
            start = len(req.output_ids)
            drafts = []
            for index in range(start, start + len(req.draft_ids)):
                token = ref[index] if index < len(ref) else 0
                drafts.append((token + 1) % vocab if wrong(index) else token)
            req.draft_ids = drafts

    drafter.propose = known


def hashed_share(share: float):
    """`wrong` for `known_drafts`: a share of the places, fixed by a hash of the place (not
    aligned to any draft count)."""
    return lambda index: (index * 2654435761) % 1000 < share * 1000


def _decode(
    engine, k: int, prompts: list[list[int]], n: int, sync, graphs: bool, known=None
) -> dict[str, Any]:
    """`n` greedy tokens for `prompts` through an engine drafting `k` (0: none) over `engine`'s
    model and pool (with `graphs`, from its CUDA graphs of batch `BATCH`), warmed by one run
    first; `known`: (the plain run's tokens by prompt, the share drafted wrong) for drafts of
    known acceptance."""
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
        overlap_speculative=engine.drafter is None or engine.drafter.overlap,
    )
    bench = Engine(engine.model, engine.kv, sched, engine.tokenizer, engine.eos_token_ids)
    if known is not None:
        refs, share = known
        known_drafts(bench.drafter, refs, hashed_share(share), engine.model.config.vocab_size)
    if graphs:
        max_seq_len = PROMPT_TOKENS + n + k + 1
        bench.capture_graphs([len(prompts)], max_seq_len)
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    bench.generate(prompts, params)  # warm-up: every shape of the run once
    if bench.drafter is not None:
        bench.drafter.stats = SpecStats()  # the timed run's alone
    for prompt in prompts:
        bench.add_request(prompt, params)
    sync()
    first = bench.step()  # the prefill (and the first drafts)
    sync()
    t0, steps, tokens, outputs = time.perf_counter(), 0, 0, list(first)
    while bench.has_work():
        outs = bench.step()
        steps += 1
        tokens += sum(len(o.new_token_ids) for o in outs)
        outputs += outs
    sync()
    seconds = time.perf_counter() - t0
    stats = bench.spec_stats() or {"acceptance_rate": None}
    by_request: dict[str, list[int]] = {}
    for o in outputs:
        by_request.setdefault(o.request_id, []).extend(o.new_token_ids)
    graph_stats = bench.graph_stats
    return {
        "decode_ms_per_step": round(seconds / steps * 1e3, 3),
        "decode_steps": steps,
        "tokens_per_step": round(tokens / steps / len(prompts), 3),
        "ms_per_token": round(seconds / tokens * len(prompts) * 1e3, 3),
        "acceptance_rate": stats["acceptance_rate"],
        "graphs": graph_stats.to_json() if graph_stats is not None else None,
        "gpu_ms_per_step": _gpu_ms_per_step(bench, prompts, params) if graphs else None,
        "tokens": [t for ids in by_request.values() for t in ids],
    }


def _gpu_ms_per_step(bench, prompts: list[list[int]], params) -> float | None:
    """The GPU's own time (kernels and copies, from the profiler's trace) per decode step of
    one more generation: the rest of a step's wall time is the host's. None where the trace
    has no device events."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for prompt in prompts:
        bench.add_request(prompt, params)
    bench.step()  # the prefill, outside the trace
    torch.cuda.synchronize()
    steps = 0
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as trace:
        while bench.has_work():
            bench.step()
            steps += 1
        torch.cuda.synchronize()
    device = [e for e in trace.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_us = sum(e.time_range.elapsed_us() for e in device)
    return round(busy_us / steps / 1e3, 3) if device and steps else None


def brief(result: dict[str, Any]) -> str:
    """One line of the report for the mode's result."""
    runs = {**result["by_k"], **result.get("known", {})}
    return "; ".join(
        f"{k}: {r['decode_ms_per_step']} ms/step, {r['tokens_per_step']} tokens/step, "
        f"{r['speedup']}x, acceptance {r['acceptance_rate']}"
        for k, r in runs.items()
    )
