"""OpenAI-compatible request parsing: a JSON body → a `GenerationRequest` → engine inputs.

Contract:
- `parse_completion(body, limits)` / `parse_chat(body, limits)` take a decoded JSON body and
  return a `GenerationRequest`, or raise `ApiError` naming the field to fix (`param`) and how.
  Types are strict (`true` is not an integer), ranges follow OpenAI's, unknown fields and
  unsupported features (`echo`, `best_of` > `n`, penalties, `logit_bias`, tools, JSON mode)
  are refused rather than silently ignored. The fields both endpoints share are read by
  `params`; the response shapes are `shapes`'.
- `tokenize(request, tokenizer, max_input_len)` turns the prompts into token ids, rendering chat
  messages through the model's chat template, and refuses prompts longer than `max_input_len`.
- `choice_params(request, index, prompt_len, max_input_len)` is the engine's `SamplingParams` for
  one choice; with a `seed`, choice `i` samples with `seed + i`.

Logprobs: the engine records only the chosen token's logprob, so completions accept
`logprobs: 0` and chat accepts `logprobs: true` with `top_logprobs` 0 or absent; asking for
alternatives (`logprobs` > 0, `top_logprobs` > 0) is a 400. A temperature below 1e-5 means
greedy decoding. Extensions (vLLM's names):
`top_k`, `ignore_eos`, `stop_token_ids`, `return_token_ids` (adds `token_ids` to every choice
and chunk).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from snapfn.handler.http.openai.params import COMMON_FIELDS, check_choices, common_fields
from snapfn.handler.http.openai.request import (
    MISSING,
    ApiError,
    GenerationRequest,
    Limits,
    check_fields,
    is_int,
    read_bool,
    read_field,
    read_int,
    unsupported,
)
from snapfn.handler.llm.engine.request import SamplingParams

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
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


# ---- completions ----------------------------------------------------------------------------
def parse_completion(body: Any, limits: Limits) -> GenerationRequest:
    check_fields(body, COMPLETION_FIELDS)
    max_tokens = read_int(body, "max_tokens", DEFAULT_COMPLETION_MAX_TOKENS, 1)
    common = common_fields(body, limits, max_tokens)
    logprobs = read_int(body, "logprobs", None, 0, 5)
    if logprobs:
        raise unsupported(
            "logprobs", "only the chosen token's logprob exists; send 'logprobs': 0 for it"
        )
    if read_bool(body, "echo"):
        raise unsupported("echo", "the prompt is not echoed back")
    if read_field(body, "suffix", lambda v: isinstance(v, str), "a string", "") != "":
        raise unsupported("suffix", "insertion is not implemented")
    best_of = read_int(body, "best_of", None, 1, 128)
    if best_of is not None and best_of != common["n"]:
        raise unsupported("best_of", "it must equal n (or be left out)")
    request = GenerationRequest(
        endpoint="completions",
        prompts=_prompts(body.get("prompt", MISSING)),
        logprobs=logprobs is not None,
        **common,
    )
    return check_choices(request, limits)


def _prompts(prompt: Any) -> tuple[str | tuple[int, ...], ...]:
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""
    if prompt is MISSING or prompt is None:
        raise ApiError("'prompt' is required", param="prompt", code="missing_field")
    if isinstance(prompt, str):
        return (prompt,)
    if isinstance(prompt, list) and prompt:
        if all(is_int(t) for t in prompt):
            return (_token_ids(prompt),)
        if all(isinstance(p, str) for p in prompt):
            return tuple(prompt)
        if all(isinstance(p, list) and p and all(is_int(t) for t in p) for p in prompt):
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
    check_fields(body, CHAT_FIELDS)
    max_tokens = read_int(body, "max_completion_tokens", None, 1)
    max_tokens = read_int(body, "max_tokens", max_tokens, 1)
    common = common_fields(body, limits, max_tokens or 0)
    logprobs = read_bool(body, "logprobs")
    if read_int(body, "top_logprobs", 0, 0, 20) > 0:
        raise unsupported(
            "top_logprobs", "only the chosen token's logprob exists; send 0 or leave it out"
        )
    _refuse_chat_features(body)
    messages = tuple(_message(m, i) for i, m in enumerate(_messages_list(body)))
    request = GenerationRequest(endpoint="chat", messages=messages, logprobs=logprobs, **common)
    return check_choices(request, limits)


def _refuse_chat_features(body: Mapping[str, Any]) -> None:
    for name in ("tools", "functions"):
        if body.get(name):
            raise unsupported(name, "tool calling is not implemented")
    for name in ("tool_choice", "function_call"):
        if body.get(name) not in (None, "none", "auto"):
            raise unsupported(name, "tool calling is not implemented")
    read_bool(body, "parallel_tool_calls")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise unsupported("response_format", 'only {"type": "text"} is served')


def _messages_list(body: Mapping[str, Any]) -> list[Any]:
    messages = read_field(body, "messages", lambda v: isinstance(v, list), "a list", MISSING)
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
