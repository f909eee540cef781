"""OpenAI's response wire format: full bodies, streamed chunks, usage, logprobs and errors.

Contract: every builder returns a plain dict, ready for strict JSON (`allow_nan=False`).
- `response_body` is the whole (non-streamed) `text_completion` / `chat.completion` object.
- `chunk_body` is one server-sent event of a stream (`text_completion` /
  `chat.completion.chunk`); chat streams open each choice with a `role` chunk (`out=None`).
  With `stream_options.include_usage`, every chunk carries `"usage": null` and `usage_chunk`
  (no choices, the counts) comes last.
- Logprobs are the chosen token's only (`top_logprobs` empty or null); a -inf logprob is
  reported as `NON_FINITE_LOGPROB` (-9999.0), as OpenAI does.
- `error_body` is OpenAI's `{"error": {"message", "type", "param", "code"}}`.
- `return_token_ids` (a vLLM extension) adds `token_ids` to every choice and chunk.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from snapfn.handler.http.openai.request import GenerationRequest
from snapfn.handler.llm.engine.request import RequestOutput

NON_FINITE_LOGPROB = -9999.0  # what OpenAI reports for a logprob that is -inf

TokenText = Callable[[int], str]


@dataclass(frozen=True)
class ResponseMeta:
    """What every chunk of one response repeats: its id, creation time and model."""

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
    """OpenAI's token counts: every prompt's tokens, every choice's generated tokens."""
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
