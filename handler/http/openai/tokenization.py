"""`POST /tokenize` and `POST /detokenize`, in vLLM's request and response shapes.

    /tokenize    {"prompt": str, "add_special_tokens": true, "return_token_strs": false}
               | {"messages": [...], "add_generation_prompt": true, "add_special_tokens": false}
              → {"count": int, "max_model_len": int, "tokens": [int], "token_strs": [str] | null}
    /detokenize  {"tokens": [int]} → {"prompt": str}

Contract: `tokenize_body(body, limits, tokenizer, max_input_len)` and
`detokenize_body(body, limits, tokenizer, max_input_len)` return the response body or raise
`ApiError`, as the generation endpoints do: the body validated by its model in `schema`
(unknown fields ignored and logged; `prompt` and `messages` both given a 400), `model` the
served one or left out, a text refused unencoded
when it cannot fit `max_input_len` tokens (400 `context_length_exceeded`, the bound the
generation endpoints use, so a 4 MB body costs no encoding), a chat rendered by the model's
chat template, token ids outside the vocabulary or more of them than the model's length a 400.
`max_model_len` is `max_input_len + 1`, as `GET /v1/models` says.
"""

from __future__ import annotations

from typing import Any

from snapfn.handler.http.openai.params import check_model
from snapfn.handler.http.openai.parse import (
    chat_message,
    check_text_length,
    check_token_count,
    encode_bounded,
    warn_unknown,
)
from snapfn.handler.http.openai.request import ApiError, Limits


def tokenize_body(body: Any, limits: Limits, tokenizer: Any, max_input_len: int) -> dict[str, Any]:
    from snapfn.handler.http.openai.schema import (  # NOTE: lazy, see parse.py
        TokenizeChatRequest,
        TokenizeCompletionRequest,
        validate_body,
    )

    chat = isinstance(body, dict) and body.get("messages") is not None  # null: left out
    if chat and body.get("prompt") is not None:
        raise ApiError(
            "send either 'prompt' or 'messages', not both", param="prompt", code="invalid_value"
        )
    model = TokenizeChatRequest if chat else TokenizeCompletionRequest
    fields, unknown = validate_body(model, body)
    warn_unknown("/tokenize", unknown)
    check_model(fields.model, limits)
    _require_tokenizer(tokenizer)
    if chat:
        messages = [chat_message(m, i) for i, m in enumerate(fields.messages)]
        check_text_length(
            sum(len(m["content"]) for m in messages), tokenizer, max_input_len, "messages"
        )
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=fields.add_generation_prompt
        )
        param = "messages"
    else:
        text, param = fields.prompt, "prompt"
    ids = encode_bounded(tokenizer, text, max_input_len, param, fields.add_special_tokens)
    check_token_count(len(ids), max_input_len, param)
    strs = [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    return {
        "count": len(ids),
        "max_model_len": max_input_len + 1,
        "tokens": ids,
        "token_strs": strs if fields.return_token_strs else None,
    }


def detokenize_body(
    body: Any, limits: Limits, tokenizer: Any, max_input_len: int
) -> dict[str, Any]:
    from snapfn.handler.http.openai.schema import DetokenizeRequest, validate_body  # NOTE: lazy

    fields, unknown = validate_body(DetokenizeRequest, body)
    warn_unknown("/detokenize", unknown)
    check_model(fields.model, limits)
    _require_tokenizer(tokenizer)
    if len(fields.tokens) > max_input_len + 1:
        raise ApiError(
            f"{len(fields.tokens)} tokens, more than this model's length ({max_input_len + 1})",
            param="tokens",
            code="context_length_exceeded",
        )
    vocab = tokenizer.vocab_size
    bad = [t for t in fields.tokens if t >= vocab]
    if bad:
        raise ApiError(
            f"token ids out of range [0, {vocab}): {bad[:8]}", param="tokens", code="out_of_range"
        )
    return {"prompt": tokenizer.decode(fields.tokens, skip_special_tokens=False)}


def _require_tokenizer(tokenizer: Any) -> None:
    if tokenizer is None:
        raise ApiError("this model has no tokenizer", code="no_tokenizer", status=400)
