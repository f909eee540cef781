"""OpenAI-compatible request parsing: a JSON body → a `GenerationRequest` → engine inputs.

Contract:
- `parse_completion(body, limits)` / `parse_chat(body, limits)` take a decoded JSON body and
  return a `GenerationRequest`, or raise `ApiError` naming the field to fix (`param`) and how.
  The body is validated against its model in `schema` (strict types, OpenAI's ranges); unknown
  fields are ignored, each request that sent some logged once as a warning naming them. What
  validates but is not served (`suffix`, `best_of` other than `n`) is refused here rather than
  silently ignored. The response shapes are `shapes`'.
- `tokenize(request, tokenizer, max_input_len)` turns the prompts into token ids, rendering chat
  messages through the model's chat template, and refuses prompts longer than `max_input_len`
  tokens (400 `context_length_exceeded`): first by their characters, before any encoding (a text
  longer than `tokenizer.max_prompt_chars(max_input_len)` cannot fit, so a 4 MB prompt costs a
  length check, not an encoding), then, where that bound is loose (a long context), by a
  prefix of 8 characters per allowed token that already holds too many, then by their tokens.
  With a tokenizer, prompt token ids and `logit_bias` keys outside its vocabulary are a 400
  (`out_of_range`) naming `prompt` or `logit_bias`.
- `choice_params(request, index, prompt_len, max_input_len)` is the engine's `SamplingParams` for
  one choice; with a `seed`, choice `i` samples with `seed + i`.

NOTE: `schema` (pydantic: ~80 ms to import and build) is imported by the parse functions, not
at the top: `snapfn --help` and the activator import this module (serve.py → app.py →
generation.py) and never parse a request; a worker loads it as it builds its app (app.py).

Logprobs: completions' `logprobs: k` and chat's `logprobs: true` with `top_logprobs: k` report
each generated token's logprob and its `k` (at most 20) most likely alternatives; chat's
`top_logprobs` without `logprobs: true` is a 400, as in vLLM. Completions' `echo` puts the prompt
before the completion; with `logprobs`, the prompt's tokens come with their logprobs (the first
one's null) and alternatives. A temperature below 1e-5 means greedy decoding. Extensions
(vLLM's names): `top_k`, `repetition_penalty`, `ignore_eos`, `stop_token_ids`,
`return_token_ids` (adds `token_ids` to every choice and chunk).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from snapfn.handler.http.openai.params import check_choices, common_fields
from snapfn.handler.http.openai.request import ApiError, GenerationRequest, Limits, unsupported
from snapfn.handler.llm.engine.request import SamplingParams

if TYPE_CHECKING:
    from snapfn.handler.http.openai.schema import ChatMessage

log = logging.getLogger("snapfn.http")


def warn_unknown(endpoint: str, unknown: list[str]) -> None:
    """Log, once per request, the fields it sent that are ignored."""
    if unknown:
        names = ", ".join(repr(name[:60]) for name in unknown[:16])
        more = f" and {len(unknown) - 16} more" if len(unknown) > 16 else ""
        log.warning("%s: ignoring unknown request fields %s%s", endpoint, names, more)


# ---- completions ----------------------------------------------------------------------------
def parse_completion(body: Any, limits: Limits) -> GenerationRequest:
    from snapfn.handler.http.openai.schema import CompletionRequest, validate_body  # NOTE: lazy

    fields, unknown = validate_body(CompletionRequest, body)
    warn_unknown("/v1/completions", unknown)
    common = common_fields(fields, limits, fields.max_tokens)
    if fields.suffix:
        raise unsupported("suffix", "insertion is not implemented")
    if fields.best_of is not None and fields.best_of != fields.n:
        raise unsupported("best_of", "it must equal n (or be left out)")
    k = fields.logprobs or 0
    common["params"] = replace(
        common["params"],
        top_logprobs=k,
        prompt_logprobs=k if fields.echo and fields.logprobs is not None else None,
    )
    request = GenerationRequest(
        endpoint="completions",
        prompts=_prompts(fields.prompt),
        logprobs=fields.logprobs is not None,
        top_logprobs=k,
        echo=fields.echo,
        **common,
    )
    return check_choices(request, limits)


def _prompts(
    prompt: str | list[str] | list[int] | list[list[int]],
) -> tuple[str | tuple[int, ...], ...]:
    """One prompt per item: a string, or a tuple of token ids."""
    if isinstance(prompt, str):
        return (prompt,)
    if isinstance(prompt[0], int):
        return (tuple(prompt),)
    return tuple(p if isinstance(p, str) else tuple(p) for p in prompt)


# ---- chat -----------------------------------------------------------------------------------
def parse_chat(body: Any, limits: Limits) -> GenerationRequest:
    from snapfn.handler.http.openai.schema import ChatCompletionRequest, validate_body  # NOTE: lazy

    fields, unknown = validate_body(ChatCompletionRequest, body)
    warn_unknown("/v1/chat/completions", unknown)
    # max_completion_tokens wins over max_tokens (OpenAI's newer name; vLLM reads it first);
    # neither: 0, fill the context
    max_tokens = fields.max_completion_tokens or fields.max_tokens or 0
    common = common_fields(fields, limits, max_tokens)
    if fields.top_logprobs > 0 and not fields.logprobs:
        raise ApiError(
            "'top_logprobs' needs 'logprobs': true",
            param="top_logprobs",
            code="invalid_value",
        )
    k = fields.top_logprobs if fields.logprobs else 0
    common["params"] = replace(common["params"], top_logprobs=k)
    messages = tuple(chat_message(m, i) for i, m in enumerate(fields.messages))
    request = GenerationRequest(
        endpoint="chat", messages=messages, logprobs=fields.logprobs, top_logprobs=k, **common
    )
    return check_choices(request, limits)


def chat_message(message: ChatMessage, i: int) -> dict[str, Any]:
    """The message as the chat template reads it: its content's text parts joined."""
    if message.content is None and message.role != "assistant":
        raise ApiError(
            f"'messages[{i}].content' is required (only an assistant's may be left out)",
            param=f"messages[{i}].content",
            code="missing_field",
        )
    content = message.content or ""
    text = content if isinstance(content, str) else "".join(p.text for p in content)
    out = {"role": message.role, "content": text}
    if message.name is not None:
        out["name"] = message.name
    return out


