"""Whole-model parity of a fast backend against the torch reference (device probe), for the
benchmark models, whose random weights give logits too flat for plain greedy equality.

python3 bench/probes/model_parity.py MODEL_DIR [--backend flashinfer] [--prompts 4]
    [--new-tokens 32] [--graphs 1,2,4,8] [--tie 0.05] [--dtype auto] [--ref-dtype DTYPE]
    [--device cuda]

The fast engine (`--backend`, decode graphs captured for `--graphs`, the model's own dtype)
generates greedily for `--prompts` random prompts at once. The reference engine (`torch`,
eager, the same dtype unless `--ref-dtype` says another) then reads each prompt with the fast engine's tokens appended and gives its
logits at every generated position (teacher forcing, so that one near-tie cannot send the two
down different continuations). At each position the fast token must be the reference's argmax,
or within `--tie` nats of it (a near-tie, counted), and its logprob must agree within
`--logprob-atol`. Prints one JSON object; exits 1 on a mismatch.

`--ref-dtype float32` measures a 16-bit path against exact arithmetic: run once with the fast
backend and once with `--backend torch --graphs ''` (the reference's own 16-bit path) to see
whether the fast one strays further than 16-bit rounding does anyway (an MoE model's routing
flips at near-ties in bf16).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys

import torch

from snapfn.handler.llm.build import EngineOptions, build_engine
from snapfn.handler.llm.engine.batch import ForwardBatch
from snapfn.handler.llm.engine.engine import SchedulerConfig
from snapfn.handler.llm.engine.request import SamplingParams

PROMPT_LENGTHS = (7, 33, 64, 120, 5, 17, 48, 90)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model")
    parser.add_argument("--backend", default="flashinfer")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--graphs", default="1,2,4,8", help="decode graph buckets; '' for eager")
    parser.add_argument("--tie", type=float, default=0.05)
    parser.add_argument("--logprob-atol", type=float, default=0.1)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--ref-dtype", default=None, help="the reference's (default: --dtype)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    if not 1 <= args.prompts <= len(PROMPT_LENGTHS):
        parser.error(f"--prompts must be 1..{len(PROMPT_LENGTHS)}")
    buckets = [int(b) for b in args.graphs.split(",") if b]
    fast = engine(args, args.backend, args.dtype)
    vocab = fast.model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, vocab, (n,), generator=gen).tolist()
        for n in PROMPT_LENGTHS[: args.prompts]
    ]
    if buckets:
        fast.capture_graphs(buckets, max_seq_len=max(PROMPT_LENGTHS) + args.new_tokens + 1)
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    results = fast.generate([list(p) for p in prompts], [params] * len(prompts))
    graphs = None
    if buckets:
        stats = fast.graphs.stats
        graphs = {"replays": stats.replays, "eager_fallbacks": stats.eager_fallbacks}
    del fast
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    ref = engine(args, "torch", args.ref_dtype or args.dtype)
    report = compare(
        ref,
        prompts,
        [list(r.token_ids) for r in results],
        [list(r.logprobs) for r in results],
        args.tie,
        args.logprob_atol,
    )
    dtypes = {"dtype": args.dtype, "ref_dtype": args.ref_dtype or args.dtype}
    report = {"model": args.model, "backend": args.backend, **dtypes, "graphs": graphs, **report}
    if graphs is not None and (graphs["replays"] == 0 or graphs["eager_fallbacks"]):
        report["failures"].append(f"decode graphs not used as captured: {graphs}")
    report["ok"] = not report["failures"]
    print(json.dumps(report))
    return 0 if report["ok"] else 1


def engine(args: argparse.Namespace, backend: str, dtype: str):
    opts = EngineOptions(
        device=args.device,
        dtype=dtype,
        backend=backend,
        num_pages=256,
        scheduler=SchedulerConfig(page_size=16, max_num_batched_tokens=1024),
    )
    return build_engine(args.model, opts).engine


def compare(ref, prompts, tokens, logprobs, tie: float, logprob_atol: float) -> dict:
    """The fast engine's `tokens` / `logprobs` per prompt against `ref`'s teacher-forced
    logits: counts of exact and near-tie agreements, the largest logprob difference, and a
    line per failure."""
    exact = near = wrong = 0
    worst_gap = worst_lp = sum_lp = 0.0
    failures = []
    for i, (prompt, toks, lps) in enumerate(zip(prompts, tokens, logprobs, strict=True)):
        seq = prompt + toks[:-1]
        logits = prefill_logits(ref, seq)[len(prompt) - 1 :].float()
        ref_lp = torch.log_softmax(logits, dim=-1)
        for step, (tok, lp) in enumerate(zip(toks, lps, strict=True)):
            row = ref_lp[step]
            gap = (row.max() - row[tok]).item()
            diff = abs(row[tok].item() - lp)
            worst_lp, sum_lp = max(worst_lp, diff), sum_lp + diff
            if gap == 0.0:
                exact += 1
            elif gap < tie:
                near += 1
                worst_gap = max(worst_gap, gap)
            else:
                wrong += 1
                failures.append(
                    f"prompt {i} step {step}: token {tok} is {gap:.4f} nats below the "
                    f"reference's {int(row.argmax())}"
                )
            if diff >= logprob_atol:
                ref_tok = row[tok].item()
                failures.append(
                    f"prompt {i} step {step}: logprob {lp:.4f}, reference's {ref_tok:.4f}"
                )
    return {
        "positions": exact + near + wrong,
        "exact": exact,
        "near_ties": near,
        "largest_near_tie_gap": round(worst_gap, 5),
        "largest_logprob_diff": round(worst_lp, 5),
        # over every position: a steadier measure of how far two paths' rounding differs than
        # the count of flipped tokens
        "mean_logprob_diff": round(sum_lp / max(exact + near + wrong, 1), 6),
        "failures": failures,
    }


@torch.inference_mode()
def prefill_logits(engine, ids: list[int]) -> torch.Tensor:
    """`engine`'s logits at every position of `ids`, one prefill through its paged cache."""
    kv = engine.kv
    pages = kv.allocator.allocate(kv.pages_for(len(ids)))
    try:
        batch = ForwardBatch.build(
            [ids], [0], [pages], kv.page_size, engine.model.device, all_logits=True
        )
        return engine.model(batch, kv)
    finally:
        kv.allocator.free(pages)


if __name__ == "__main__":
    sys.exit(main())
