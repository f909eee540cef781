"""Sampling: greedy, temperature, top-k, top-p, per-request seeds; logprob of the chosen token.

Logprobs are of the model's raw distribution (log-softmax of the logits before temperature and
filtering), as vLLM and SGLang report them by default.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from snapfn.handler.llm.engine.request import Request


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
) -> tuple[list[int], list[float]]:
    """Pick one token per row of `logits [B, V]` (float32) for each request; an all-greedy
    batch through `picks` (default `greedy_picks`; a backend's kernel, same contract)."""
    if all(req.params.greedy for req in requests):
        # NOTE: one copy to the host for the tokens and their logprobs together: each copy
        # waits for the GPU, and a decode step's host time adds to its latency
        rows = picks(logits)[1].tolist()  # float64 holds every token id exactly
        return [int(t) for t, _ in rows], [lp for _, lp in rows]
    logprobs_all = torch.log_softmax(logits, dim=-1)
    greedy_host = logits.argmax(dim=-1).tolist()
    tokens = []
    for row, req in enumerate(requests):
        if req.params.greedy:
            tokens.append(greedy_host[row])
        else:
            tokens.append(_sample_row(logits[row], req))
    index = torch.tensor(tokens, device=logits.device)
    chosen = logprobs_all.gather(1, index[:, None])[:, 0].tolist()
    return tokens, chosen


def _sample_row(logits: torch.Tensor, req: Request) -> int:
    p = req.params
    logits = logits / p.temperature
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        probs = _top_p_filter(probs, p.top_p)
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
