"""The OpenAI request bodies as pydantic models: the one source of their validation and schema.

Contract:
- `CompletionRequest` and `ChatCompletionRequest` (sharing `SharedFields`) are what
  `/v1/completions` and `/v1/chat/completions` accept; `json_schemas` is their JSON schema,
  which `openapi.py` publishes as is. Types are strict (`true` is not an integer, `"5"` is not
  a number, non-finite numbers are refused); unknown fields are refused (inside a chat message
  or a content part they are ignored); a JSON `null` is the field left out: it takes the
  default, or is missing.
- `validate_body(model, body)` is `body` as `model`, or the `ApiError` (400) for its first
  problem, unknown fields first. `param` is the top-level field (inside `messages`, the message
  or its field: `messages[2].content`); `code` is `missing_field`, `unknown_field`,
  `invalid_type`, `invalid_value` or `out_of_range` by pydantic's error type, or `unsupported`
  for a field of `SERVED_SUBSET`; the message names the exact place
  (`messages[0].content[1].type`) and what pydantic found wrong there.
- Values the models accept that this server does not serve (penalties other than 0, logprob
  alternatives, `echo` …) are refused by `params.py` and `parse.py` after validation; the
  models' descriptions say so in the document.
"""

from __future__ import annotations

import reprlib
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    model_validator,
)
from pydantic.json_schema import models_json_schema

from snapfn.handler.http.openai.request import ApiError, unsupported

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 64
MAX_N = 128
LOGPROBS_NOTE = (
    "Only the chosen token's logprob is recorded by the engine: alternatives "
    "(top logprobs) are not available, and asking for them is a 400."
)
NO_TOOLS = "tool calling is not implemented: only an empty list is accepted"
# the fields whose schema is narrower than OpenAI's → why a value outside it is refused
SERVED_SUBSET = {
    "tools": NO_TOOLS,
    "functions": NO_TOOLS,
    "tool_choice": "tool calling is not implemented",
    "function_call": "tool calling is not implemented",
    "response_format": 'only {"type": "text"} is served',
}
PROMPT_SHAPES = (
    "Input should be a string, a list of strings, a non-empty list of token ids, "
    "or a list of such lists"
)


class StrictModel(BaseModel):
    """Strict types, no unknown fields, and `null` the same as leaving a field out."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


def _json_kind(value: Any) -> str | None:
    """The union member (by JSON type) that validates `value`, so only its errors are told."""
    return "string" if isinstance(value, str) else "array" if isinstance(value, list) else None


def _prompt_kind(prompt: Any) -> str | None:
    """Which of the four prompt shapes `prompt` is, by its first item."""
    if isinstance(prompt, str):
        return "text"
    if not isinstance(prompt, list) or not prompt:
        return None
    first = prompt[0]
    if isinstance(first, str):
        return "texts"
    if isinstance(first, list):
        return "token_id_lists"
    return "token_ids" if isinstance(first, int) else None


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
NonEmptyText = Annotated[str, Field(min_length=1)]

Prompt = Annotated[
    Annotated[str, Tag("text")]
    | Annotated[list[str], Field(min_length=1), Tag("texts")]
    | Annotated[TokenIds, Tag("token_ids")]
    | Annotated[list[TokenIds], Field(min_length=1), Tag("token_id_lists")],
    Discriminator(
        _prompt_kind, custom_error_type="invalid_type", custom_error_message=PROMPT_SHAPES
    ),
]

Stop = Annotated[
    Annotated[NonEmptyText, Tag("string")]
    | Annotated[list[NonEmptyText], Field(max_length=MAX_STOP_STRINGS), Tag("array")],
    Discriminator(
        _json_kind,
        custom_error_type="invalid_type",
        custom_error_message="Input should be a non-empty string or a list of non-empty strings",
    ),
]


class TextPart(StrictModel):
    """One part of a message's content; only text parts are served."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


Content = Annotated[
    Annotated[str, Tag("string")] | Annotated[list[TextPart], Tag("array")],
    Discriminator(
        _json_kind,
        custom_error_type="invalid_type",
        custom_error_message='Input should be a string or a list of {"type": "text", "text": ...} '
        "parts (only text is served)",
    ),
]


class ChatMessage(StrictModel):
    """One chat message; its content may be left out only by the assistant."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content | None = None
    name: str | None = None


class StreamOptions(StrictModel):
    include_usage: bool | None = Field(False, description="with stream: a last chunk, the usage")


class ResponseFormat(StrictModel):
    type: Literal["text"]


class SharedFields(StrictModel):
    """The fields completions and chat share (their meaning: `params.py`)."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(1.0, ge=0, le=2, description="below 1e-5: greedy")
    top_p: float | None = Field(1.0, gt=0, le=1, description="for greedy, send temperature 0")
    n: int | None = Field(1, ge=1, le=MAX_N)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: Stop | None = None
    presence_penalty: float | None = Field(0.0, ge=-2, le=2, description="only 0 is served")
    frequency_penalty: float | None = Field(0.0, ge=-2, le=2, description="only 0 is served")
    logit_bias: dict[str, Any] | None = Field(None, description="only {} is served")
    user: str | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="choice i samples with seed + i")
    top_k: int | None = Field(0, ge=-1, description="extension; 0/-1 off")
    ignore_eos: bool | None = Field(False, description="extension")
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, max_length=MAX_STOP_TOKEN_IDS, description="extension: token ids that end a choice"
    )
    return_token_ids: bool | None = Field(
        False, description="extension: `token_ids` in every choice and chunk"
    )


