"""The built-in LLM function, written against the function API: `handler(event, context)`.

Event (a JSON object; exactly one of prompt, prompt_ids, messages):

    {"prompt": str | "prompt_ids": [int] | "messages": [{"role": str, "content": str}, …],
     "chat": bool,            # wrap "prompt" in the model's chat template as one user turn
     "max_tokens": int,       # default: SamplingParams' max_new_tokens
     "temperature": float, "top_p": float, "top_k": int, "seed": int | null,
     "stop": str | [str], "ignore_eos": bool}

Result:

    {"text": str, "token_ids": [int], "logprobs": [float], "finish_reason": "stop" | "length" | …,
     "usage": {"prompt_tokens": int, "completion_tokens": int, "total_tokens": int}}

A bad event raises `BadRequest` with a message that says what to fix, a text too long to fit the
engine's context before it is encoded (`Tokenizer.max_prompt_chars`); the generation waits at
most the context's remaining time (then it is cancelled, its KV pages freed, TimeoutError).

State: an `LLMHandler` instance owns the `LLMService` it generates with; it has no module-level
state. The service exists only once the worker's init or restore is done, so the worker runtime
builds the handler then and calls it exactly like a user function's handler (same Context, same
structured errors). The LLM's own init and restore are its snapshot recipe (`function.py`), not
function-API hooks.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from snapfn.handler.api import Context
from snapfn.handler.llm.engine.request import GenerationResult, SamplingParams
from snapfn.snapshot.errors import BadRequest

if TYPE_CHECKING:
    from snapfn.handler.llm.service import LLMService

PROMPT_FIELDS = ("prompt", "prompt_ids", "messages")
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos")
EVENT_FIELDS = frozenset((*PROMPT_FIELDS, "chat", *SAMPLING_FIELDS))
HEALTH_PROMPT = "Hello"


@dataclass(frozen=True)
class LLMInput:
    prompt_ids: list[int]
    params: SamplingParams


class LLMHandler:
    """`handler(event, context)` for the built-in LLM, bound to one worker's LLMService."""

    def __init__(self, service: LLMService) -> None:
        self.service = service

    def __call__(self, event: dict[str, Any], context: Context) -> dict[str, Any]:
        request = parse_event(event, self.service.tokenizer, self.service.max_req_input_len)
        timeout_s = context.get_remaining_time_in_millis() / 1000
        result = self.service.generate(request.prompt_ids, request.params, timeout_s=timeout_s)
        return result_json(result)

    def health_check(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """One real 1-token greedy generation through the service (the whole serving path)."""
        tok = self.service.tokenizer
        prompt = (tok.encode(HEALTH_PROMPT) if tok is not None else []) or [0]
        t0 = time.perf_counter()
        params = SamplingParams(max_new_tokens=1, ignore_eos=True)
        result = self.service.generate(prompt, params, timeout_s=timeout_s)
        return {
            "ok": True,
            "prompt_ids": prompt,
            "token": result.token_ids[0],
            "logprob": result.logprobs[0],
            "seconds": round(time.perf_counter() - t0, 6),
        }


def parse_event(
    event: Mapping[str, Any], tokenizer: Any, max_input_len: int | None = None
) -> LLMInput:
    """Validate an event into prompt ids and sampling parameters (BadRequest if anything's off);
    with `max_input_len`, a text that cannot fit it is refused before it is encoded."""
    unknown = sorted(set(event) - EVENT_FIELDS)
    if unknown:
        raise BadRequest(f"unknown field(s) {unknown}; the LLM event takes {sorted(EVENT_FIELDS)}")
    _check_text_length(event, tokenizer, max_input_len)
    return LLMInput(prompt_ids(event, tokenizer), sampling_params(event))


def _check_text_length(event: Mapping[str, Any], tokenizer: Any, max_input_len: int | None) -> None:
    if max_input_len is None or tokenizer is None:
        return
    messages = event.get("messages")
    texts = [event.get("prompt")] + [
        m.get("content")
        for m in (messages if isinstance(messages, list) else ())
        if isinstance(m, dict)
    ]
    chars = sum(len(t) for t in texts if isinstance(t, str))
    bound = tokenizer.max_prompt_chars(max_input_len)
    if chars > bound:
        raise BadRequest(
            f"the prompt has {chars} characters, more than the {bound} that can fit the "
            f"{max_input_len} tokens this model accepts: shorten it"
        )


def prompt_ids(event: Mapping[str, Any], tokenizer: Any) -> list[int]:
    given = [k for k in PROMPT_FIELDS if event.get(k) is not None]  # null: left out
    if len(given) != 1:
        raise BadRequest(f"give exactly one of {', '.join(PROMPT_FIELDS)}; got {given or 'none'}")
    chat = _typed(event, "chat", bool, False)
    if given == ["prompt_ids"]:
        if chat:
            raise BadRequest("chat applies to prompt or messages; prompt_ids are used as given")
        ids = event["prompt_ids"]
        if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
            raise BadRequest("prompt_ids must be a list of integer token ids")
        return list(ids)
    if tokenizer is None:
        raise BadRequest("this model has no tokenizer.json: send prompt_ids instead of text")
    if given == ["messages"]:
        return _encode_chat(tokenizer, _messages(event["messages"]))
    text = event["prompt"]
    if not isinstance(text, str):
        raise BadRequest(f"prompt must be a string, got {type(text).__name__}")
    if chat:
        return _encode_chat(tokenizer, [{"role": "user", "content": text}])
    return tokenizer.encode(text)


def sampling_params(event: Mapping[str, Any]) -> SamplingParams:
    defaults = SamplingParams()
    max_tokens = _typed(event, "max_tokens", int, defaults.max_new_tokens)
    if max_tokens < 1:
        raise BadRequest(f"max_tokens must be >= 1, got {max_tokens}")
    seed = event.get("seed")
    if seed is not None and not _is_int(seed):
        raise BadRequest(f"seed must be an integer or null, got {type(seed).__name__}")
    return SamplingParams(
        max_new_tokens=max_tokens,
        temperature=_typed(event, "temperature", float, defaults.temperature),
        top_p=_typed(event, "top_p", float, defaults.top_p),
        top_k=_typed(event, "top_k", int, defaults.top_k),
        seed=seed,
        stop=_stop(event.get("stop")),
        ignore_eos=_typed(event, "ignore_eos", bool, defaults.ignore_eos),
    ).validate()


def result_json(result: GenerationResult) -> dict[str, Any]:
    num_prompt, num_completion = len(result.prompt_ids), len(result.token_ids)
    return {
        "text": result.text,
        "token_ids": list(result.token_ids),
        "logprobs": list(result.logprobs),
        "finish_reason": result.finish_reason,
        "usage": {
            "prompt_tokens": num_prompt,
            "completion_tokens": num_completion,
            "total_tokens": num_prompt + num_completion,
        },
    }


def _encode_chat(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise BadRequest("messages must be a non-empty list of {role, content} objects")
    for i, m in enumerate(value):
        ok = isinstance(m, dict) and isinstance(m.get("role"), str)
        if not ok or not isinstance(m.get("content"), str):
            raise BadRequest(f"messages[{i}] must be an object with string role and content")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise BadRequest("stop must be a string or a list of strings")
    return tuple(stops)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _typed(event: Mapping[str, Any], name: str, kind: type, default: Any) -> Any:
    """`event[name]` checked against `kind` (int excludes bool; float accepts an int that a
    float can hold, and returns it as a float)."""
    value = event.get(name)
    if value is None:
        return default
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = _is_int(value)
    else:
        ok = _is_int(value) or isinstance(value, float)
    if not ok:
        raise BadRequest(
            f"{name} must be {kind.__name__}, got {type(value).__name__} {value!r:.60}"
        )
    if kind is float:
        try:
            return float(value)
        except OverflowError:
            raise BadRequest(
                f"{name} must be float, got an integer too large for one ({value!r:.60}…)"
            ) from None
    return value
