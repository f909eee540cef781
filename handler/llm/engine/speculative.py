"""MTP speculative decoding: `k` draft tokens per request from the model's MTP layer, checked
by one forward of the model over them, kept by the rejection rule of speculative sampling.

A step of the engine with speculation on (`SchedulerConfig.speculative_tokens = k`):

1. **Verify.** Each decoding request's last token and its drafts (at most `k`) are one chunk
   of the model's forward, starting at the request's position (prefill chunks of other
   requests ride along); logits come back for every position of the chunk, and the hidden
   states after the final norm for every token of the step.
2. **Accept** (`verify_request`). Greedy: drafts are kept while each equals the argmax of the
   logits before it, then the argmax at the first mismatch (or after the last draft, the bonus
   token) is appended. Sampled: draft `d` of draft distribution `q` is kept with probability
   `min(1, p(d) / q(d))` under the target distribution `p`, else a token is drawn from
   `normalize(max(0, p - q))` and the rest dropped; after every draft kept, one more is drawn
   from `p`. So the tokens follow `p` whatever `q` is. `p` and `q` are both the sampler's
   distribution of their logits (`sampler.sampling_probs`: biases, penalties over the output
   so far, drafts kept before included, temperature, top-k, top-p), and every draw takes the
   request's own generator: a seeded request repeats itself. Appending stops where a request
   ends (eos, stop token or string, max_new_tokens, the model length): no token past its end.
3. **Draft** (`MTPDrafter.propose`). The MTP layer runs over every position the model
   computed this step, whose next token is now known (the draft-extend: its cache at those
   positions, from the model's hidden states there), and the last position's logits give
   draft 1; drafts 2..k each run the layer once more at the next position, on its own output.
   Drafts are the argmax (greedy requests) or a draw of the sampler's distribution (sampled
   ones), at most the tokens a request can still append minus one, so a request never writes
   past the pages reserved for its length.

A step whose requests each bring at most `k + 1` tokens (every decoding one) runs its verify
and its draft-extend one token a row (`one_token_rows`): the decode kernels take it, and CUDA
graphs hold it (`spec_graphs.py`); longer prefill chunks run as chunks, eagerly.

Greedy drafts stay on the device until the next step's verify, which takes them there, is
launched (`PendingDrafts`); a step of decoding greedy requests launches its draft-extend over
every verify row before the host reads which drafts were kept (`MTPDrafter.extend_ahead`).
So the GPU runs the draft steps while the host returns a step's tokens and schedules the
next, and the draft-extend while it accepts (docs/engine.md).

The KV the verify writes at rejected drafts' positions, and the MTP layer's at draft
positions, is overwritten by later steps before anything reads it: a request's lengths come
from `num_computed`. A request with a grammar (`SamplingParams.guide`) drafts under its
grammar's mask, its matcher looking ahead past each draft and taking them back after
(`GrammarMatcher.look_ahead`, `rollback`), and stops drafting where the grammar ends; its
verify masks each position by the grammar's state there (`structured.bitmask.mask_along`), so
its tokens are the plain loop's. The MTP layer runs over every prompt's positions, so that
any page the prefix cache hands out holds the MTP layer's entries too; with
speculation on, a prompt's page is registered only once its positions' next tokens are prompt
tokens (`Scheduler.computed`), so the entries are the same for every request that matches it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from snapfn.handler.llm.engine.batch import ForwardBatch
from snapfn.handler.llm.engine.copy_fence import HostCopy
from snapfn.handler.llm.engine.kv_pool import KVPool
from snapfn.handler.llm.engine.request import Request, RequestOutput
from snapfn.handler.llm.engine.sampler import sampling_probs, shape_logits
from snapfn.handler.llm.models.base import CausalLM
from snapfn.handler.llm.models.tensor_parallel import runs_every_request
from snapfn.handler.llm.structured.bitmask import mask_logits
from snapfn.snapshot.errors import UnsupportedModel

MAX_SPECULATIVE_TOKENS = 8


def one_token_rows(
    token_ids: list[list[int]], starts: list[int], pages: list[list[int]], page_size: int
) -> ForwardBatch:
    """Each request's new tokens as decode rows of their own (on the host): the token at
    position `p` a row over the request's pages that sees `p + 1` tokens. Its forward gives
    what the chunked batch's does at every token, each row's logits included."""
    rows = [
        (t, s + j, table)
        for ids, s, table in zip(token_ids, starts, pages, strict=True)
        for j, t in enumerate(ids)
    ]
    return ForwardBatch.build(
        [[t] for t, _, _ in rows],
        [p for _, p, _ in rows],
        [r for _, _, r in rows],
        page_size,
        "cpu",
    )


@dataclass
class SpecStats:
    """Counters since start: requests' verifications of drafts, drafts verified, drafts kept."""

    steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    def to_json(self) -> dict[str, float]:
        rate = self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0
        return {
            "steps": self.steps,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": round(rate, 4),
        }


