"""OpenAI-compatible request parsing and response shapes (completions and chat completions).

Contract:
- `parse_completion(body, limits)` / `parse_chat(body, limits)` take a decoded JSON body and
  return a `GenerationRequest`, or raise `ApiError` naming the field to fix (`param`) and how.
  Types are strict (`true` is not an integer), ranges follow OpenAI's, unknown fields and
  unsupported features (`echo`, `best_of` > `n`, penalties, `logit_bias`, tools, JSON mode)
  are refused rather than silently ignored.
- `tokenize(request, tokenizer, max_input_len)` turns the prompts into token ids, rendering chat
  messages through the model's chat template, and refuses prompts longer than `max_input_len`.
- `choice_params(request, index, prompt_len, max_input_len)` is the engine's `SamplingParams` for
  one choice; with a `seed`, choice `i` samples with `seed + i`.
- Response builders return the JSON objects of OpenAI's wire format: full bodies and the
  server-sent-event chunks (`*.chunk` objects) of streamed responses.

Logprobs: the engine records only the chosen token's logprob, so completions accept
`logprobs: 0` and chat accepts `logprobs: true` with `top_logprobs` 0 or absent; asking for
alternatives (`logprobs` > 0, `top_logprobs` > 0) is a 400. A temperature below 1e-5 means
greedy decoding. Extensions (vLLM's names):
`top_k`, `ignore_eos`, `stop_token_ids`, `return_token_ids` (adds `token_ids` to every choice
and chunk).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from snapfn.handler.llm.engine.request import RequestOutput, SamplingParams
from snapfn.snapshot.errors import BadRequest

MISSING = object()
MAX_STOP_STRINGS = 16
MIN_TEMPERATURE = 1e-5  # below this, greedy (vLLM's rule)
MAX_STOP_TOKEN_IDS = 64
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
NON_FINITE_LOGPROB = -9999.0  # what OpenAI reports for a logprob that is -inf
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
COMMON_FIELDS = frozenset(
    {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop"}
    | {"presence_penalty", "frequency_penalty", "logit_bias", "user", "seed", "logprobs"}
    | {"top_k", "ignore_eos", "stop_token_ids", "return_token_ids"}
)
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "best_of", "suffix"}
CHAT_FIELDS = (
    COMMON_FIELDS
    | {"messages", "max_completion_tokens", "top_logprobs", "tools"}
    | {
        "tool_choice",
        "parallel_tool_calls",
        "functions",
        "function_call",
        "response_format",
        "store",
        "metadata",
    }
)

TokenText = Callable[[int], str]


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
def _get(body: Mapping[str, Any], name: str, check: Callable[[Any], bool], what: str, default):
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


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return _is_int(v) or (isinstance(v, float) and math.isfinite(v))


def _int(body, name, default=MISSING, lo: int | None = None, hi: int | None = None):
    value = _get(body, name, _is_int, "an integer", default)
    _in_range(name, value, lo, hi)
    return value


def _number(body, name, default, lo: float, hi: float) -> float:
    value = _get(body, name, _is_number, "a finite number", default)
    _in_range(name, value, lo, hi)
    return float(value)


def _bool(body, name, default=False) -> bool:
    return _get(body, name, lambda v: isinstance(v, bool), "true or false", default)


def _in_range(name: str, value, lo, hi) -> None:
    if value is None:
        return
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
        raise ApiError(f"'{name}' must be {bounds}, got {value}", param=name, code="out_of_range")


def _unsupported(name: str, why: str) -> ApiError:
    return ApiError(f"'{name}' is not supported: {why}", param=name, code="unsupported")


# ---- shared parameters ----------------------------------------------------------------------
def _check_fields(body: Any, known: frozenset[str]) -> None:
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object", code="invalid_body")
    unknown = sorted(set(body) - known)
    if unknown:
        raise ApiError(
            f"unknown field {unknown[0]!r}; accepted fields: {', '.join(sorted(known))}",
            param=unknown[0],
            code="unknown_field",
        )


def _check_model(body: Mapping[str, Any], limits: Limits) -> str:
    model = _get(body, "model", lambda v: isinstance(v, str), "a string", MISSING)
    if model != limits.model_name:
        raise ApiError(
            f"model {model!r} does not exist here; this server serves {limits.model_name!r} "
            "(see GET /v1/models)",
            param="model",
            code="model_not_found",
            status=404,
        )
    return model


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(
            "'stop' must be a non-empty string or a list of non-empty strings",
            param="stop",
            code="invalid_type",
        )
    if len(stops) > MAX_STOP_STRINGS:
        raise ApiError(
            f"'stop' has {len(stops)} strings; at most {MAX_STOP_STRINGS} are accepted",
            param="stop",
            code="out_of_range",
        )
    return tuple(stops)


def _stop_token_ids(body: Mapping[str, Any]) -> tuple[int, ...]:
    ids = _get(body, "stop_token_ids", lambda v: isinstance(v, list), "a list", [])
    if not all(_is_int(t) and t >= 0 for t in ids) or len(ids) > MAX_STOP_TOKEN_IDS:
        raise ApiError(
            f"'stop_token_ids' must be at most {MAX_STOP_TOKEN_IDS} token ids >= 0",
            param="stop_token_ids",
            code="invalid_value",
        )
    return tuple(ids)


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name, 0.0, -2.0, 2.0) != 0.0:
            raise _unsupported(name, "penalties are not implemented; leave it 0")
    bias = body.get("logit_bias")
    if bias is not None and (not isinstance(bias, dict) or bias):
        raise _unsupported("logit_bias", "leave it out or send {}")
    _get(body, "user", lambda v: isinstance(v, str), "a string", None)


def _stream_flags(body: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = _bool(body, "stream")
    options = _get(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    unknown = sorted(set(options) - {"include_usage"})
    if unknown:
        raise ApiError(
            f"unknown stream_options field {unknown[0]!r}; accepted: include_usage",
            param="stream_options",
            code="unknown_field",
        )
    return stream, _bool(options, "include_usage") and stream


def _sampling(body: Mapping[str, Any], max_tokens: int) -> SamplingParams:
    top_k = _int(body, "top_k", 0, -1)
    seed = _int(body, "seed", None, 0, 2**63 - 1)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    params = SamplingParams(
        max_new_tokens=max_tokens,
        # NOTE: logits / 1e-300 overflow to inf and the sampler's NaNs would fail the whole
        # engine step (every request in it); a temperature this small is greedy anyway.
        temperature=temperature if temperature >= MIN_TEMPERATURE else 0.0,
        top_k=max(top_k, 0),  # -1 (vLLM's "off") = 0
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        seed=seed,
        stop=_stop(body),
        stop_token_ids=_stop_token_ids(body),
        ignore_eos=_bool(body, "ignore_eos"),
    )
    if params.top_p == 0.0:
        raise ApiError(
            "'top_p' must be > 0 (use temperature 0 for greedy decoding)",
            param="top_p",
            code="out_of_range",
        )
    return params


def _common(body: Mapping[str, Any], limits: Limits, max_tokens: int) -> dict[str, Any]:
    stream, include_usage = _stream_flags(body)
    _refuse_unsupported(body)
    return dict(
        model=_check_model(body, limits),
        params=_sampling(body, max_tokens),
        n=_int(body, "n", 1, 1, 128),
        stream=stream,
        include_usage=include_usage,
        return_token_ids=_bool(body, "return_token_ids"),
    )


def _check_choices(request: GenerationRequest, limits: Limits) -> GenerationRequest:
    total = request.n * request.num_prompts
    if total > limits.max_choices:
        raise ApiError(
            f"this request asks for {total} choices (n × prompts); at most "
            f"{limits.max_choices} are served per request",
            param="n",
            code="out_of_range",
        )
    seed = request.params.seed
    if seed is not None and seed + total > 2**63:
        raise ApiError("'seed' + n must stay below 2**63", param="seed", code="out_of_range")
    return request


# ---- completions ----------------------------------------------------------------------------
def parse_completion(body: Any, limits: Limits) -> GenerationRequest:
    _check_fields(body, COMPLETION_FIELDS)
    common = _common(body, limits, _int(body, "max_tokens", DEFAULT_COMPLETION_MAX_TOKENS, 1))
    logprobs = _int(body, "logprobs", None, 0, 5)
    if logprobs:
        raise _unsupported(
            "logprobs", "only the chosen token's logprob exists; send 'logprobs': 0 for it"
        )
    if _bool(body, "echo"):
        raise _unsupported("echo", "the prompt is not echoed back")
    if _get(body, "suffix", lambda v: isinstance(v, str), "a string", "") != "":
        raise _unsupported("suffix", "insertion is not implemented")
    best_of = _int(body, "best_of", None, 1, 128)
    if best_of is not None and best_of != common["n"]:
        raise _unsupported("best_of", "it must equal n (or be left out)")
    request = GenerationRequest(
        endpoint="completions",
        prompts=_prompts(body.get("prompt", MISSING)),
        logprobs=logprobs is not None,
        **common,
    )
    return _check_choices(request, limits)


def _prompts(prompt: Any) -> tuple[str | tuple[int, ...], ...]:
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""
    if prompt is MISSING or prompt is None:
        raise ApiError("'prompt' is required", param="prompt", code="missing_field")
    if isinstance(prompt, str):
        return (prompt,)
    if isinstance(prompt, list) and prompt:
        if all(_is_int(t) for t in prompt):
            return (_token_ids(prompt),)
        if all(isinstance(p, str) for p in prompt):
            return tuple(prompt)
        if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
            return tuple(_token_ids(p) for p in prompt)
    raise ApiError(
        "'prompt' must be a string, a list of strings, a non-empty list of token ids, "
        "or a list of such lists",
        param="prompt",
        code="invalid_type",
    )


def _token_ids(ids: list[int]) -> tuple[int, ...]:
    if any(t < 0 for t in ids):
        raise ApiError("token ids must be >= 0", param="prompt", code="out_of_range")
    return tuple(ids)


# ---- chat -----------------------------------------------------------------------------------
def parse_chat(body: Any, limits: Limits) -> GenerationRequest:
    _check_fields(body, CHAT_FIELDS)
    max_tokens = _int(body, "max_completion_tokens", None, 1)
    max_tokens = _int(body, "max_tokens", max_tokens, 1)
    common = _common(body, limits, max_tokens or 0)
    logprobs = _bool(body, "logprobs")
    if _int(body, "top_logprobs", 0, 0, 20) > 0:
        raise _unsupported(
            "top_logprobs", "only the chosen token's logprob exists; send 0 or leave it out"
        )
    _refuse_chat_features(body)
    messages = tuple(_message(m, i) for i, m in enumerate(_messages_list(body)))
    request = GenerationRequest(endpoint="chat", messages=messages, logprobs=logprobs, **common)
    return _check_choices(request, limits)


def _refuse_chat_features(body: Mapping[str, Any]) -> None:
    for name in ("tools", "functions"):
        if body.get(name):
            raise _unsupported(name, "tool calling is not implemented")
    for name in ("tool_choice", "function_call"):
        if body.get(name) not in (None, "none", "auto"):
            raise _unsupported(name, "tool calling is not implemented")
    _bool(body, "parallel_tool_calls")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise _unsupported("response_format", 'only {"type": "text"} is served')


def _messages_list(body: Mapping[str, Any]) -> list[Any]:
    messages = _get(body, "messages", lambda v: isinstance(v, list), "a list", MISSING)
    if not messages:
        raise ApiError("'messages' must not be empty", param="messages", code="invalid_value")
    return messages


def _message(message: Any, i: int) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise ApiError(f"{where} must be an object", param=where, code="invalid_type")
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise ApiError(
            f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {role!r}",
            param=f"{where}.role",
            code="invalid_value",
        )
    out = {"role": role, "content": _content(message.get("content"), role, where)}
    name = message.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise ApiError(
                f"{where}.name must be a string", param=f"{where}.name", code="invalid_type"
            )
        out["name"] = name
    return out


def _content(content: Any, role: str, where: str) -> str:
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise ApiError(
        f"{where}.content must be a string or a list of "
        '{"type": "text", "text": ...} parts (only text is served)',
        param=f"{where}.content",
        code="invalid_type",
    )


# ---- prompts → token ids → engine parameters ------------------------------------------------
def tokenize(request: GenerationRequest, tokenizer: Any, max_input_len: int) -> list[list[int]]:
    """Token ids of each prompt, each at most `max_input_len` long (else 400)."""
    param = "messages" if request.endpoint == "chat" else "prompt"
    texts_needed = request.endpoint == "chat" or any(isinstance(p, str) for p in request.prompts)
    if texts_needed and tokenizer is None:
        raise ApiError(
            "this model has no tokenizer: send 'prompt' as token ids",
            param=param,
            code="no_tokenizer",
        )
    if request.endpoint == "chat":
        text = tokenizer.apply_chat_template(list(request.messages), add_generation_prompt=True)
        prompts = [tokenizer.encode(text, add_special_tokens=False)]
    else:
        prompts = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in request.prompts]
    for ids in prompts:
        if not ids:
            raise ApiError("the prompt is empty", param=param, code="invalid_value")
        if len(ids) > max_input_len:
            raise ApiError(
                f"the prompt has {len(ids)} tokens; this model accepts at most {max_input_len}: "
                "shorten it",
                param=param,
                code="context_length_exceeded",
            )
    return prompts


def choice_params(
    request: GenerationRequest, index: int, prompt_len: int, max_input_len: int
) -> SamplingParams:
    """Parameters of choice `index`: its own seed, and chat's default length filled in."""
    params = request.params
    if params.max_new_tokens == 0:  # chat without max_tokens: up to the end of the context
        params = replace(params, max_new_tokens=max(1, max_input_len + 1 - prompt_len))
    if params.seed is not None:
        params = replace(params, seed=params.seed + index)
    return params.validate()


