"""Requests and their sampling parameters.

`SamplingParams.validate()` turns out-of-range values into `BadRequest` errors that say what
to fix, before any work is done.
"""

from __future__ import annotations

import enum
import itertools
import math
import os
from dataclasses import dataclass, field

from snapfn.snapshot.errors import BadRequest
from snapfn.snapshot.process import identity

GREEDY_BELOW = 1e-5


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

    def validate(self) -> SamplingParams:
        _check(self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        _check(
            math.isfinite(self.temperature) and 0.0 <= self.temperature <= 100.0,
            f"temperature must be in [0, 100], got {self.temperature}",
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
        _check(len(self.stop) <= 16, f"at most 16 stop strings, got {len(self.stop)}")
        return self

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
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the cache
    state: RequestState = RequestState.WAITING
    finish_reason: str | None = None
    text: str = ""
    generator: object | None = None  # torch.Generator for seeded sampling

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
    """What one engine step produced for one request (streaming unit)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_logprobs: tuple[float, ...]
    text_delta: str
    finished: bool
    finish_reason: str | None


@dataclass(frozen=True)
class GenerationResult:
    """A finished request."""

    request_id: str
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str
    finish_reason: str
