"""The OpenAI request bodies as pydantic models: the one source of their validation and schema.

Contract:
- `CompletionRequest` and `ChatCompletionRequest` (sharing `SharedFields`) are what
  `/v1/completions` and `/v1/chat/completions` accept, `TokenizeCompletionRequest` or
  `TokenizeChatRequest` what `/tokenize` does and `DetokenizeRequest` what `/detokenize` does
  (vLLM's shapes); `json_schemas` is their JSON schema,
  which `openapi.py` publishes as is. Types are strict (`true` is not an integer, `"5"` is not
  a number, non-finite numbers are refused); unknown fields are accepted and ignored, as vLLM
  and SGLang do (clients and SDKs send fields of their own), and `validate_body` names them so
  the caller can log a warning; a JSON `null` is the field left out: it takes the default, or is
  missing. `model` may be left out: a server serves one model.
- `validate_body(model, body)` is `(body as model, the unknown fields' places)`, or the
  `ApiError` (400) for its first problem. `param` is the top-level field (inside `messages`,
  the message or its field: `messages[2].content`); `code` is `missing_field`, `invalid_type`,
  `invalid_value` or `out_of_range` by pydantic's error type, or `unsupported` for a field of
  `SERVED_SUBSET`; the message names the exact place (`messages[0].content[1].type`) and what
  pydantic found wrong there (a missing field's message also names the unknown fields sent,
  which are most often its misspelling).
- Values the models accept that this server does not serve (`suffix`, `best_of` other than
  `n`) are refused by `params.py` and `parse.py` after validation; the models' descriptions
  say so in the document.
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
from snapfn.handler.llm.engine.request import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_STOP_TOKEN_IDS = 64
MAX_N = 128
LOGPROBS_NOTE = (
    f"Logprobs are of the model's raw distribution (before penalties, biases and temperature); "
    f"up to {MAX_LOGPROBS} alternatives per token."
)
NO_TOOLS = "tool calling is not implemented: only an empty list is accepted"
# the fields whose schema is narrower than OpenAI's → why a value outside it is refused
SERVED_SUBSET = {
    "tools": NO_TOOLS,
    "functions": NO_TOOLS,
    "tool_choice": "tool calling is not implemented",
    "function_call": "tool calling is not implemented",
}
STRUCTURED_NOTE = (
    "Structured output (docs/structured.md): the output is held to it token by token and the "
    "choice ends (finish_reason stop) where it is complete; send at most one of "
    "response_format (json_object / json_schema), guided_json, guided_regex, guided_grammar, "
    "guided_choice."
)
PROMPT_SHAPES = (
    "Input should be a string, a list of strings, a non-empty list of token ids, "
    "or a list of such lists"
)


class StrictModel(BaseModel):
    """Strict types, unknown fields kept apart (`model_extra`) to be ignored, and `null` the
    same as leaving a field out."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

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


class JsonSchemaFormat(StrictModel):
    """`response_format.json_schema`: the schema the output must validate against."""

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(alias="schema", description="a JSON schema")
    strict: bool | None = Field(None, description="ignored: the output always conforms")


class ResponseFormat(StrictModel):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(None, description="with type json_schema")


class SharedFields(StrictModel):
    """The fields completions and chat share (their meaning: `params.py`)."""

    model: str | None = Field(None, description="the served model (GET /v1/models); optional")
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(
        1.0, ge=0, le=MAX_TEMPERATURE, description="below 1e-5: greedy"
    )
    top_p: float | None = Field(1.0, gt=0, le=1, description="for greedy, send temperature 0")
    n: int | None = Field(1, ge=1, le=MAX_N)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: Stop | None = None
    presence_penalty: float | None = Field(
        0.0, ge=-MAX_PENALTY, le=MAX_PENALTY, description="for each token already generated"
    )
    frequency_penalty: float | None = Field(
        0.0, ge=-MAX_PENALTY, le=MAX_PENALTY, description="times each token's count so far"
    )
    repetition_penalty: float | None = Field(
        1.0,
        gt=0,
        le=MAX_PENALTY,
        description="extension: over prompt and output tokens (a logit > 0 divided by it, "
        "one < 0 multiplied); 1 is off",
    )
    logit_bias: dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]] | None = (
        Field(None, description="token id (a decimal string) → bias added to its logit")
    )
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
    response_format: ResponseFormat | None = Field(None, description=STRUCTURED_NOTE)
    guided_json: dict[str, Any] | str | None = Field(
        None, description="extension (vLLM's): a JSON schema (or its text) the output matches"
    )
    guided_regex: str | None = Field(
        None, min_length=1, description="extension (vLLM's): a regex the whole output matches"
    )
    guided_grammar: str | None = Field(
        None,
        min_length=1,
        description="extension (vLLM's): a Lark (or llama.cpp GBNF) grammar the output matches",
    )
    guided_choice: list[NonEmptyText] | None = Field(
        None, min_length=1, description="extension (vLLM's): the output is one of these strings"
    )


