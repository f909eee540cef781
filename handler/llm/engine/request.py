"""Requests and their sampling parameters.

`SamplingParams.validate()` turns out-of-range values into `BadRequest` errors that say what
to fix, before any work is done. Its ranges are the API's (`MAX_TEMPERATURE`, `MAX_LOGPROBS`,
the penalties'): the HTTP schema, the queue's jobs and `snapfn generate` refuse what it refuses.

Penalties follow vLLM's (and OpenAI's) meaning: `presence_penalty` and `frequency_penalty`
count the tokens generated so far, `repetition_penalty` every token of the prompt and the
output (a logit > 0 is divided by it, one < 0 multiplied), `logit_bias` is added to the logits
first. `top_logprobs` asks for that many alternatives of each generated token, and
`prompt_logprobs` (None: not asked) for each prompt token's logprob and alternatives; logprobs
are of the model's raw distribution whatever the penalties (vLLM's default).
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import math
import os
from dataclasses import dataclass, field

from snapfn.handler.llm.structured.spec import GrammarSpec
from snapfn.snapshot.errors import BadRequest
from snapfn.snapshot.process import identity

GREEDY_BELOW = 1e-5
MAX_TEMPERATURE = 2.0  # OpenAI's range, [0, 2]
MAX_LOGPROBS = 20  # alternatives per token at most (vLLM's default max_logprobs)
MAX_STOP_STRINGS = 16
MAX_PENALTY = 2.0  # presence / frequency penalties in [-2, 2]; repetition in (0, 2]
MAX_LOGIT_BIAS = 100.0  # a bias in [-100, 100]
TopLogprobs = tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding options. temperature 0 means greedy."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    top_logprobs: int = 0  # alternatives reported per generated token
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's, k alternatives
    guide: GrammarSpec | None = None  # the output must match it (structured/, docs/structured.md)

    def to_json(self) -> dict:
        """These params as JSON (a restored worker's channel, the lock-step messages)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, doc: dict) -> SamplingParams:
        """`to_json`'s output back; a missing sequence field takes its default."""
        raw = dict(doc)
        for key in ("stop", "stop_token_ids"):
            raw[key] = tuple(raw.get(key, ()))
        raw["logit_bias"] = tuple((int(t), float(b)) for t, b in raw.get("logit_bias", ()))
        guide = raw.get("guide")
        raw["guide"] = GrammarSpec.from_json(guide) if guide is not None else None
        return cls(**raw)

    def validate(self) -> SamplingParams:
        _check(self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        _check(
            math.isfinite(self.temperature) and 0.0 <= self.temperature <= MAX_TEMPERATURE,
            f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}",
        )
        _check(self.top_k >= 0, f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(
            self.seed is None or 0 <= self.seed < 2**63,
            f"seed must be in [0, 2**63), got {self.seed}",
        )
        _check(
            all(isinstance(s, str) and s for s in self.stop),
            "stop strings must be non-empty strings",
        )
        _check(
            len(self.stop) <= MAX_STOP_STRINGS,
            f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}",
        )
        self._validate_penalties()
        for name in ("top_logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            _check(
                k is None or 0 <= k <= MAX_LOGPROBS,
                f"{name} must be in [0, {MAX_LOGPROBS}], got {k}",
            )
        return self

    def _validate_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(
                math.isfinite(value) and -MAX_PENALTY <= value <= MAX_PENALTY,
                f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}",
            )
        _check(
            math.isfinite(self.repetition_penalty) and 0.0 < self.repetition_penalty <= MAX_PENALTY,
            f"repetition_penalty must be in (0, {MAX_PENALTY:g}], got {self.repetition_penalty}",
        )
        for token_id, bias in self.logit_bias:
            _check(
                math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS,
                f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                f"got {bias} for token {token_id}",
            )

    @property
    def shapes_logits(self) -> bool:
        """Whether the logits are changed before a token is picked (penalties, biases)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )

    @property
    def plain_greedy(self) -> bool:
        """Greedy on the raw logits, the chosen token's logprob only: the device's fast path
        (`Backend.greedy_picks`, overlapped decode)."""
        return (
            self.greedy and not self.shapes_logits and self.top_logprobs == 0 and self.guide is None
        )

    @property
    def greedy(self) -> bool:
        # below 1e-5, logits / temperature overflow to inf: sample greedily (vLLM's rule)
        return self.temperature < GREEDY_BELOW


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise BadRequest(message)


class RequestState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()
_id_prefix = ["req"]


@identity.on_refresh
def fresh_request_ids() -> None:
    """After a process restore: ids that no other replica of the same image hands out."""
    _id_prefix[0] = f"req-{os.urandom(4).hex()}"


@dataclass(eq=False)
class Request:
    """One generation: prompt, progress through the KV cache, outputs so far."""

    prompt_ids: list[int]
    params: SamplingParams
    request_id: str = field(default_factory=lambda: f"{_id_prefix[0]}-{next(_ids)}")
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)  # with params.top_logprobs
    prompt_logprobs: list[float | None] = field(default_factory=list)  # params.prompt_logprobs
    prompt_top_logprobs: list[TopLogprobs | None] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the cache
    cached_tokens: int = 0  # of them, found in the prefix cache at admission
    page_names: list[bytes] | None = None  # its full prompt pages' names (prefix_cache.py)
    num_registered: int = 0  # of its prompt pages, those the prefix cache holds
    state: RequestState = RequestState.WAITING
    preemptions: int = 0  # times its pages were taken back for others' (scheduler.py)
    finish_reason: str | None = None
    text: str = ""
    # of `text`, the characters its outputs gave out: the rest may still begin a stop string
    emitted: int = 0
    generator: object | None = None  # torch.Generator for seeded sampling
    matcher: object | None = None  # with params.guide: its structured.GrammarMatcher
    # speculative decoding (engine/speculative.py): the drafts its next step verifies, and the
    # distributions `[d, V]` sampled ones were drawn from (None for greedy requests)
    draft_ids: list[int] = field(default_factory=list)
    draft_probs: object | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.state is RequestState.FINISHED


@dataclass(frozen=True)
class RequestOutput:
    """What one engine step produced for one request (streaming unit). The alternatives are
    there when asked for: `new_top_logprobs` one per new token; the prompt's logprobs (the first
    token's None) in the request's first output."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_logprobs: tuple[float, ...]
    text_delta: str
    finished: bool
    finish_reason: str | None
    new_top_logprobs: tuple[TopLogprobs, ...] = ()
    prompt_logprobs: tuple[float | None, ...] = ()
    prompt_top_logprobs: tuple[TopLogprobs | None, ...] = ()
    # why the request failed (finish_reason "error"), where it failed alone (its grammar)
    error: str | None = None


@dataclass(frozen=True)
class GenerationResult:
    """A finished request."""

    request_id: str
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str
    finish_reason: str
