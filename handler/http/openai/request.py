"""What a validated OpenAI request is, and the error that refuses one.

Contract:
- `GenerationRequest` is the one shape both endpoints (completions, chat) parse into; `Limits`
  is what this server accepts (its model name, the most choices per request).
- A refused request raises `ApiError`: an HTTP `status` (400 unless said), the offending field
  `param`, and a stable `code` (`missing_field`, `invalid_type`, `out_of_range`, `unsupported` …).
- Free of pydantic (the activator imports this module through `shapes.py`): the request bodies
  and their validation are `schema.py`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from snapfn.handler.llm.engine.request import SamplingParams
from snapfn.snapshot.errors import BadRequest


class ApiError(BadRequest):
    """A request the API refuses: HTTP `status`, the offending field `param`, a stable `code`."""

    def __init__(
        self, message: str, *, param: str | None = None, code: str | None = None, status: int = 400
    ) -> None:
        super().__init__(message)
        self.param = param
        self.api_code = code
        self.status = status


@dataclass(frozen=True)
class Limits:
    """What this server accepts: its one model name and the most choices one request may ask."""

    model_name: str
    max_choices: int = 64


@dataclass(frozen=True)
class GenerationRequest:
    """A validated request. Completions set `prompts`; chat sets `messages` (one prompt)."""

    endpoint: str  # "completions" | "chat"
    model: str
    params: SamplingParams  # max_new_tokens 0 = not given (chat: fill the context)
    n: int = 1
    prompts: tuple[str | tuple[int, ...], ...] = ()
    messages: tuple[dict[str, Any], ...] = ()
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives per token, with logprobs
    echo: bool = False  # completions: the prompt before the completion
    return_token_ids: bool = False

    @property
    def num_prompts(self) -> int:
        return len(self.prompts) if self.endpoint == "completions" else 1


def unsupported(name: str, why: str) -> ApiError:
    """The error for a field this server understands but does not implement."""
    return ApiError(f"'{name}' is not supported: {why}", param=name, code="unsupported")