def merge_outputs(outs: list[RequestOutput]) -> RequestOutput:
    """One request's outputs of one step (its verified tokens, in order) as one."""
    first, last = outs[0], outs[-1]
    return RequestOutput(
        first.request_id,
        tuple(t for o in outs for t in o.new_token_ids),
        tuple(lp for o in outs for lp in o.new_logprobs),
        "".join(o.text_delta for o in outs),
        last.finished,
        last.finish_reason,
        new_top_logprobs=tuple(top for o in outs for top in o.new_top_logprobs),
        prompt_logprobs=first.prompt_logprobs,
        prompt_top_logprobs=first.prompt_top_logprobs,
        error=last.error,
    )


def accept_sampled(
    drafts: list[int],
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> list[int]:
    """The rejection rule on one request's drafts: `draft_probs [d, V]` the distributions the
    drafts were drawn from, `target_probs [d + 1, V]` the model's at each draft and after the
    last (all on the host) -> the drafts kept and one token more (a draw of the residual at
    the first rejection, else of the last row)."""
    kept = []
    for i, draft in enumerate(drafts):
        p, q = target_probs[i], draft_probs[i]
        u = float(torch.rand((), generator=generator))
        if u * float(q[draft]) < float(p[draft]):  # u < p/q, with q(draft) > 0 (it was drawn)
            kept.append(draft)
            continue
        residual = (p - q).clamp_min(0.0)
        total = float(residual.sum())
        return [*kept, _draw(residual / total if total > 0 else p, generator)]
    return [*kept, _draw(target_probs[len(drafts)], generator)]


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def verify_request(req: Request, rows: torch.Tensor) -> list[int]:
    """The tokens `req` appends after its drafts were verified: `rows [d + 1, V]` the logits
    at its last token and at each draft (see the module docstring, step 2)."""
    drafts, p = req.draft_ids, req.params
    if p.greedy and not p.shapes_logits:
        best = rows.argmax(dim=-1).tolist()
        kept = next((i for i, d in enumerate(drafts) if d != best[i]), len(drafts))
        return [*drafts[:kept], best[kept]]
    if p.greedy:  # the shaped row's argmax, the drafts kept so far counted as output
        out = []
        for i, row in enumerate(rows):
            token = int(shape_logits(row, p, req.prompt_ids, req.output_ids + out).argmax())
            out.append(token)
            if i == len(drafts) or token != drafts[i]:
                return out
    target = torch.stack(
        [
            sampling_probs(shape_logits(row, p, req.prompt_ids, req.output_ids + drafts[:i]), p)
            for i, row in enumerate(rows)
        ]
    ).cpu()
    return accept_sampled(drafts, req.draft_probs, target, req.generator)


def draft_token(req: Request, logits: torch.Tensor, drafts: list[int]) -> tuple[int, torch.Tensor]:
    """One draft of `req` from the MTP layer's `logits [V]`, `drafts` before it in this step:
    (token, the distribution it was drawn from on the host; empty for greedy requests)."""
    p = req.params
    shaped = shape_logits(logits, p, req.prompt_ids, req.output_ids + drafts)
    if p.greedy:
        return int(shaped.argmax()), torch.empty(0)
    probs = sampling_probs(shaped, p).cpu()
    return _draw(probs, req.generator), probs


@dataclass
class DraftRow:
    """One request's positions in the draft-extend: `start` its first, `tokens` each
    position's next token, `hidden` the model's states there `[n, H]`, `num_drafts` how many
    drafts it takes (0: the MTP layer only fills its cache), `last_row` its last position's
    row in the verify (where the draft-extend ran ahead of the verify's read-back)."""

    req: Request
    start: int
    tokens: list[int]
    hidden: torch.Tensor
    num_drafts: int
    last_row: int = -1


@dataclass
class PendingDrafts:
    """Greedy drafts still on the device, and their copy to the host under way: the next
    step's verify takes them there (`input_ids`) and the host reads them only after launching
    it (`land`), so the GPU runs the draft steps while the host returns this step's tokens and
    schedules the next. Each drafting request holds a list of its drafts' count (`holders`),
    filled in place by `land`; a request whose drafts were replaced since (a new list) keeps
    the new ones."""

    holders: list[tuple[Request, list[int]]]
    drafts: torch.Tensor  # [requests, steps] int64, on the device
    copy: HostCopy  # of `drafts`

    @classmethod
    def launch(cls, rows: list[DraftRow], drafts: torch.Tensor) -> PendingDrafts:
        holders = []
        for r in rows:
            r.req.draft_ids = [0] * r.num_drafts  # their places, filled by `land`
            holders.append((r.req, r.req.draft_ids))
        return cls(holders, drafts, HostCopy.launch(drafts))

    def input_ids(
        self, reqs: list[Request], token_ids: list[list[int]], num_drafts: list[int]
    ) -> torch.Tensor:
        """A one-token-a-row step's input ids on the device, before the host has the drafts:
        the host's tokens, and at each held draft's place (the last `num_drafts[i]` of
        `token_ids[i]`) the draft on the device. No wait for the GPU."""
        held = {id(req): i for i, (req, ids) in enumerate(self.holders) if req.draft_ids is ids}
        flat = [t for ids in token_ids for t in ids]
        total, steps = len(flat), self.drafts.shape[1]
        index = []
        for req, ids, d in zip(reqs, token_ids, num_drafts, strict=True):
            row, first = held.get(id(req)), len(index)
            for j in range(len(ids)):
                drafted = row is not None and j >= len(ids) - d
                index.append(total + row * steps + j - (len(ids) - d) if drafted else first + j)
        both = _on(torch.tensor(flat + index, dtype=torch.int64), self.drafts.device)
        return torch.cat([both[:total], self.drafts.reshape(-1)])[both[total:]]

    def land(self) -> None:
        """Wait for the drafts' copy; each holder's list filled."""
        for (req, ids), drafts in zip(self.holders, self.copy.land().tolist(), strict=True):
            if req.draft_ids is ids:
                ids[:] = drafts[: len(ids)]

    def fill(self, reqs: list[Request], token_ids: list[list[int]], num_drafts: list[int]):
        """After `land`: the drafts' places in a step's `token_ids` (made from the holders'
        lists before they were filled) replaced by the drafts."""
        held = {id(req) for req, ids in self.holders if req.draft_ids is ids}
        for i, (req, d) in enumerate(zip(reqs, num_drafts, strict=True)):
            if d and id(req) in held:
                token_ids[i] = token_ids[i][: len(token_ids[i]) - d] + req.draft_ids[:d]


class MTPDrafter:
    """Drafts with the model's MTP layer 0, run `num_tokens` times a step (vLLM's reuse of one
    layer when more tokens than layers are drafted)."""

    def __init__(self, model: CausalLM, kv: KVPool, num_tokens: int, overlap: bool = True) -> None:
        if not 0 < num_tokens <= MAX_SPECULATIVE_TOKENS:
            raise UnsupportedModel(
                f"speculative_tokens must be in [0, {MAX_SPECULATIVE_TOKENS}], got {num_tokens}"
            )
        if model.num_draft_layers < 1:
            model.use_draft_layers()  # refuses a model without MTP layers
            raise UnsupportedModel(
                "the model was built without its MTP layers' KV cache: build it with "
                "speculative_tokens set (build_model), then its KV pool"
            )
        if model.lockstep:
            raise UnsupportedModel(
                "speculative decoding needs every rank to run every request: set "
                "SNAPFN_SPECULATIVE_TOKENS=0 with ep_dispatch 'all_to_all' or 'deepep'"
            )
        self.model = model
        self.kv = kv
        self.num_tokens = num_tokens
        self.overlap = overlap  # greedy drafts pending past the step (`PendingDrafts`)
        self.stats = SpecStats()
        self.graphs = None  # SpecGraphs, once captured (Engine.capture_graphs)
        self.pending: PendingDrafts | None = None  # the last step's drafts, still on the device

    def take_pending(self) -> PendingDrafts | None:
        """The drafts of the step before, not yet read by the host (None: none are)."""
        pending, self.pending = self.pending, None
        return pending

    def rows_fit(self, token_ids: list[list[int]]) -> bool:
        """Whether a step of these requests' new tokens runs one token a row: each brings at
        most `k + 1` (see the module docstring)."""
        return all(len(ids) <= self.num_tokens + 1 for ids in token_ids)

    def count(self, drafted: int, accepted: int) -> None:
        """One request's verified drafts, and how many of them were kept."""
        self.stats.steps += 1
        self.stats.draft_tokens += drafted
        self.stats.accepted_tokens += accepted

    def max_drafts(self, req: Request, max_model_len: int) -> int:
        """Drafts worth verifying for `req` now: one fewer than the tokens it can still append.
        None for a sampled request on ranks that run every request: a draw is each rank's own,
        and only the plain loop's pick is made the same on every rank (`broadcast_tokens`)."""
        if not req.params.greedy and runs_every_request(self.model.parallel):
            return 0
        end = min(len(req.prompt_ids) + req.params.max_new_tokens, max_model_len)
        return max(0, min(self.num_tokens, end - req.num_tokens - 1))

    def extend_ahead(
        self, batch: ForwardBatch, hidden: torch.Tensor, tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft-extend over every row of a verify of decoding requests (`batch`, one
        token a row, on the host), launched before the host has read what the verify kept:
        each row's next token is the verify's argmax there (`tokens`, on the device), the
        token appended after it wherever the row is kept, and its states `hidden`'s. Rows
        past a request's kept ones write the MTP layer's cache at places that its draft steps
        and the next step write again before anything reads them. -> (logits, outputs) of
        every row, for `propose(rows, ahead=)`."""
        return self._forward(batch, hidden, "draft_extend", input_ids=tokens)

    @torch.inference_mode()
    def propose(
        self, rows: list[DraftRow], ahead: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> None:
        """Run the draft-extend over `rows` and the draft steps after it; set each drafting
        request's `draft_ids` (and `draft_probs`, sampled ones). `ahead`: `extend_ahead`'s
        outputs, where it ran (every row's request drafting the argmax): the draft steps
        only, from each row's `last_row`."""
        for row in rows:
            row.req.draft_ids, row.req.draft_probs = [], None
        if not rows:
            return
        if ahead is not None:
            drafting = [r for r in rows if r.num_drafts > 0]
            if drafting:
                logits, out = ahead
                at = _on(torch.tensor([r.last_row for r in drafting]), logits.device)
                self._propose_on_device(drafting, logits[at], out[at])
            return
        tokens, starts = [r.tokens for r in rows], [r.start for r in rows]
        hidden = torch.cat([r.hidden for r in rows])
        drafting_at = [i for i, r in enumerate(rows) if r.num_drafts > 0]
        last = (torch.tensor([len(t) for t in tokens]).cumsum(0) - 1)[drafting_at]
        if self.rows_fit(tokens):  # every row's logits; the drafting ones' last kept
            batch = one_token_rows(tokens, starts, [r.req.pages for r in rows], self.kv.page_size)
            logits, out = self._forward(batch, hidden, "draft_extend")
            logits = logits[_on(last, logits.device)]
        else:
            batch = ForwardBatch.build(
                tokens,
                starts,
                [r.req.pages for r in rows],
                self.kv.page_size,
                "cpu",
                logits_per_seq=[int(r.num_drafts > 0) for r in rows],
            )
            logits, out = self.model.draft_forward(batch.to(self.model.device), self.kv, hidden)
        drafting = [rows[i] for i in drafting_at]
        states = out[_on(last, out.device)]
        if drafting and all(_argmax_drafts(r.req) for r in drafting):
            self._propose_on_device(drafting, logits, states)
            return
        probs: dict[int, list[torch.Tensor]] = {id(r.req): [] for r in drafting}
        ahead: dict[int, int] = {}  # a guided request's drafts its matcher looked past
        for step in range(max((r.num_drafts for r in drafting), default=0)):
            for r, row_logits in zip(drafting, logits, strict=True):
                matcher = r.req.matcher
                if matcher is not None:  # drafted under its grammar, at its place
                    row_logits = mask_logits(row_logits[None], [matcher])[0]
                token, dist = draft_token(r.req, row_logits, r.req.draft_ids)
                r.req.draft_ids.append(token)
                probs[id(r.req)].append(dist)
                if matcher is not None:
                    if matcher.look_ahead(token) and not matcher.finished:
                        ahead[id(r.req)] = ahead.get(id(r.req), 0) + 1
                    else:  # the grammar ends here (or took nothing): no draft after it
                        ahead[id(r.req)] = ahead.get(id(r.req), 0) + int(matcher.finished)
                        r.num_drafts = len(r.req.draft_ids)
            going = [i for i, r in enumerate(drafting) if r.num_drafts > step + 1]
            if not going:
                break
            drafting, states = [drafting[i] for i in going], states[going]
            logits, states = self._draft_step(drafting, states)
        for r in rows:
            if r.req.matcher is not None:
                r.req.matcher.rollback(ahead.get(id(r.req), 0))
            if r.num_drafts > 0 and not r.req.params.greedy:
                r.req.draft_probs = torch.stack(probs[id(r.req)])

    def _propose_on_device(
        self, rows: list[DraftRow], logits: torch.Tensor, states: torch.Tensor
    ) -> None:
        """Every drafting request drafts the argmax of the raw logits: each draft stays on the
        device as the next draft step's input, and all are read by the host after the next
        step's verify is launched (`PendingDrafts`). A request whose drafts are done rides
        along on the scratch page, so every step keeps its rows (its output is not read)."""
        picks = [logits.argmax(dim=-1)]  # draft 1 of each request
        scratch = [self.kv.scratch_page]
        for step in range(1, max(r.num_drafts for r in rows)):
            going = [r.num_drafts > step for r in rows]
            at = [r.start + len(r.tokens) + step - 1 for r in rows]  # its last draft's place
            batch = ForwardBatch.build(
                [[0]] * len(rows),  # replaced by the last drafts, on the device
                [p if g else 0 for p, g in zip(at, going, strict=True)],
                [r.req.pages if g else scratch for r, g in zip(rows, going, strict=True)],
                self.kv.page_size,
                "cpu",
            )
            logits, states = self._forward(batch, states, "draft", input_ids=picks[-1])
            picks.append(logits.argmax(dim=-1))
        pending = PendingDrafts.launch(rows, torch.stack(picks, dim=1))
        if self.overlap:
            self.pending = pending
        else:
            pending.land()

    def _draft_step(
        self, rows: list[DraftRow], states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP layer once more, at each request's position after its last draft's input,
        on its last draft and its own last output `states [B, H]`."""
        batch = ForwardBatch.build(
            [[r.req.draft_ids[-1]] for r in rows],
            [r.start + len(r.tokens) + len(r.req.draft_ids) - 1 for r in rows],
            [r.req.pages for r in rows],
            self.kv.page_size,
            "cpu",
        )
        return self._forward(batch, states, "draft")

    def _forward(
        self,
        batch: ForwardBatch,
        hidden: torch.Tensor,
        use: str,
        input_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP layer 0 over one-token-a-row `batch` (on the host; `input_ids` on the device in
        place of its tokens): its graph's replay where one fits, else eagerly."""
        if self.graphs is not None:
            out = self.graphs.run_draft(batch, hidden, use, input_ids)
            if out is not None:
                return out
        moved = batch.to(self.model.device)
        if input_ids is not None:
            moved = dataclasses.replace(moved, input_ids=input_ids)
        return self.model.draft_forward(moved, self.kv, hidden)


def _argmax_drafts(req: Request) -> bool:
    """Whether `req`'s drafts are the argmax of the MTP layer's raw logits."""
    return req.params.greedy and not req.params.shapes_logits and req.matcher is None


def _on(index: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host index tensor on `device` without the host waiting for the GPU (a pageable copy
    to the GPU would wait for the stream's work before it)."""
    if device.type != "cuda":
        return index
    return index.pin_memory().to(device, non_blocking=True)
