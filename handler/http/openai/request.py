"""What a validated OpenAI request is, and the strict readers every field goes through.

Contract:
- `GenerationRequest` is the one shape both endpoints (completions, chat) parse into; `Limits`
  is what this server accepts (its model name, the most choices per request).
- A refused request raises `ApiError`: an HTTP `status` (400 unless said), the offending field
  `param`, and a stable `code` (`missing_field`, `invalid_type`, `out_of_range`, `unsupported` …).
- The readers are strict: `true` is not an integer, NaN and infinities are not numbers, an
  absent field and a JSON `null` both take the default (or are `missing_field` without one).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from snapfn.handler.llm.engine.request import SamplingParams
from snapfn.snapshot.errors import BadRequest

MISSING = object()  # the default of a required field


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
    return_token_ids: bool = False

    @property
    def num_prompts(self) -> int:
        return len(self.prompts) if self.endpoint == "completions" else 1


# ---- field readers --------------------------------------------------------------------------
def read_field(
    body: Mapping[str, Any], name: str, check: Callable[[Any], bool], what: str, default: Any
) -> Any:
    """`body[name]` if it passes `check`; `default` if absent or null (MISSING: required)."""
    value = body.get(name, None)
    if value is None:
        if default is MISSING:
            raise ApiError(f"'{name}' is required", param=name, code="missing_field")
        return default
    if not check(value):
        raise ApiError(
            f"'{name}' must be {what}, got {type(value).__name__}", param=name, code="invalid_type"
        )
    return value


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return is_int(v) or (isinstance(v, float) and math.isfinite(v))


def read_int(body, name, default=MISSING, lo: int | None = None, hi: int | None = None):
    value = read_field(body, name, is_int, "an integer", default)
    _in_range(name, value, lo, hi)
    return value


def read_number(body, name, default, lo: float, hi: float) -> float:
    value = read_field(body, name, is_number, "a finite number", default)
    _in_range(name, value, lo, hi)
    return float(value)


def read_bool(body, name, default=False) -> bool:
    return read_field(body, name, lambda v: isinstance(v, bool), "true or false", default)


def _in_range(name: str, value, lo, hi) -> None:
    if value is None:
        return
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
        raise ApiError(f"'{name}' must be {bounds}, got {value}", param=name, code="out_of_range")


def unsupported(name: str, why: str) -> ApiError:
    """The error for a field this server understands but does not implement."""
    return ApiError(f"'{name}' is not supported: {why}", param=name, code="unsupported")


def check_fields(body: Any, known: frozenset[str]) -> None:
    """The body is a JSON object with no field outside `known`."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object", code="invalid_body")
    unknown = sorted(set(body) - known)
    if unknown:
        raise ApiError(
            f"unknown field {unknown[0]!r}; accepted fields: {', '.join(sorted(known))}",
            param=unknown[0],
            code="unknown_field",
        )
