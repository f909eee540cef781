"""CUDA graphs of speculative decoding: the verify, the draft-extend and the draft steps.

A speculative step whose requests all bring at most `k + 1` new tokens (every decoding
request: its last token and its drafts) runs them as rows of one decode batch, a token a row
(`speculative.one_token_rows`): the row of a request's token at position `p` sees the `p + 1`
tokens before and at it through the request's page row. Attention, the MLA and the DSA
indexer run their decode kernels, whose rows are independent, so the verify is the decode
step over more rows and captures as a decode step does. The MTP layer's draft-extend over a
request's accepted positions and each further draft step (a row a request) are
`draft_forward` over decode rows too: one family of graphs replays both, counted apart.

Two families, a graph per row bucket each, in one memory pool, captured at init and at every
restore (as the decode graphs are):
- "verify": `forward_hidden` -> the logits and the final-norm hidden states of every row;
- "draft": `draft_forward` of MTP layer 0 over a static hidden-state input -> the logits and
  the layer's output of every row.
Row buckets: each decode bucket `b` times `k + 1` for the verify (a batch of `b` requests with
`k` drafts each), and for the draft family those with the decode buckets as well (a draft
step's rows are its requests). A step past the largest bucket, or with a page row wider than
the captured width, runs eagerly and counts as an eager fallback.
"""

from __future__ import annotations

import torch

from snapfn.handler.llm.engine.batch import ForwardBatch
from snapfn.handler.llm.engine.graphs import DecodeGraphs, GraphStats
from snapfn.handler.llm.engine.kv_pool import KVPool

USES = ("verify", "draft_extend", "draft")


def spec_buckets(decode_buckets: list[int], num_tokens: int) -> tuple[list[int], list[int]]:
    """(verify row buckets, draft row buckets) for `num_tokens` drafts a step."""
    verify = sorted({b * (num_tokens + 1) for b in decode_buckets})
    return verify, sorted({*decode_buckets, *verify})


class VerifyGraphs(DecodeGraphs):
    """The model's forward over decode rows, with the hidden states the MTP layer reads."""

    def _run(self, batch: ForwardBatch, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.forward_hidden(batch, self.kv)


class DraftGraphs(DecodeGraphs):
    """MTP layer 0 over decode rows: its hidden-state input is a static buffer too."""

    def __init__(self, model, kv: KVPool, buckets: list[int], max_seq_len: int) -> None:
        super().__init__(model, kv, buckets, max_seq_len)
        hidden = model.config.hidden_size
        self.hidden = torch.zeros(max(self.buckets), hidden, dtype=model.dtype, device=model.device)

    def _run(self, batch: ForwardBatch, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.draft_forward(batch, self.kv, self.hidden[:n])

    def replay_draft(
        self, batch: ForwardBatch, n: int, hidden: torch.Tensor, input_ids=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`batch`'s rows with `hidden [b, H]` their states (and `input_ids`, on the device,
        their tokens), through bucket `n`'s graph."""
        self.hidden[: hidden.shape[0]].copy_(hidden)
        return self.replay(batch, n, input_ids)


class SpecGraphs:
    """Both families, and the engine's and the drafter's way into them."""

    def __init__(
        self,
        model,
        kv: KVPool,
        decode_buckets: list[int],
        num_tokens: int,
        max_seq_len: int,
    ) -> None:
        verify, draft = spec_buckets(decode_buckets, num_tokens)
        self.verify = VerifyGraphs(model, kv, verify, max_seq_len)
        self.draft = DraftGraphs(model, kv, draft, max_seq_len)
        self.stats = GraphStats(
            buckets=verify,
            families={"verify": verify, "draft": draft},
            replays_by_use=dict.fromkeys(USES, 0),
        )

    def capture(self, pool=None) -> None:
        self.verify.capture(pool)
        self.draft.capture(self.verify.pool)
        self.stats.capture_s = self.verify.stats.capture_s + self.draft.stats.capture_s

    def run_verify(
        self, batch: ForwardBatch, input_ids=None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The verify of one-token-a-row `batch` from its graph (`input_ids` on the device in
        place of its tokens); None where none fits."""
        n = self.verify.bucket_for(batch)
        if n is None:
            self.stats.eager_fallbacks += 1
            return None
        self._count("verify")
        return self.verify.replay(batch, n, input_ids)

    def run_draft(
        self, batch: ForwardBatch, hidden: torch.Tensor, use: str, input_ids=None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A draft-extend or draft step (`use`) of one-token-a-row `batch` from its graph
        (`input_ids` on the device in place of its tokens); None where none fits."""
        n = self.draft.bucket_for(batch)
        if n is None:
            self.stats.eager_fallbacks += 1
            return None
        self._count(use)
        return self.draft.replay_draft(batch, n, hidden, input_ids)

    def _count(self, use: str) -> None:
        self.stats.replays += 1
        self.stats.replays_by_use[use] += 1