class CompletionRequest(SharedFields):
    """The body of `POST /v1/completions`."""

    prompt: Prompt
    max_tokens: int | None = Field(DEFAULT_COMPLETION_MAX_TOKENS, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5, description=LOGPROBS_NOTE)
    echo: bool | None = Field(False, description="only false is served")
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="only n is served")
    suffix: str | None = Field("", description="only empty is served")


class ChatCompletionRequest(SharedFields):
    """The body of `POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = Field(False, description=LOGPROBS_NOTE)
    top_logprobs: int | None = Field(0, ge=0, le=20, description=LOGPROBS_NOTE)
    tools: list[Any] | None = Field(None, max_length=0, description=NO_TOOLS)
    functions: list[Any] | None = Field(None, max_length=0, description=NO_TOOLS)
    tool_choice: Literal["none", "auto"] | None = None
    function_call: Literal["none", "auto"] | None = None
    parallel_tool_calls: bool | None = Field(None, description="ignored")
    response_format: ResponseFormat | None = None
    store: bool | None = Field(None, description="ignored")
    metadata: dict[str, str] | None = Field(None, description="ignored")


REQUEST_MODELS = (CompletionRequest, ChatCompletionRequest)


def json_schemas(ref_template: str) -> dict[str, Any]:
    """The JSON schema of every request model and of the models they use, by model name; they
    refer to each other through `ref_template` (`"#/components/schemas/{model}"`)."""
    models = [(model, "validation") for model in REQUEST_MODELS]
    return models_json_schema(models, ref_template=ref_template)[1]["$defs"]


# ---- validation errors → OpenAI's 400 -------------------------------------------------------
Body = TypeVar("Body", bound=BaseModel)
CODES = {
    "missing": "missing_field",
    "extra_forbidden": "unknown_field",
    "literal_error": "invalid_value",
    "too_short": "invalid_value",
    "too_long": "invalid_value",
    "string_too_short": "invalid_value",
    "greater_than": "out_of_range",
    "greater_than_equal": "out_of_range",
    "less_than": "out_of_range",
    "less_than_equal": "out_of_range",
}  # any other error type is "invalid_type"


def validate_body(model: type[Body], body: Any) -> Body:
    """`body` (decoded JSON) as a `model`, or the `ApiError` naming the first thing to fix."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object", code="invalid_body")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        # unknown fields first: a misspelt name explains the missing field too
        first = min(errors, key=lambda error: error["type"] != "extra_forbidden")
        raise _api_error(model, body, first) from None


def _api_error(model: type[BaseModel], body: dict[str, Any], error: dict[str, Any]) -> ApiError:
    """The `ApiError` for one pydantic error on `body`."""
    place = _body_place(error["loc"], body)
    param, where, kind = _param(place), _render(place), error["type"]
    if param in SERVED_SUBSET:
        return unsupported(param, SERVED_SUBSET[param])
    if kind == "missing":
        message = f"'{where}' is required"
    elif kind == "extra_forbidden" and len(place) == 1:
        message = (
            f"unknown field {where!r}; accepted fields: {', '.join(sorted(model.model_fields))}"
        )
    elif kind == "extra_forbidden":
        message = f"unknown field {place[-1]!r} in '{param}'"
    elif isinstance(error["input"], list | dict):  # the message says what is wrong with it
        message = f"'{where}': {error['msg']}"
    else:
        message = f"'{where}': {error['msg']}, got {_brief(error['input'])}"
    return ApiError(message, param=param, code=CODES.get(kind, "invalid_type"))


def _body_place(loc: tuple[str | int, ...], body: Any) -> list[str | int]:
    """Where in `body` an error's `loc` points: the loc less the tags of union members."""
    place, value = [], body
    for i, key in enumerate(loc):
        if isinstance(key, int) and isinstance(value, list):
            place.append(key)
            value = value[key]
        elif isinstance(value, dict) and (key in value or i == len(loc) - 1):
            place.append(key)
            value = value.get(key)
        # else: the tag of the union member that was tried, no place in the body
    return place


def _param(place: list[str | int]) -> str | None:
    """OpenAI's `param`: the top-level field; inside `messages`, the message or its field."""
    return _render(place[: 3 if place[:1] == ["messages"] else 1]) or None


def _render(place: list[str | int]) -> str:
    path = ""
    for key in place:
        path += f"[{key}]" if isinstance(key, int) else f".{key}" if path else key
    return path


def _brief(value: Any) -> str:
    """`repr(value)`, cut short (a request may send a long string or a huge integer)."""
    short = reprlib.Repr()
    short.maxstring = short.maxother = short.maxlong = 40
    return short.repr(value)
