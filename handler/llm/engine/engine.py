"""The LLM engine: a loaded model, its KV pool, a scheduler and a sampler, stepped in a loop.

`Engine.step()` runs one forward over the scheduled batch and returns per-request outputs
(the streaming unit); `generate()` drives it to completion for a list of prompts.
Prompts longer than `max_req_input_len` are refused before any work is done.

Prefix caching (`SchedulerConfig.prefix_caching`, on by default): a prompt that starts with
full pages an earlier prompt computed holds those pages and prefills only the rest
(`prefix_cache.py`; the scheduler matches and registers, `_advance` reports what was computed).

Sampling is `sampler.py`'s: a batch of plain greedy requests is picked on the device by the
backend's kernel; penalties, biases and logprob alternatives take the reference path. A step
that prefills a request asking for its prompt's logprobs (`SamplingParams.prompt_logprobs`,
the completions API's `echo` with `logprobs`) computes logits at every position of the step
(`ForwardBatch.all_logits`), and the request's first output carries them.

Structured output (`SamplingParams.guide`): with a compile cache attached (`attach_grammars`,
`structured/compiler.py`), a request with a guide gets its matcher where it is checked (a
spec that does not compile is a BadRequest), the sampler masks its row, each appended token
advances the matcher, and the grammar's end ends the request with finish_reason "stop".

Short prefills (`SchedulerConfig.prefill_graph_tokens`, on by default): a step that is not a
decode step but is no longer than the largest decode graph replays a captured decode graph, a
row a token (`_replay_rows`), in place of an eager forward whose kernel launches cost more host
time than the GPU spends on it.

Overlapped decode (`SchedulerConfig.overlap_decode`, on by default): a greedy decode step
replayed from a CUDA graph is landed one step late. `step()` launches the next decode step
(same requests, input ids straight from the GPU) before it waits for the current one's tokens,
so the host's work hides behind the GPU's (`in_flight.py`). It speculates only while nothing
else could be scheduled: no waiting request that fits the pool now, every running request in
the step, none ending by length; a request that stops on a token or string, or is cancelled,
drops its speculated row. Tokens and logprobs are those of the plain loop.

Speculative decoding (`SchedulerConfig.speculative_tokens = k`, off by default; a model with
MTP layers, on ranks that each run every request): each step verifies every decode's drafts in one forward, appends the
tokens the rejection rule keeps (greedy: exactly the tokens of the plain loop), then drafts
the next step's with the MTP layer (`speculative.py`). A step of decoding requests runs a
token a row, which CUDA graphs hold (the verify's, the draft-extend's and the draft steps':
`spec_graphs.py`, captured by `capture_graphs` in place of the decode graphs); no overlapped
decode. A request's tokens of one step come in one output.

Lock step (`CausalLM.lockstep`: expert-parallel ranks that exchange tokens all-to-all, each
running its own requests): every rank's `step()` runs exactly one forward, an idle one
(`CausalLM.idle_forward`) where it has nothing scheduled, and `generate()` goes on stepping
until no rank has work left (one all-reduce per step), so that the ranks' collectives pair up.
Every rank calls `generate()` together, round by round: a rank with no prompts for a round
calls it with none and serves the others' tokens to its experts.
Such a model runs eager: its exchange reads split sizes on the host, which no CUDA graph holds.
"""

from __future__ import annotations

import itertools
import threading
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from snapfn.handler.llm.config import ModelConfig
from snapfn.handler.llm.engine.batch import ForwardBatch
from snapfn.handler.llm.engine.copy_fence import HostCopy
from snapfn.handler.llm.engine.graphs import DecodeGraphs, GraphStats
from snapfn.handler.llm.engine.in_flight import InFlightStep, PickBuffers
from snapfn.handler.llm.engine.kv_pool import KVPool
from snapfn.handler.llm.engine.request import (
    GenerationResult,
    Request,
    RequestOutput,
    SamplingParams,
)
from snapfn.handler.llm.engine.sampler import (
    make_generator,
    prompt_logprobs,
    sample,
    top_logprobs,
)
from snapfn.handler.llm.engine.scheduler import ScheduledStep, Scheduler
from snapfn.handler.llm.engine.spec_graphs import SpecGraphs
from snapfn.handler.llm.engine.speculative import (
    DraftRow,
    MTPDrafter,
    merge_outputs,
    one_token_rows,
    verify_request,
)
from snapfn.handler.llm.models.base import CausalLM
from snapfn.handler.llm.models.tensor_parallel import broadcast_tokens, runs_every_request
from snapfn.handler.llm.structured.bitmask import mask_along
from snapfn.handler.llm.tokenizer import IncrementalDetokenizer, Tokenizer, find_stop
from snapfn.snapshot.errors import BadRequest