class CompletionRequest(SharedFields):
    """The body of `POST /v1/completions`."""

    prompt: Prompt
    max_tokens: int | None = Field(DEFAULT_COMPLETION_MAX_TOKENS, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description=LOGPROBS_NOTE)
    echo: bool | None = Field(
        False, description="the prompt before the completion (with logprobs: its tokens')"
    )
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="only n is served")
    suffix: str | None = Field("", description="only empty is served")


class ChatCompletionRequest(SharedFields):
    """The body of `POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = Field(False, description=LOGPROBS_NOTE)
    top_logprobs: int | None = Field(
        0, ge=0, le=MAX_LOGPROBS, description=f"{LOGPROBS_NOTE} Needs logprobs: true."
    )
    tools: list[Any] | None = Field(None, max_length=0, description=NO_TOOLS)
    functions: list[Any] | None = Field(None, max_length=0, description=NO_TOOLS)
    tool_choice: Literal["none", "auto"] | None = None
    function_call: Literal["none", "auto"] | None = None
    parallel_tool_calls: bool | None = Field(None, description="ignored")
    store: bool | None = Field(None, description="ignored")
    metadata: dict[str, str] | None = Field(None, description="ignored")


class TokenizeCompletionRequest(StrictModel):
    """A `POST /tokenize` body with a prompt (vLLM's shape)."""

    model: str | None = Field(None, description="the served model; optional")
    prompt: str
    add_special_tokens: bool | None = Field(True, description="bos and the like, as generation")
    return_token_strs: bool | None = Field(False, description="each token's text too")


class TokenizeChatRequest(StrictModel):
    """A `POST /tokenize` body with chat messages, rendered by the chat template (vLLM's)."""

    model: str | None = Field(None, description="the served model; optional")
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool | None = Field(True, description="end with the assistant's turn")
    add_special_tokens: bool | None = Field(False, description="the template writes bos")
    return_token_strs: bool | None = Field(False, description="each token's text too")


class DetokenizeRequest(StrictModel):
    """The body of `POST /detokenize` (vLLM's shape)."""

    model: str | None = Field(None, description="the served model; optional")
    tokens: list[Annotated[int, Field(ge=0)]]


GENERATION_MODELS = (CompletionRequest, ChatCompletionRequest)
TOKENIZER_MODELS = (TokenizeCompletionRequest, TokenizeChatRequest, DetokenizeRequest)
REQUEST_MODELS = GENERATION_MODELS + TOKENIZER_MODELS


def json_schemas(ref_template: str) -> dict[str, Any]:
    """The JSON schema of every request model and of the models they use, by model name; they
    refer to each other through `ref_template` (`"#/components/schemas/{model}"`)."""
    models = [(model, "validation") for model in REQUEST_MODELS]
    return models_json_schema(models, ref_template=ref_template)[1]["$defs"]


# ---- validation errors → OpenAI's 400 -------------------------------------------------------
Body = TypeVar("Body", bound=BaseModel)
CODES = {
    "missing": "missing_field",
    "literal_error": "invalid_value",
    "too_short": "invalid_value",
    "too_long": "invalid_value",
    "string_too_short": "invalid_value",
    "string_too_long": "invalid_value",
    "greater_than": "out_of_range",
    "greater_than_equal": "out_of_range",
    "less_than": "out_of_range",
    "less_than_equal": "out_of_range",
}  # any other error type is "invalid_type"


def validate_body(model: type[Body], body: Any) -> tuple[Body, list[str]]:
    """`body` (decoded JSON) as a `model` and the places of the unknown fields it carried
    (ignored), or the `ApiError` naming the first thing to fix."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object", code="invalid_body")
    try:
        fields = model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        raise _api_error(model, body, first) from None
    return fields, unknown_fields(fields)


def unknown_fields(fields: BaseModel, prefix: str = "") -> list[str]:
    """The places of the fields `fields` (and the models inside it) accepted without knowing."""
    found = [f"{prefix}{name}" for name in (fields.model_extra or {})]
    for name in type(fields).model_fields:
        value = getattr(fields, name)
        if isinstance(value, BaseModel):
            found += unknown_fields(value, f"{prefix}{name}.")
    return found


def _api_error(model: type[BaseModel], body: dict[str, Any], error: dict[str, Any]) -> ApiError:
    """The `ApiError` for one pydantic error on `body`."""
    place = _body_place(error["loc"], body)
    param, where, kind = _param(place), _render(place), error["type"]
    if param in SERVED_SUBSET:
        return unsupported(param, SERVED_SUBSET[param])
    if kind == "missing":
        message = f"'{where}' is required"
        unknown = sorted(set(body) - set(model.model_fields))
        if len(place) == 1 and unknown:
            message += f" (unknown fields, ignored: {', '.join(map(_brief, unknown[:8]))})"
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
