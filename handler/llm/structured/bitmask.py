"""Allowed-token bitmasks applied to a batch's logits, on the logits' device.

`mask_logits(logits, matchers)`: for the rows of `logits [B, V]` whose matcher is not None, the
matcher fills one int32 bitmask row on the host (`[n, ceil(V / 32)]`, one copy to the logits'
device for all of them), which is unpacked there and sets every refused token's logit to -inf.
Returns new logits (the input is left as it was: logprobs are of the raw distribution); rows
without a matcher are unchanged. Greedy and sampled rows alike pick from the result.

NOTE: llguidance's own `apply_token_bitmask_inplace` runs a `torch.compile`d kernel, which
compiles on its first call in each process (seconds on CPU, a Triton build on CUDA): a
restored worker's first structured request would pay it. The unpacking here is four plain
torch ops, the same on every device.
"""

from __future__ import annotations

import torch

from snapfn.handler.llm.structured.matcher import BITS_PER_WORD, GrammarMatcher, bitmask_words


def fill_bitmasks(matchers: list[GrammarMatcher], vocab_size: int) -> torch.Tensor:
    """Each matcher's allowed tokens: `[len(matchers), ceil(vocab_size / 32)]` int32, host."""
    host = torch.empty((len(matchers), bitmask_words(vocab_size)), dtype=torch.int32)
    for row, matcher in enumerate(matchers):
        matcher.fill_bitmask(host[row])
    return host


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`bitmask [n, W]` int32 unpacked to `[n, vocab_size]` bool, on the bitmask's device."""
    shifts = torch.arange(BITS_PER_WORD, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [n, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def mask_logits(logits: torch.Tensor, matchers: list[GrammarMatcher | None]) -> torch.Tensor:
    """`logits [B, V]` with each constrained row's refused tokens at -inf (module docstring)."""
    rows = [r for r, m in enumerate(matchers) if m is not None]
    if not rows:
        return logits
    vocab = logits.shape[-1]
    host = fill_bitmasks([matchers[r] for r in rows], vocab)
    allowed = allowed_tokens(host.to(logits.device), vocab)  # [n, V]
    masked = logits.clone()
    index = torch.tensor(rows, device=logits.device)
    masked[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return masked


def mask_along(rows: torch.Tensor, matcher: GrammarMatcher, tokens: list[int]) -> torch.Tensor:
    """`rows [len(tokens) + 1, V]` (a verify's: at a request's last token and at each of its
    drafts `tokens`) with row `i`'s refused tokens at -inf by the grammar's state after
    `tokens[:i]`; past a token the grammar refuses or ends on, the rows keep that state's mask
    (a verify never keeps a draft past it). The matcher is left where it was."""
    vocab = rows.shape[-1]
    host = torch.empty((len(tokens) + 1, bitmask_words(vocab)), dtype=torch.int32)
    matcher.fill_bitmask(host[0])
    ahead = 0
    for i, token in enumerate(tokens):
        if ahead == i and matcher.look_ahead(token):
            ahead += 1
            matcher.fill_bitmask(host[i + 1])
        else:
            host[i + 1] = host[i]
    matcher.rollback(ahead)
    allowed = allowed_tokens(host.to(rows.device), vocab)
    return rows.masked_fill(~allowed, float("-inf"))