# ---- prompts → token ids → engine parameters ------------------------------------------------
def tokenize(request: GenerationRequest, tokenizer: Any, max_input_len: int) -> list[list[int]]:
    """Token ids of each prompt, each at most `max_input_len` long (else 400), texts bounded by
    their length before they are encoded."""
    param = "messages" if request.endpoint == "chat" else "prompt"
    texts_needed = request.endpoint == "chat" or any(isinstance(p, str) for p in request.prompts)
    if texts_needed and tokenizer is None:
        raise ApiError(
            "this model has no tokenizer: send 'prompt' as token ids",
            param=param,
            code="no_tokenizer",
        )
    if request.endpoint == "chat":
        chars = sum(len(m["content"]) for m in request.messages)
        check_text_length(chars, tokenizer, max_input_len, param)
        text = tokenizer.apply_chat_template(list(request.messages), add_generation_prompt=True)
        prompts = [encode_bounded(tokenizer, text, max_input_len, param, special=False)]
    else:
        prompts = [
            encode_bounded(tokenizer, p, max_input_len, param) if isinstance(p, str) else list(p)
            for p in request.prompts
        ]
    for ids in prompts:
        if not ids:
            raise ApiError("the prompt is empty", param=param, code="invalid_value")
        check_token_count(len(ids), max_input_len, param)
    if tokenizer is not None:
        check_vocabulary(prompts, request.params.logit_bias, tokenizer.vocab_size, param)
    return prompts


def check_vocabulary(
    prompts: list[list[int]], logit_bias: tuple[tuple[int, float], ...], vocab: int, param: str
) -> None:
    """Refuse prompt token ids and `logit_bias` keys outside the vocabulary [0, `vocab`)."""
    given = (
        (param, [t for ids in prompts for t in ids]),
        ("logit_bias", [t for t, _ in logit_bias]),
    )
    for name, ids in given:
        bad = [t for t in ids if t >= vocab]
        if bad:
            raise ApiError(
                f"'{name}' holds token ids out of range [0, {vocab}) (this model's "
                f"vocabulary): {bad[:8]}",
                param=name,
                code="out_of_range",
            )


# a prefix this many characters per allowed token long is encoded first: typical text holds
# 3–5 characters a token, so such a prefix of a text far too long already holds too many tokens
PROBE_CHARS_PER_TOKEN = 8
PROBE_SLACK_TOKENS = 64  # a prefix may split its last word into more tokens than the whole does


def encode_bounded(
    tokenizer: Any, text: str, max_tokens: int, param: str, special: bool = True
) -> list[int]:
    """`tokenizer.encode(text)`, refused (400) where `text` is too long to fit: unencoded when
    its length alone says so; after encoding only a prefix when that prefix already holds too
    many tokens (a long-context model's bound by length allows megabytes)."""
    check_text_length(len(text), tokenizer, max_tokens, param)
    probe = max_tokens * PROBE_CHARS_PER_TOKEN
    if len(text) > probe:
        head = tokenizer.encode(text[:probe], add_special_tokens=False)
        if len(head) > max_tokens + PROBE_SLACK_TOKENS:
            raise ApiError(
                f"the prompt's first {probe} characters already hold {len(head)} tokens; this "
                f"model accepts at most {max_tokens}: shorten it",
                param=param,
                code="context_length_exceeded",
            )
    return tokenizer.encode(text, add_special_tokens=special)


def check_text_length(chars: int, tokenizer: Any, max_tokens: int, param: str) -> None:
    """Refuse `chars` characters of text that cannot encode to `max_tokens` tokens or fewer."""
    bound = tokenizer.max_prompt_chars(max_tokens)
    if chars > bound:
        raise ApiError(
            f"the prompt has {chars} characters, more than the {bound} that can fit the "
            f"{max_tokens} tokens this model accepts: shorten it",
            param=param,
            code="context_length_exceeded",
        )


def check_token_count(num_tokens: int, max_tokens: int, param: str) -> None:
    if num_tokens > max_tokens:
        raise ApiError(
            f"the prompt has {num_tokens} tokens; this model accepts at most {max_tokens}: "
            "shorten it",
            param=param,
            code="context_length_exceeded",
        )


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