@dataclass(frozen=True)
class SchedulerConfig:
    page_size: int = 16
    max_running_requests: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    overlap_decode: bool = True  # land greedy graph decode steps one step late (module doc)
    prefix_caching: bool = True  # share full prompt pages across requests (prefix_cache.py)
    # pages taken as tokens need them, the latest request preempted where none is left
    # (scheduler.py); off: admission reserves every page a request can need
    preemption: bool = True
    speculative_tokens: int = 0  # MTP drafts verified per decode step; 0: off (speculative.py)
    # greedy drafts read by the host after the next verify's launch, the draft-extend ahead
    # of the verify's read-back (speculative.py); off: each read when made, in turn
    overlap_speculative: bool = True
    # a step of at most this many tokens that is not a decode step (a short prefill, or one
    # beside decodes) replays a decode graph, a row a token (module doc); 0: such steps run eagerly
    prefill_graph_tokens: int = 64


# the most context a step's rows may read, summed over its rows, for the step to replay a decode
# graph: each row reads its context through the decode kernel, where a prefill reads it once
# (32768 tokens of an 8B's KV is 4.3 GB, ~1.5 ms at an H100's HBM rate; an eager short prefill
# of that model spends ~37 ms launching its kernels)
ROW_CONTEXT_TOKENS = 32768


