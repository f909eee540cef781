"""OpenAI-compatible request parsing: a JSON body → a `GenerationRequest` → engine inputs.

Contract:
- `parse_completion(body, limits)` / `parse_chat(body, limits)` take a decoded JSON body and
  return a `GenerationRequest`, or raise `ApiError` naming the field to fix (`param`) and how.
  The body is validated against its model in `schema` (strict types, OpenAI's ranges, no
  unknown fields); what validates but is not served (`echo`, `suffix`, `best_of` other than
  `n`, logprob alternatives, and the shared fields `params` refuses) is refused here rather
  than silently ignored. The response shapes are `shapes`'.
- `tokenize(request, tokenizer, max_input_len)` turns the prompts into token ids, rendering chat
  messages through the model's chat template, and refuses prompts longer than `max_input_len`.
- `choice_params(request, index, prompt_len, max_input_len)` is the engine's `SamplingParams` for
  one choice; with a `seed`, choice `i` samples with `seed + i`.

NOTE: `schema` (pydantic: ~80 ms to import and build) is imported by the parse functions, not
at the top: `snapfn --help` and the activator import this module (serve.py → app.py →
generation.py) and never parse a request; a worker loads it as it builds its app (app.py).

Logprobs: the engine records only the chosen token's logprob, so completions accept
`logprobs: 0` and chat accepts `logprobs: true` with `top_logprobs` 0 or absent; asking for
alternatives (`logprobs` > 0, `top_logprobs` > 0) is a 400. A temperature below 1e-5 means
greedy decoding. Extensions (vLLM's names):
`top_k`, `ignore_eos`, `stop_token_ids`, `return_token_ids` (adds `token_ids` to every choice
and chunk).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from snapfn.handler.http.openai.params import check_choices, common_fields
from snapfn.handler.http.openai.request import ApiError, GenerationRequest, Limits, unsupported
from snapfn.handler.llm.engine.request import SamplingParams

if TYPE_CHECKING:
    from snapfn.handler.http.openai.schema import ChatMessage


# ---- completions ----------------------------------------------------------------------------
def parse_completion(body: Any, limits: Limits) -> GenerationRequest:
    from snapfn.handler.http.openai.schema import CompletionRequest, validate_body  # NOTE: lazy

    fields = validate_body(CompletionRequest, body)
    common = common_fields(fields, limits, fields.max_tokens)
    if fields.logprobs:
        raise unsupported(
            "logprobs", "only the chosen token's logprob exists; send 'logprobs': 0 for it"
        )
    if fields.echo:
        raise unsupported("echo", "the prompt is not echoed back")
    if fields.suffix:
        raise unsupported("suffix", "insertion is not implemented")
    if fields.best_of is not None and fields.best_of != fields.n:
        raise unsupported("best_of", "it must equal n (or be left out)")
    request = GenerationRequest(
        endpoint="completions",
        prompts=_prompts(fields.prompt),
        logprobs=fields.logprobs is not None,
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

    fields = validate_body(ChatCompletionRequest, body)
    max_tokens = fields.max_tokens or fields.max_completion_tokens or 0  # 0: fill the context
    common = common_fields(fields, limits, max_tokens)
    if fields.top_logprobs > 0:
        raise unsupported(
            "top_logprobs", "only the chosen token's logprob exists; send 0 or leave it out"
        )
    messages = tuple(_message(m, i) for i, m in enumerate(fields.messages))
    request = GenerationRequest(
        endpoint="chat", messages=messages, logprobs=fields.logprobs, **common
    )
    return check_choices(request, limits)


def _message(message: ChatMessage, i: int) -> dict[str, Any]:
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