# ---- responses ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ResponseMeta:
    id: str
    created: int
    model: str


@dataclass
class Choice:
    """What one choice has produced so far."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, out: RequestOutput) -> None:
        self.token_ids += out.new_token_ids
        self.logprobs += out.new_logprobs
        self.text.append(out.text_delta)
        if out.finished:
            self.finish_reason = out.finish_reason


def usage(prompt_lens: Sequence[int], choices: Sequence[Choice]) -> dict[str, int]:
    prompt = sum(prompt_lens)
    completion = sum(len(c.token_ids) for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _finite(logprobs: Sequence[float]) -> list[float]:
    return [lp if math.isfinite(lp) else NON_FINITE_LOGPROB for lp in logprobs]


def completion_logprobs(ids: Sequence[int], logprobs: Sequence[float], token_text: TokenText):
    tokens = [token_text(t) for t in ids]
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": _finite(logprobs),
        "top_logprobs": None,
        "text_offset": offsets,
    }


def chat_logprobs(ids: Sequence[int], logprobs: Sequence[float], token_text: TokenText):
    content = []
    for token_id, lp in zip(ids, _finite(logprobs), strict=True):
        token = token_text(token_id)
        content.append(
            {"token": token, "logprob": lp, "bytes": list(token.encode()), "top_logprobs": []}
        )
    return {"content": content, "refusal": None}


def _choice_body(request: GenerationRequest, choice: Choice, token_text: TokenText) -> dict:
    ids, lps, text = choice.token_ids, choice.logprobs, "".join(choice.text)
    if request.endpoint == "chat":
        body = {
            "index": choice.index,
            "message": {"role": "assistant", "content": text, "refusal": None},
            "logprobs": chat_logprobs(ids, lps, token_text) if request.logprobs else None,
            "finish_reason": choice.finish_reason,
        }
    else:
        body = {
            "index": choice.index,
            "text": text,
            "logprobs": completion_logprobs(ids, lps, token_text) if request.logprobs else None,
            "finish_reason": choice.finish_reason,
        }
    if request.return_token_ids:
        body["token_ids"] = list(ids)
    return body


def response_body(
    request: GenerationRequest,
    meta: ResponseMeta,
    choices: Sequence[Choice],
    usage_counts: dict[str, int],
    token_text: TokenText,
) -> dict[str, Any]:
    """The full (non-streamed) response object."""
    return {
        "id": meta.id,
        "object": "chat.completion" if request.endpoint == "chat" else "text_completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [_choice_body(request, c, token_text) for c in choices],
        "usage": usage_counts,
    }


def chunk_body(
    request: GenerationRequest,
    meta: ResponseMeta,
    index: int,
    out: RequestOutput | None,
    token_text: TokenText,
) -> dict[str, Any]:
    """One streamed chunk for choice `index`; `out=None` is chat's opening `role` chunk."""
    if request.endpoint == "chat":
        choice = _chat_delta(request, index, out, token_text)
    else:
        lp = completion_logprobs(out.new_token_ids, out.new_logprobs, token_text)
        choice = {
            "index": index,
            "text": out.text_delta,
            "logprobs": lp if request.logprobs else None,
            "finish_reason": out.finish_reason if out.finished else None,
        }
    if request.return_token_ids:
        choice["token_ids"] = [] if out is None else list(out.new_token_ids)
    return _chunk(request, meta, [choice])


def _chat_delta(request, index, out, token_text) -> dict[str, Any]:
    if out is None:
        return {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
    lp = chat_logprobs(out.new_token_ids, out.new_logprobs, token_text)
    return {
        "index": index,
        "delta": {"content": out.text_delta},
        "logprobs": lp if request.logprobs else None,
        "finish_reason": out.finish_reason if out.finished else None,
    }


def _chunk(request: GenerationRequest, meta: ResponseMeta, choices: list[dict]) -> dict:
    chunk = {
        "id": meta.id,
        "object": "chat.completion.chunk" if request.endpoint == "chat" else "text_completion",
        "created": meta.created,
        "model": meta.model,
        "choices": choices,
    }
    if request.include_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(
    request: GenerationRequest, meta: ResponseMeta, usage_counts: dict[str, int]
) -> dict[str, Any]:
    """The last chunk of a stream with `stream_options.include_usage`: no choices, the usage."""
    return {**_chunk(request, meta, []), "usage": usage_counts}


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
