"""Sampling: greedy, temperature, top-k, top-p, per-request seeds, penalties, logit biases;
the chosen token's logprob and, when asked, the most likely alternatives.

Logprobs are of the model's raw distribution (log-softmax of the logits before penalties,
biases, temperature and filtering), as vLLM and SGLang report them by default.

A row is shaped before it is picked from, in vLLM's order: `logit_bias` added, then
`repetition_penalty` over the prompt and output tokens (a logit > 0 divided by it, one <= 0
multiplied), then `frequency_penalty` × each token's count in the output and
`presence_penalty` for each token present in it subtracted. Greedy is the argmax of the shaped
row; sampling divides it by the temperature, then filters by top-k and top-p.

A request with a grammar (`SamplingParams.guide`, structured output) has its refused tokens'
logits set to -inf before anything else is done to its row (`structured/bitmask.py`, on the
logits' device); greedy or sampled, it picks from what its grammar allows. Its logprobs stay
those of the raw distribution.

A batch whose every request is plain greedy (`SamplingParams.plain_greedy`; a request with a
grammar is not) goes through `picks` (a backend's kernel, `greedy_picks`'s contract) with one
copy to the host; any other batch is picked row by row here, on the reference path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from snapfn.handler.llm.engine.request import Request, SamplingParams, TopLogprobs
from snapfn.handler.llm.structured.bitmask import mask_logits


@dataclass(frozen=True)
class Picks:
    """One token per row, its raw logprob, and its row's alternatives (empty when not asked)."""

    tokens: list[int]
    logprobs: list[float]
    top_logprobs: list[TopLogprobs]


def greedy_picks(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's argmax of `logits [B, V]`, on their device, with no host sync: (tokens [B]
    int64, [B, 2] float64 of token id and its logprob — one tensor, so one copy to the host)."""
    greedy = logits.argmax(dim=-1, keepdim=True)
    logprobs = torch.log_softmax(logits, dim=-1).gather(1, greedy)
    return greedy[:, 0], torch.cat([greedy.double(), logprobs.double()], dim=1)


def sample(
    logits: torch.Tensor,
    requests: list[Request],
    picks: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] = greedy_picks,
) -> Picks:
    """Pick one token per row of `logits [B, V]` (float32) for each request; an all-plain-greedy
    batch through `picks` (default `greedy_picks`; a backend's kernel, same contract)."""
    if all(req.params.plain_greedy for req in requests):
        # NOTE: one copy to the host for the tokens and their logprobs together: each copy
        # waits for the GPU, and a decode step's host time adds to its latency
        rows = picks(logits)[1].tolist()  # float64 holds every token id exactly
        return Picks([int(t) for t, _ in rows], [lp for _, lp in rows], [()] * len(rows))
    logprobs_all = torch.log_softmax(logits, dim=-1)
    logits = mask_logits(logits, [req.matcher for req in requests])
    greedy_host = logits.argmax(dim=-1).tolist()  # one copy for the rows that are plain argmax
    tokens = []
    for row, req in enumerate(requests):
        p = req.params
        if p.greedy and not p.shapes_logits:
            tokens.append(greedy_host[row])
            continue
        shaped = shape_logits(logits[row], p, req.prompt_ids, req.output_ids)
        tokens.append(int(shaped.argmax()) if p.greedy else _sample_row(shaped, req))
    index = torch.tensor(tokens, device=logits.device)
    chosen = logprobs_all.gather(1, index[:, None])[:, 0].tolist()
    tops = [
        top_logprobs(logprobs_all[r], req.params.top_logprobs) for r, req in enumerate(requests)
    ]
    return Picks(tokens, chosen, tops)


def shape_logits(
    logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int]
) -> torch.Tensor:
    """One row of logits `[V]` after the request's biases and penalties (the row itself when it
    has none)."""
    if not params.shapes_logits:
        return logits
    logits = logits.clone()
    vocab, device = logits.shape[-1], logits.device
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], device=device)
        bias = torch.tensor([b for _, b in params.logit_bias], device=device, dtype=logits.dtype)
        logits.index_add_(0, ids, bias)
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(prompt_ids + output_ids, dtype=torch.int64, device=device)
        mask = torch.zeros(vocab, dtype=torch.bool, device=device).index_fill_(0, seen, True)
        penalty = params.repetition_penalty
        # NOTE: clamped: a penalty near 0 would overflow a positive logit to inf, and a row
        # with inf in it samples nothing (NaN probabilities)
        divided = (logits / penalty).clamp(max=torch.finfo(logits.dtype).max)
        shaped = torch.where(logits > 0, divided, logits * penalty)
        logits = torch.where(mask, shaped, logits)
    if output_ids and (params.frequency_penalty or params.presence_penalty):
        out = torch.tensor(output_ids, dtype=torch.int64, device=device)
        counts = torch.bincount(out, minlength=vocab)[:vocab].to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return logits


def top_logprobs(logprobs: torch.Tensor, k: int) -> TopLogprobs:
    """The `k` most likely tokens of one row of logprobs `[V]`, most likely first (ties: the
    lower id first)."""
    if k <= 0:
        return ()
    values, ids = torch.topk(logprobs, min(k, logprobs.shape[-1]))
    return tuple(zip(ids.tolist(), values.tolist(), strict=True))


def prompt_logprobs(
    logits: torch.Tensor, next_ids: list[int], k: int
) -> tuple[list[float], list[TopLogprobs]]:
    """Logprobs of `next_ids` (the token after each row's position) under `logits [n, V]`, and
    each row's `k` alternatives."""
    logprobs = torch.log_softmax(logits, dim=-1)
    index = torch.tensor(next_ids, device=logits.device)[:, None]
    chosen = logprobs.gather(1, index)[:, 0].tolist()
    return chosen, [top_logprobs(row, k) for row in logprobs]


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution `[V]` a sampled row is drawn from: its shaped logits (`shape_logits`)
    over the temperature, filtered by top-k and top-p (speculative decoding's target and
    draft distributions are this too)."""
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        probs = _top_p_filter(probs, params.top_p)
    return probs


def _sample_row(logits: torch.Tensor, req: Request) -> int:
    probs = sampling_probs(logits, req.params)
    generator = req.generator if req.generator is not None else None
    # NOTE: sampling on CPU with the request's own generator keeps seeded runs identical
    # across devices and batch compositions.
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_probs, order = probs.sort(descending=True)
    cumulative = sorted_probs.cumsum(-1)
    drop = cumulative - sorted_probs > top_p  # keep the smallest prefix reaching top_p
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    filtered = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return filtered / filtered.sum()


def make_generator(seed: int | None) -> torch.Generator | None:
    if seed is None:
        return None
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g