class Engine:
    def __init__(
        self,
        model: CausalLM,
        kv: KVPool,
        sched: SchedulerConfig,
        tokenizer: Tokenizer | None = None,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.model = model
        self.kv = kv
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        cfg: ModelConfig = model.config
        # NOTE: capped at a sliding attention window: within it windowed attention is full
        # attention, which is what the kernels compute (config.py)
        self.max_model_len = min(
            sched.max_model_len or cfg.max_position_embeddings,
            cfg.max_position_embeddings,
            cfg.sliding_window or cfg.max_position_embeddings,
        )
        self.scheduler = Scheduler(
            kv.allocator,
            kv.page_size,
            sched.max_running_requests,
            sched.max_num_batched_tokens,
            self.max_model_len,
            sched.prefix_caching,
            sched.speculative_tokens,
            sched.preemption,
        )
        self._requests: dict[str, Request] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._lock = threading.Lock()
        self.graphs: DecodeGraphs | None = None
        self.spec_graphs: SpecGraphs | None = None  # speculative decoding's, in place of graphs
        self.overlap_decode = sched.overlap_decode
        self.prefill_graph_tokens = sched.prefill_graph_tokens
        self._in_flight: InFlightStep | None = None
        self._pick_buffers: PickBuffers | None = None
        self.overlapped_steps = 0  # decode steps launched before the previous one landed
        # greedy picks on the device: the backend's kernel where it has one (`Backend.greedy_picks`)
        self._picks = model.backend.greedy_picks
        self.drafter = (
            MTPDrafter(model, kv, sched.speculative_tokens, sched.overlap_speculative)
            if sched.speculative_tokens
            else None
        )
        self.grammars = None  # a structured.GrammarCache of the tokenizer (attach_grammars)

    def capture_graphs(
        self, buckets: list[int], max_seq_len: int, pool=None, on_first_use: bool = False
    ) -> GraphStats:
        """Capture decode CUDA graphs for `buckets`; later decode steps replay them
        (`on_first_use`: each captured by the first step that needs it, `graphs.py`). With
        speculative decoding: the verify and draft graphs of those batch sizes instead
        (`spec_graphs.py`), all at once."""
        if self.model.lockstep:
            raise BadRequest(
                "this model exchanges tokens all-to-all across ep ranks (ep_dispatch="
                "'all_to_all' or 'deepep'), which a CUDA graph cannot hold: run it without graphs"
            )
        max_seq_len = min(max_seq_len, self.max_model_len)
        if self.drafter is not None:
            spec = SpecGraphs(self.model, self.kv, buckets, self.drafter.num_tokens, max_seq_len)
            spec.capture(pool)
            self.spec_graphs = self.drafter.graphs = spec
            return spec.stats
        graphs = DecodeGraphs(self.model, self.kv, buckets, max_seq_len)
        if on_first_use:
            graphs.capture_on_first_use(pool)
        else:
            graphs.capture(pool)
        self.graphs = graphs
        self._pick_buffers = PickBuffers(max(graphs.buckets))
        return graphs.stats

    @property
    def graph_stats(self) -> GraphStats | None:
        """The captured graphs' counters (decode, or speculative decoding's); None: none."""
        graphs = self.graphs or self.spec_graphs
        return graphs.stats if graphs is not None else None

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run `batch` (built on the host): a decode graph's replay copies it into the graph's
        inputs itself (a short step that is not a decode step: its tokens as rows of one,
        `_replay_rows`); anything else moves it to the model's device first."""
        graphs = self.graphs
        if graphs is not None:
            bucket = graphs.bucket_for(batch)
            if bucket is not None:
                return graphs.replay(batch, bucket)
            if batch.is_decode:
                graphs.stats.eager_fallbacks += 1
            else:
                logits = self._replay_rows(batch)
                if logits is not None:
                    return logits
        return self.model(batch.to(self.model.device), self.kv)

    @contextmanager
    def prefills_as_rows(self, on: bool):
        """Inside: short prefills replay decode graphs (`_replay_rows`) only if `on`."""
        saved = self.prefill_graph_tokens
        self.prefill_graph_tokens = saved if on else 0
        try:
            yield
        finally:
            self.prefill_graph_tokens = saved

    def _replay_rows(self, batch: ForwardBatch) -> torch.Tensor | None:
        """`batch`'s logits from a decode graph replaying each of its tokens as a row of its own
        (the context up to and including it: `seq_len` = its position + 1, its request's page
        table), or None where the step is too long for that (`prefill_graph_tokens`, the
        largest bucket, `ROW_CONTEXT_TOKENS`). A bucket not captured yet (graphs captured on
        first use) runs the same padded rows eagerly, uncaptured. Every row's K/V is written
        before a layer's attention reads any, so each token attends to its request's earlier
        tokens of this step as a prefill's does. The logits are those rows of the graph's
        output that the batch asks for (each request's last token; every token with
        `all_logits`)."""
        num_tokens = batch.input_ids.shape[0]
        if num_tokens > self.prefill_graph_tokens or self.drafter is not None:
            return None
        positions = batch.positions.tolist()
        if sum(positions) + num_tokens > ROW_CONTEXT_TOKENS:
            return None
        tables = batch.page_table_cpu.tolist()
        owners = [b for b, q in enumerate(batch.q_lens_cpu) for _ in range(q)]
        rows = ForwardBatch.build(
            [[t] for t in batch.input_ids.tolist()],
            positions,
            [tables[b] for b in owners],
            batch.page_size,
            "cpu",
        )
        bucket = self.graphs.bucket_for(rows)
        if bucket is None:
            return None
        if self.graphs.captured(bucket):
            out = self.graphs.replay(rows, bucket)
            self.graphs.stats.prefill_replays += 1
        else:  # NOTE: a capture costs more than the eager prefill it would replace; the same
            # kernels run eagerly give the replay's logits, as every process's first request must
            out = self.graphs.run_uncaptured(rows, bucket)
        return out if batch.all_logits else _take_rows(out, batch.logits_indices.tolist())

    def attach_tokenizer(self, tokenizer: Tokenizer | None, eos_token_ids: frozenset[int]) -> None:
        """Set the tokenizer (for text, streaming and stop strings) and the eos ids."""
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids

    def attach_grammars(self, grammars) -> None:
        """Set the compile cache that requests with a guide take their matchers from."""
        self.grammars = grammars

    @property
    def max_req_input_len(self) -> int:
        """Longest prompt accepted: one token of room must remain in the model length and the pool."""
        return min(self.max_model_len, self.kv.capacity_tokens) - 1

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> Request:
        """The request `add_request` would queue, checked (BadRequest saying what to fix), not
        queued: a lock-step driver checks a request where it arrives and adds it between steps."""
        params.validate()
        self._check_prompt(prompt_ids)
        self._check_logit_bias(params)
        req = Request(list(prompt_ids), params)
        if params.guide is not None:
            if self.grammars is None:
                raise BadRequest(
                    "structured output needs the model's tokenizer, which this engine lacks"
                )
            req.matcher = self.grammars.matcher(params.guide)
        if self.scheduler.pages_needed(req) > self.kv.num_pages:
            raise BadRequest(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) needs more "
                f"KV cache than the whole pool holds ({self.kv.capacity_tokens} tokens); lower max_new_tokens"
            )
        return req

    def add_request(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> str:
        req = self.check_request(prompt_ids, params)
        if request_id is not None:
            req.request_id = request_id
        req.generator = make_generator(params.seed)
        with self._lock:
            if req.request_id in self._requests:
                raise BadRequest(f"request id {req.request_id!r} is already in use")
            self._requests[req.request_id] = req
            if self.tokenizer is not None:
                self._detok[req.request_id] = IncrementalDetokenizer(
                    self.tokenizer, context_ids=req.prompt_ids[-6:]
                )
            self.scheduler.add(req)
        return req.request_id

    def _check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise BadRequest("the prompt is empty: give at least one token")
        if len(prompt_ids) > self.max_req_input_len:
            window = self.model.config.sliding_window
            why = (
                f"the model's sliding attention window of {window} tokens, which this engine"
                " serves no context beyond"
                if window == self.max_model_len <= self.kv.capacity_tokens
                else "max_req_input_len"
            )
            raise BadRequest(
                f"prompt has {len(prompt_ids)} tokens, more than the {self.max_req_input_len} this "
                f"engine accepts ({why}); shorten the prompt"
            )
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise BadRequest(f"prompt token ids out of range [0, {vocab}): {bad[:8]}")

    def _check_logit_bias(self, params: SamplingParams) -> None:
        vocab = self.model.config.vocab_size
        bad = [t for t, _ in params.logit_bias if not 0 <= t < vocab]
        if bad:
            raise BadRequest(f"logit_bias token ids out of range [0, {vocab}): {bad[:8]}")

    def cancel(self, request_id: str) -> bool:
        """Stop a request and free its pages. False if it is unknown or already finished."""
        with self._lock:
            req = self._requests.get(request_id)
            if req is None or req.finished:
                return False
            self.scheduler.finish(req, "cancelled")
            self._forget(req)
            return True

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None

    def kv_usage(self) -> float:
        """Share of the pool's pages held by requests (cached pages no request holds are
        counted free: an admission takes them back)."""
        return 1.0 - self.scheduler.num_available_pages() / self.kv.num_pages

    def prefix_cache_stats(self) -> dict[str, int] | None:
        """The prefix cache's counters and page counts; None when it is off."""
        cache = self.scheduler.prefix_cache
        return cache.to_json() if cache is not None else None

    def spec_stats(self) -> dict[str, float] | None:
        """Speculative decoding's counters (drafts verified and kept); None when it is off."""
        return self.drafter.stats.to_json() if self.drafter is not None else None

    def clear_prefix_cache(self) -> None:
        """Forget every cached page (before a process checkpoint: the pool's memory does not
        come back with the image)."""
        with self._lock:
            if self.scheduler.prefix_cache is not None:
                self.scheduler.prefix_cache.clear()

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        with self._lock:
            if self._in_flight is not None:
                return self._land(self._in_flight)
            scheduled = self.scheduler.schedule()
            if scheduled is None:
                if self.drafter is not None:
                    self.drafter.take_pending()  # drafts of requests that ended: dropped
                if self.model.lockstep:
                    self.model.idle_forward()  # the other ranks' forwards pair with this
                return []
            if self.drafter is not None:
                return self._step_speculative(scheduled)
            batch = ForwardBatch.build(
                scheduled.token_ids,
                scheduled.start_positions,
                [r.pages for r in scheduled.requests],
                self.kv.page_size,
                "cpu",
                all_logits=any(_scores_prompt(r) for r in scheduled.requests),
                prompt_lens=[len(r.prompt_ids) for r in scheduled.requests],
            )
            bucket = self._overlap_bucket(scheduled.requests, batch)
            if bucket is not None:
                return self._land(self._launch(scheduled.requests, batch, bucket))
            logits = self._forward(batch)
            num_new = [len(t) for t in scheduled.token_ids]
            if batch.all_logits:
                logits = self._score_prompts(scheduled.requests, num_new, logits)
            return self._advance(scheduled.requests, num_new, logits)

    def _step_speculative(self, scheduled: ScheduledStep) -> list[RequestOutput]:
        """Verify every decode's drafts in one forward, append what the rejection rule keeps,
        then draft the next step's (`speculative.py`)."""
        reqs, token_ids = scheduled.requests, scheduled.token_ids
        # a decode's tokens past its one new token are the drafts the budget let through
        num_drafts = [
            max(0, len(ids) - (r.num_tokens - r.num_computed))
            for r, ids in zip(reqs, token_ids, strict=True)
        ]
        starts = [0, *itertools.accumulate(len(t) for t in token_ids)]
        verified = self._verify(scheduled, num_drafts, starts)
        logits, rows, argmax = verified.logits, verified.rows, verified.argmax
        outputs: dict[str, RequestOutput] = {}
        plain: list[tuple[Request, torch.Tensor]] = []  # no drafts: the plain loop's pick
        for i, (req, n, d) in enumerate(zip(reqs, map(len, token_ids), num_drafts, strict=True)):
            if _scores_prompt(req):
                self._record_prompt_logprobs(req, logits[starts[i] : starts[i] + n])
            req.num_computed += n - d
            self.scheduler.computed(req)
            if req.num_computed < req.num_tokens:
                continue  # a prefill chunk before the prompt's last
            mine = logits[rows[i] : rows[i] + 1 + d]
            if d == 0:
                plain.append((req, mine[-1]))
                continue
            req.draft_ids = req.draft_ids[:d]
            if argmax is not None and _argmax_verified(req):
                best, logprobs = (p[rows[i] : rows[i] + 1 + d] for p in argmax)
                kept = next((j for j, t in enumerate(req.draft_ids) if t != best[j]), d)
                tokens = [*req.draft_ids[:kept], best[kept]]
                out = self._append_picked(req, tokens, logprobs)
            else:  # a guided request's rows masked by its grammar at each place
                held = mine if req.matcher is None else mask_along(mine, req.matcher, req.draft_ids)
                tokens = verify_request(req, held)
                out = self._append_verified(req, tokens, mine)  # logprobs of the raw rows
            self.drafter.count(d, len(tokens) - 1)
            req.num_computed += len(tokens) - 1  # the drafts kept: their KV is the target's
            outputs[req.request_id] = out
        if plain:
            picks = self._sample(torch.stack([r for _, r in plain]), [q for q, _ in plain])
            for (req, _), t, lp, top in zip(
                plain, picks.tokens, picks.logprobs, picks.top_logprobs, strict=True
            ):
                outputs[req.request_id] = self._append(req, t, lp, top)
        self.drafter.propose(self._draft_rows(scheduled, starts, verified.hidden), verified.ahead)
        return [outputs[r.request_id] for r in reqs if r.request_id in outputs]

    def _verify(
        self, scheduled: ScheduledStep, num_drafts: list[int], starts: list[int]
    ) -> Verified:
        """A speculative step's forward over every request's new tokens and drafts. The last
        step's greedy drafts reach it on the device (`PendingDrafts`); where every request
        decodes greedily, the draft-extend is launched before the verify's picks are read
        (`MTPDrafter.extend_ahead`)."""
        reqs, token_ids = scheduled.requests, scheduled.token_ids
        pending = self.drafter.take_pending()
        argmax = ahead = None
        if self.drafter.rows_fit(token_ids):  # a token a row: every token's logits
            batch = one_token_rows(
                token_ids, scheduled.start_positions, [r.pages for r in reqs], self.kv.page_size
            )
            input_ids = None if pending is None else pending.input_ids(reqs, token_ids, num_drafts)
            logits, hidden = self._verify_forward(batch, input_ids)
            rows = [end - 1 - d for end, d in zip(starts[1:], num_drafts, strict=True)]
            if self.drafter.overlap and all(_extends_ahead(r) for r in reqs):
                tokens, picked = self._picks(logits)
                copy = HostCopy.launch(picked)  # before the draft-extend, in stream order
                ahead = self.drafter.extend_ahead(batch, hidden, tokens)
                argmax = _split_picks(copy.land())  # the verify's wait, while the GPU extends
            if pending is not None:
                pending.land()
        else:
            if pending is not None:
                pending.land()
                pending.fill(reqs, token_ids, num_drafts)
            batch = ForwardBatch.build(
                token_ids,
                scheduled.start_positions,
                [r.pages for r in reqs],
                self.kv.page_size,
                "cpu",
                all_logits=any(_scores_prompt(r) for r in reqs),
                logits_per_seq=[1 + d for d in num_drafts],
                prompt_lens=[len(r.prompt_ids) for r in reqs],
            )
            logits, hidden = self.model.forward_hidden(batch.to(self.model.device), self.kv)
            rows = _logit_rows(batch, starts, num_drafts)
        if argmax is None:
            argmax = _argmax_picks(logits, reqs, num_drafts, self._picks)  # read back at once
        return Verified(logits, hidden, rows, argmax, ahead)

    def _verify_forward(
        self, batch: ForwardBatch, input_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The model over one-token-a-row `batch` (on the host; `input_ids` on the device in
        place of its tokens): (every row's logits, hidden states), from the verify graph
        where one fits."""
        if self.spec_graphs is not None:
            out = self.spec_graphs.run_verify(batch, input_ids)
            if out is not None:
                return out
        moved = batch.to(self.model.device)
        if input_ids is not None:
            moved = replace(moved, input_ids=input_ids)
        return self.model.forward_hidden(moved, self.kv)

    def _append_picked(
        self, req: Request, tokens: list[int], logprobs: list[float], tops=None
    ) -> RequestOutput:
        """Append `tokens` (their logprobs, and alternatives where `tops`, given), up to where
        `req` ends; one output for them all."""
        outs = []
        for i, (token, lp) in enumerate(zip(tokens, logprobs, strict=False)):
            outs.append(self._append(req, token, lp, tops[i] if tops else ()))
            if req.finished:
                break
        return merge_outputs(outs)

    def _append_verified(
        self, req: Request, tokens: list[int], rows: torch.Tensor
    ) -> RequestOutput:
        """Append `tokens` (`rows [len >= len(tokens), V]`: the logits each was picked from),
        up to where `req` ends; one output for them all."""
        logprobs = torch.log_softmax(rows[: len(tokens)], dim=-1)
        chosen = logprobs.gather(1, torch.tensor(tokens, device=rows.device)[:, None])
        k = req.params.top_logprobs
        tops = [top_logprobs(row, k) for row in logprobs] if k else None
        return self._append_picked(req, tokens, chosen[:, 0].tolist(), tops)

    def _draft_rows(
        self, scheduled: ScheduledStep, starts: list[int], hidden: torch.Tensor
    ) -> list[DraftRow]:
        """Every running request's positions this step computed (their next tokens known
        now), for the MTP layer's draft-extend; decoding ones draft."""
        rows = []
        for req, start, first in zip(
            scheduled.requests, scheduled.start_positions, starts, strict=False
        ):
            if req.finished:
                continue
            n = req.num_computed - start
            drafts = 0
            if req.num_computed == req.num_tokens - 1:  # decoding: it drafts, where pages allow
                drafts = self.drafter.max_drafts(req, self.max_model_len)
                drafts = self.scheduler.draft_room(req, drafts)
            rows.append(
                DraftRow(
                    req,
                    start,
                    req.all_ids[start + 1 : req.num_computed + 1],
                    hidden[first : first + n],
                    drafts,
                    first + n - 1,
                )
            )
        return rows

    def _overlap_bucket(self, requests: list[Request], batch: ForwardBatch) -> int | None:
        """The graph bucket to launch `batch` in, landed late; None: run it the plain way."""
        if not self.overlap_decode or self.graphs is None or not batch.is_decode:
            return None
        if batch.all_logits:
            return None  # a one-token prompt whose logprobs are asked: scored the plain way
        if not all(r.params.plain_greedy for r in requests):
            return None  # sampling draws on the host, from each request's own generator
        return self.graphs.bucket_for(batch)

    def _launch(
        self,
        requests: list[Request],
        batch: ForwardBatch,
        bucket: int,
        input_ids: torch.Tensor | None = None,
    ) -> InFlightStep:
        logits = self.graphs.replay(batch, bucket, input_ids)
        for req in requests:
            req.num_computed += 1
        return InFlightStep.launch(requests, logits, self._pick_buffers, self._picks)

    def _land(self, step: InFlightStep) -> list[RequestOutput]:
        """Launch the step after `step` where nothing else could run, then wait for `step`'s
        tokens and append them."""
        self._in_flight = self._speculate(step)
        return [self._append(req, token, logprob) for req, token, logprob in step.land()]

    def _speculate(self, prev: InFlightStep) -> InFlightStep | None:
        """The next decode step of `prev`'s requests, launched now, or None where the
        scheduler may do something else next (see the module docstring)."""
        reqs, sched = prev.requests, self.scheduler
        if sched.can_admit() or len(sched.running) != len(reqs):
            return None  # an admission, prefills or other requests: the scheduler decides
        if any(req.finished or self._at_length_limit(req, pending=1) for req in reqs):
            return None
        if not all(sched.grow(req, req.num_computed + 1) for req in reqs):
            return None  # a page short: the scheduler preempts
        positions = [req.num_computed for req in reqs]
        pages = [req.pages for req in reqs]
        batch = ForwardBatch.build([[0]] * len(reqs), positions, pages, self.kv.page_size, "cpu")
        bucket = self.graphs.bucket_for(batch)
        if bucket is None:
            return None
        self.overlapped_steps += 1
        return self._launch(reqs, batch, bucket, prev.tokens)

    def _at_length_limit(self, req: Request, pending: int = 0) -> bool:
        """Whether `req` ends by length once `pending` more tokens (in flight) are appended."""
        return (
            len(req.output_ids) + pending >= req.params.max_new_tokens
            or req.num_tokens + pending >= self.max_model_len
        )

    def _advance(
        self, requests: list[Request], num_new: list[int], logits: torch.Tensor
    ) -> list[RequestOutput]:
        ready = []
        for row, (req, n) in enumerate(zip(requests, num_new, strict=True)):
            req.num_computed += n
            self.scheduler.computed(req)  # its full prompt pages, for the prefix cache
            if req.num_computed == req.num_tokens:  # prompt fully cached: next token is due
                ready.append(row)
        if not ready:
            return []
        ready_reqs = [requests[r] for r in ready]
        # NOTE: a decode step's rows are all ready: indexing with a host list would copy it to
        # the GPU, which waits for the step's kernels before the sampler's own copy does
        rows = logits if len(ready) == len(requests) else logits[ready]
        picks = self._sample(rows, ready_reqs)
        return [
            self._append(req, t, lp, top)
            for req, t, lp, top in zip(
                ready_reqs, picks.tokens, picks.logprobs, picks.top_logprobs, strict=True
            )
        ]

    def _sample(self, rows: torch.Tensor, requests: list[Request]):
        """The sampler's picks of `rows [B, V]`, one per request; on ranks that run every
        request, a draw is rank 0's everywhere (greedy picks agree: the logits are the same
        bits)."""
        picks = sample(rows, requests, self._picks)
        parallel = self.model.parallel
        if runs_every_request(parallel) and not all(r.params.plain_greedy for r in requests):
            picks = replace(
                picks, tokens=broadcast_tokens(picks.tokens, parallel, self.model.device)
            )
        return picks

    def _score_prompts(
        self, requests: list[Request], num_new: list[int], logits: torch.Tensor
    ) -> torch.Tensor:
        """Record the prompt logprobs of the requests that asked (`logits [T, V]`: every
        position of the step), and return each request's last row `[B, V]`, as a step without
        `all_logits` gives."""
        starts = [0]
        for n in num_new[:-1]:
            starts.append(starts[-1] + n)
        for req, start, n in zip(requests, starts, num_new, strict=True):
            if _scores_prompt(req):
                self._record_prompt_logprobs(req, logits[start : start + n])
        last = torch.tensor([s + n - 1 for s, n in zip(starts, num_new, strict=True)])
        return logits[last.to(logits.device)]

    def _record_prompt_logprobs(self, req: Request, rows: torch.Tensor) -> None:
        """Logprobs of the prompt tokens that `rows` (this step's positions of `req`) predict;
        the first prompt token, which nothing predicts, gets None."""
        first = req.num_computed  # the position of this step's first row
        if first == 0:
            req.prompt_logprobs.append(None)
            req.prompt_top_logprobs.append(None)
        next_ids = req.prompt_ids[first + 1 : first + 1 + rows.shape[0]]
        if not next_ids:
            return  # the step holds only the prompt's last position: it predicts the output
        chosen, tops = prompt_logprobs(rows[: len(next_ids)], next_ids, req.params.prompt_logprobs)
        req.prompt_logprobs += chosen
        req.prompt_top_logprobs += tops

    def _append(self, req: Request, token: int, logprob: float, top: tuple = ()) -> RequestOutput:
        req.output_ids.append(token)
        req.logprobs.append(logprob)
        if req.params.top_logprobs:
            req.top_logprobs.append(top)
        if req.matcher is not None:
            req.matcher.accept(token)
            if req.matcher.failure is not None:
                return self._fail(req, f"structured output failed: {req.matcher.failure}")
        # NOTE: a stop token's own text is not output (vLLM's rule without
        # include_stop_str_in_output): an eos or stop_token_ids token that is an ordinary word
        delta = "" if self._stop_token(req, token) else self._detokenize(req, token)
        reason = self._finish_reason(req, token)
        if reason is not None:
            delta = self._flush(req, delta) if reason != "stop_string" else delta
            self.scheduler.finish(req, "stop" if reason == "stop_string" else reason)
            self._forget(req)
        first = len(req.output_ids) == 1
        return RequestOutput(
            req.request_id,
            (token,),
            (logprob,),
            delta,
            req.finished,
            req.finish_reason,
            new_top_logprobs=(top,) if req.params.top_logprobs else (),
            prompt_logprobs=tuple(req.prompt_logprobs) if first else (),
            prompt_top_logprobs=tuple(req.prompt_top_logprobs) if first else (),
        )

    def _fail(self, req: Request, reason: str) -> RequestOutput:
        """End `req` alone, with `reason` (its output: no token, finish_reason "error")."""
        self.scheduler.finish(req, "error")
        self._forget(req)
        return RequestOutput(req.request_id, (), (), "", True, "error", error=reason)

    def _detokenize(self, req: Request, token: int) -> str:
        """The text `token` adds that can be given out now. Where the request has stop strings,
        the last `longest stop - 1` characters are held back until more text shows that no stop
        string begins in them (or the request ends), so that no output ever carries the start
        of the stop string that later ends it."""
        detok = self._detok.get(req.request_id)
        if detok is None:
            return ""
        return self._release(req, detok.push(token), final=False)

    def _flush(self, req: Request, delta: str) -> str:
        """`delta`, the detokenizer's rest and the held-back text: the request ends here."""
        detok = self._detok.get(req.request_id)
        if detok is None:
            return delta
        return delta + self._release(req, detok.flush(), final=True)

    def _release(self, req: Request, new_text: str, final: bool) -> str:
        before = len(req.text)
        req.text += new_text
        end, stops = len(req.text), req.params.stop
        if stops:
            cut = find_stop(req.text, stops, before)
            if cut is not None:  # after what was given out: a stop's start was held back
                req.text = req.text[:cut]
                end = cut
                if not final:
                    req.finish_reason = "stop_string"
            elif not final:
                end = max(req.emitted, end - max(0, max(map(len, stops)) - 1))
        delta, req.emitted = req.text[req.emitted : end], max(req.emitted, end)
        return delta

    def _finish_reason(self, req: Request, token: int) -> str | None:
        if req.finish_reason == "stop_string":
            return "stop_string"
        if self._stop_token(req, token):
            return "stop"
        if req.matcher is not None and req.matcher.finished:  # the grammar's end
            return "stop"
        if self._at_length_limit(req):
            return "length"
        return None

    def _stop_token(self, req: Request, token: int) -> bool:
        p = req.params
        return (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids

    def _forget(self, req: Request) -> None:
        self._requests.pop(req.request_id, None)
        self._detok.pop(req.request_id, None)

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[GenerationResult]:
        """Run prompts to completion together (continuous batching) and return them in order."""
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        reqs = []
        for ids, p in zip(prompts, per_prompt, strict=True):
            rid = self.add_request(ids, p)
            reqs.append(self._requests[rid])
        while self.any_rank_busy(any(not r.finished for r in reqs)):
            self.step()
        while self._in_flight is not None:  # a speculated step of finished requests: dropped
            self.step()
        return [_result(r) for r in reqs]

    def any_rank_busy(self, busy: bool) -> bool:
        """`busy` here, or on any rank of a lock-step model (see the module docstring): a
        driver loop of such a model steps while this is true, with or without work of its own."""
        if not self.model.lockstep:
            return busy
        import torch.distributed as dist

        flag = torch.tensor([int(busy)], device=self.model.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def _take_rows(out: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """`out[rows]`, without copying `rows` to the device (which would wait for the replay's
    kernels): a slice where they are consecutive, else each row's slice joined."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return out[rows[0] : rows[0] + len(rows)]
    return torch.cat([out[r : r + 1] for r in rows])


def _argmax_verified(req: Request) -> bool:
    """Whether `req`'s verify is the argmax of the raw logits and its logprob alone."""
    return req.params.plain_greedy


@dataclass
class Verified:
    """A speculative step's verify: every row's logits and final-norm hidden states, each
    request's first logits row (`rows`), the argmax picks and their logprobs where read at
    once, and the draft-extend's outputs where it ran ahead (`MTPDrafter.extend_ahead`)."""

    logits: torch.Tensor
    hidden: torch.Tensor
    rows: list[int]
    argmax: tuple[list[int], list[float]] | None
    ahead: tuple[torch.Tensor, torch.Tensor] | None


def _extends_ahead(req: Request) -> bool:
    """Whether `req`'s step lets the draft-extend run ahead of the verify's read-back: it
    decodes (its last token and drafts only), verified and drafted by the raw argmax."""
    return req.num_tokens - req.num_computed == 1 and req.params.plain_greedy


def _argmax_picks(
    logits: torch.Tensor, reqs: list[Request], num_drafts: list[int], picks
) -> tuple[list[int], list[float]] | None:
    """Every row's argmax and its logprob by `picks` (the plain loop's, so that a tie breaks
    as there), read back at once, where a request with drafts is verified by the argmax (None
    where none is: their rows are read one by one)."""
    if not any(d and _argmax_verified(r) for r, d in zip(reqs, num_drafts, strict=True)):
        return None
    _, pairs = picks(logits)
    return _split_picks(pairs)


def _split_picks(pairs: torch.Tensor) -> tuple[list[int], list[float]]:
    """`[B, 2]` (token id, logprob) rows as (token ids, logprobs), read in one copy."""
    rows = pairs.tolist()  # float64 holds every token id exactly
    return [int(t) for t, _ in rows], [lp for _, lp in rows]


def _logit_rows(batch: ForwardBatch, starts: list[int], num_drafts: list[int]) -> list[int]:
    """Each request's first row of a speculative step's logits (its last `1 + drafts` tokens'):
    every token has a row with `all_logits`, else only those."""
    if batch.all_logits:
        return [end - 1 - d for end, d in zip(starts[1:], num_drafts, strict=True)]
    return [0, *itertools.accumulate(1 + d for d in num_drafts)][:-1]


def _scores_prompt(req: Request) -> bool:
    """Whether `req` asked for its prompt's logprobs and is still prefilling."""
    return (
        req.params.prompt_logprobs is not None
        and req.num_computed < len(req.prompt_ids)
        and not req.output_ids  # a resumed request's were recorded before its preemption
    )


def _result(req: Request) -> GenerationResult:
    return GenerationResult(
        request_id=req.request_id,
        prompt_ids=tuple(req.prompt_ids),
        token_ids=tuple(req.output_ids),
        logprobs=tuple(req.logprobs),
        text=req.text,
        finish_reason=req.finish_reason or "unknown",
    )
