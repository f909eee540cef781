"""OpenAI's response wire format: full bodies, streamed chunks, usage, logprobs and errors.

Contract: every builder returns a plain dict, ready for strict JSON (`allow_nan=False`).
- `response_body` is the whole (non-streamed) `text_completion` / `chat.completion` object.
- `chunk_body` is one server-sent event of a stream (`text_completion` /
  `chat.completion.chunk`); chat streams open each choice with a `role` chunk (`out=None`).
  With `stream_options.include_usage`, every chunk carries `"usage": null` and `usage_chunk`
  (no choices, the counts) comes last.
- Logprobs: each token's, and with `top_logprobs` k > 0 its k most likely alternatives
  (completions: a `{text: logprob}` object per token that also holds the chosen token, as vLLM
  writes it, null at k = 0; chat: `top_logprobs` lists of `{token, logprob, bytes}`). A -inf
  logprob is reported as `NON_FINITE_LOGPROB` (-9999.0), as OpenAI does.
- Completions' `echo`: the prompt (`PromptEcho`) comes before the completion in the text, and
  with logprobs its tokens come first in `logprobs`, the first one's logprob and alternatives
  null; a stream sends it in each choice's first chunk.
- `error_body` is OpenAI's `{"error": {"message", "type", "param", "code"}}`.
- `return_token_ids` (a vLLM extension) adds `token_ids` to every choice and chunk.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from snapfn.handler.http.openai.request import GenerationRequest
from snapfn.handler.llm.engine.request import RequestOutput, TopLogprobs

NON_FINITE_LOGPROB = -9999.0  # what OpenAI reports for a logprob that is -inf

TokenText = Callable[[int], str]


@dataclass(frozen=True)
class ResponseMeta:
    """What every chunk of one response repeats: its id, creation time and model."""

    id: str
    created: int
    model: str


@dataclass(frozen=True)
class PromptEcho:
    """A completion's prompt as `echo` sends it back: its text, tokens and (with logprobs)
    their logprobs and alternatives, the first token's None."""

    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float | None, ...] = ()
    top_logprobs: tuple[TopLogprobs | None, ...] = ()


@dataclass
class Choice:
    """What one choice has produced so far (`echo`: its prompt, once its first output came)."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    echo: PromptEcho | None = None

    def add(self, out: RequestOutput) -> None:
        self.token_ids += out.new_token_ids
        self.logprobs += out.new_logprobs
        self.top_logprobs += out.new_top_logprobs
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


def _finite(logprob: float | None) -> float | None:
    if logprob is None:
        return None
    return logprob if math.isfinite(logprob) else NON_FINITE_LOGPROB


def _top_object(
    top: TopLogprobs | None, chosen: int, logprob: float | None, token_text: TokenText
) -> dict[str, float] | None:
    """Completions' alternatives of one token, `{text: logprob}`, the chosen token included."""
    if top is None:
        return None
    out: dict[str, float | None] = {}
    for t, lp in top:  # tokens that read the same keep the likelier one's logprob
        out.setdefault(token_text(t), _finite(lp))
    out.setdefault(token_text(chosen), _finite(logprob))
    return out


def completion_logprobs(
    ids: Sequence[int],
    logprobs: Sequence[float | None],
    token_text: TokenText,
    tops: Sequence[TopLogprobs | None] = (),
    k: int = 0,
) -> dict[str, Any]:
    """The `logprobs` object of completions for `ids` (with `k` > 0: `tops`, one per token).
    `text_offset` indexes the choice's text, where special tokens are not written: a token
    adds the length of what it writes there (`token_text.shown`, where given), not of its name."""
    tokens = [token_text(t) for t in ids]
    shown = getattr(token_text, "shown", token_text)
    offsets, at = [], 0
    for token_id in ids:
        offsets.append(at)
        at += len(shown(token_id))
    top_objects = None
    if k > 0:
        tops = [*tops, *[()] * (len(ids) - len(tops))]  # a worker that sent none: the chosen
        top_objects = [
            _top_object(top, t, lp, token_text)
            for t, lp, top in zip(ids, logprobs, tops, strict=True)
        ]
    return {
        "tokens": tokens,
        "token_logprobs": [_finite(lp) for lp in logprobs],
        "top_logprobs": top_objects,
        "text_offset": offsets,
    }


def _chat_entry(token_id: int, logprob: float, token_text: TokenText) -> dict[str, Any]:
    token = token_text(token_id)
    return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode())}


def chat_logprobs(
    ids: Sequence[int],
    logprobs: Sequence[float],
    token_text: TokenText,
    tops: Sequence[TopLogprobs] = (),
) -> dict[str, Any]:
    """The `logprobs` object of chat for `ids` (`tops`, one per token, when asked for)."""
    tops = [*tops, *[()] * (len(ids) - len(tops))]  # not asked for (or not sent): none
    content = []
    for token_id, lp, top in zip(ids, logprobs, tops, strict=True):
        entry = _chat_entry(token_id, lp, token_text)
        entry["top_logprobs"] = [_chat_entry(t, alt, token_text) for t, alt in top]
        content.append(entry)
    return {"content": content, "refusal": None}


def _completion_text_and_logprobs(
    request: GenerationRequest,
    echo: PromptEcho | None,
    ids: Sequence[int],
    logprobs: Sequence[float],
    tops: Sequence[TopLogprobs],
    text: str,
    token_text: TokenText,
) -> tuple[str, dict[str, Any] | None]:
    """Completions' text and logprobs object, the echoed prompt (if any) first."""
    k = request.top_logprobs
    if echo is not None:
        text = echo.text + text
        if request.logprobs:
            ids = (*echo.token_ids, *ids)
            logprobs = (*echo.logprobs, *logprobs)
            tops = (*echo.top_logprobs, *tops) if k else ()
    if not request.logprobs:
        return text, None
    return text, completion_logprobs(ids, logprobs, token_text, tops, k)


def _choice_body(request: GenerationRequest, choice: Choice, token_text: TokenText) -> dict:
    ids, lps, text = choice.token_ids, choice.logprobs, "".join(choice.text)
    if request.endpoint == "chat":
        lp = chat_logprobs(ids, lps, token_text, choice.top_logprobs)
        body = {
            "index": choice.index,
            "message": {"role": "assistant", "content": text, "refusal": None},
            "logprobs": lp if request.logprobs else None,
            "finish_reason": choice.finish_reason,
        }
    else:
        text, lp = _completion_text_and_logprobs(
            request, choice.echo, ids, lps, choice.top_logprobs, text, token_text
        )
        body = {
            "index": choice.index,
            "text": text,
            "logprobs": lp,
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
    echo: PromptEcho | None = None,
) -> dict[str, Any]:
    """One streamed chunk for choice `index`; `out=None` is chat's opening `role` chunk;
    `echo` (completions, a choice's first chunk) puts the prompt first."""
    if request.endpoint == "chat":
        choice = _chat_delta(request, index, out, token_text)
    else:
        text, lp = _completion_text_and_logprobs(
            request,
            echo,
            out.new_token_ids,
            out.new_logprobs,
            out.new_top_logprobs,
            out.text_delta,
            token_text,
        )
        choice = {
            "index": index,
            "text": text,
            "logprobs": lp,
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
    lp = chat_logprobs(out.new_token_ids, out.new_logprobs, token_text, out.new_top_logprobs)
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
