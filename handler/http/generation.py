"""The generation driver: one OpenAI request's engine streams, read out whole or as SSE.

Contract:
- `Generation` submits `n` choices per prompt to the LLM service at once (they run
  concurrently in the engine) and reads their outputs in choice order; it records the request's
  queue time, TTFT, inter-token latency, end-to-end time and token counts in `HttpMetrics`.
- `Generation.body()` runs every choice to the end and returns the full response object;
  `Generation.events()` yields server-sent events, one chunk per engine output, `[DONE]` last.
  A failure after the headers went out is sent as an `error` event (the request's own, e.g. a
  grammar it failed, as `invalid_request_error`), then `[DONE]`: never a dropped stream. A
  grammar that does not compile, or fails while generating, is an `ApiError` (`invalid_value`)
  naming the field that sent it, whole or as that event.
- Completions' `echo`: each choice's prompt (its text as sent, or its token ids decoded) is
  attached to the choice with its first output, which carries the prompt's logprobs.
- `close()` cancels every unfinished choice, which frees its KV pages; it is idempotent.
  `EventStream` is the streamed response body: the WSGI server closes it when the client goes
  away (or the stream ends), so a disconnect cancels the generation.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterator
from typing import Any

from snapfn.handler.http.metrics import HttpMetrics
from snapfn.handler.http.openai import shapes
from snapfn.handler.http.openai.parse import choice_params
from snapfn.handler.http.openai.request import ApiError, GenerationRequest
from snapfn.handler.http.openai.shapes import TokenText
from snapfn.handler.llm.structured.compiler import FIELDS
from snapfn.handler.llm.structured.spec import InvalidGuide
from snapfn.snapshot.errors import BadRequest

log = logging.getLogger("snapfn.http")


class Generation:
    """The engine streams of one OpenAI request: `n` choices per prompt, read in choice order.

    Choices run concurrently in the engine; their outputs are read one choice after another
    (the later ones are buffered meanwhile). `close()` cancels whatever has not finished.
    `arrived_at` is the request's arrival on the `time.perf_counter()` clock.
    """

    def __init__(
        self,
        request_: GenerationRequest,
        llm: Any,
        prompts: list[list[int]],
        endpoint: str,
        *,
        metrics: HttpMetrics,
        arrived_at: float,
    ) -> None:
        self.request = request_
        self.endpoint = endpoint
        self._metrics = metrics
        self._arrived_at = arrived_at
        self._token_text = _token_text(llm.tokenizer)
        prefix = "chatcmpl" if request_.endpoint == "chat" else "cmpl"
        self.meta = shapes.ResponseMeta(
            f"{prefix}-{uuid.uuid4().hex}", int(time.time()), request_.model
        )
        self.prompts = prompts
        self.prompt_lens = [len(p) for p in prompts]
        self._tokenizer = llm.tokenizer
        self.streams = self._submit(llm, prompts)
        self.choices = [shapes.Choice(i) for i in range(len(self.streams))]
        self._metrics.queue_seconds.labels(endpoint).observe(time.perf_counter() - self._arrived_at)
        self._metrics.prompt_tokens.labels(endpoint).inc(sum(self.prompt_lens))
        self._metrics.in_flight.inc()
        self._closed = False

    def _submit(self, llm, prompts: list[list[int]]) -> list[Any]:
        streams, n, max_input = [], self.request.n, llm.max_req_input_len
        try:
            for k, ids in enumerate(prompts):
                for j in range(n):
                    params = choice_params(self.request, k * n + j, len(ids), max_input)
                    streams.append(llm.submit(ids, params))
        except BaseException as exc:
            for stream in streams:
                stream.cancel()
            if isinstance(exc, InvalidGuide):  # a grammar that does not compile
                raise ApiError(str(exc), param=exc.param, code="invalid_value") from None
            raise
        return streams

    def _guide_failed(self, exc: BadRequest) -> ApiError:
        """A choice's own failure mid-generation (its grammar past the library's limits) as the
        400 naming the field that sent the grammar."""
        guide = self.request.params.guide
        param = FIELDS[guide.kind][0] if guide is not None else None
        return ApiError(str(exc), param=param, code="invalid_value")

    def outputs(self) -> Iterator[tuple[int, Any]]:
        """(choice index, RequestOutput) in choice order; records latency and token metrics."""
        m, ep, last = self._metrics, self.endpoint, None
        for index, stream in enumerate(self.streams):
            for out in _outputs_of(stream, self._guide_failed):
                now = time.perf_counter()
                if last is None:
                    m.ttft_seconds.labels(ep).observe(
                        (stream.first_token_at or now) - self._arrived_at
                    )
                elif index == 0:
                    m.itl_seconds.labels(ep).observe(now - last)
                last = now
                m.generation_tokens.labels(ep).inc(len(out.new_token_ids))
                choice = self.choices[index]
                if self.request.echo and choice.echo is None:
                    choice.echo = self._echo(index, out)
                choice.add(out)
                yield index, out
        m.e2e_seconds.labels(ep).observe(time.perf_counter() - self._arrived_at)

    def _echo(self, index: int, first: Any) -> shapes.PromptEcho:
        """Choice `index`'s prompt, to put before its completion (`first`: its first output)."""
        k = index // self.request.n
        given, ids = self.request.prompts[k], self.prompts[k]
        if isinstance(given, str):
            text = given
        elif self._tokenizer is not None:
            text = self._tokenizer.decode(ids, skip_special_tokens=False)
        else:
            text = ""
        if not self.request.logprobs:
            return shapes.PromptEcho(text)
        logprobs = first.prompt_logprobs or (None,) * len(ids)
        tops = first.prompt_top_logprobs or (None,) + ((),) * (len(ids) - 1)
        return shapes.PromptEcho(text, tuple(ids), tuple(logprobs), tuple(tops))

    def usage(self) -> dict[str, int]:
        return shapes.usage(self.prompt_lens, self.choices)

    def body(self) -> dict[str, Any]:
        """Run every choice to the end; the full response object."""
        try:
            for _ in self.outputs():
                pass
        finally:
            self.close()
        return shapes.response_body(
            self.request, self.meta, self.choices, self.usage(), self._token_text
        )

    def events(self) -> Iterator[str]:
        """Server-sent events: one chunk per engine output, `[DONE]` last. Closing cancels."""
        req, opened = self.request, set()
        try:
            for index, out in self.outputs():
                if req.endpoint == "chat" and index not in opened:
                    opened.add(index)
                    yield _sse(shapes.chunk_body(req, self.meta, index, None, self._token_text))
                echo = self.choices[index].echo if index not in opened else None
                opened.add(index)
                yield _sse(shapes.chunk_body(req, self.meta, index, out, self._token_text, echo))
            if req.include_usage:
                yield _sse(shapes.usage_chunk(req, self.meta, self.usage()))
            yield "data: [DONE]\n\n"
        except BadRequest as exc:  # the request's own (a grammar it failed): as a 400 says it
            param = getattr(exc, "param", None)
            code = getattr(exc, "api_code", None) or exc.code
            yield _sse(shapes.error_body(str(exc), "invalid_request_error", param, code=code))
            yield "data: [DONE]\n\n"  # vLLM's stream ends so too: clients wait for it
        except Exception as exc:  # headers are sent: the error goes out as an event
            log.exception("generation %s failed mid-stream", self.meta.id)
            yield _sse(
                shapes.error_body(
                    f"generation failed: {exc}", "server_error", code="internal_error"
                )
            )
            yield "data: [DONE]\n\n"
        finally:
            self.close()

    def close(self) -> None:
        """Cancel unfinished choices (frees their KV pages); idempotent."""
        if self._closed:
            return
        self._closed = True
        self._metrics.in_flight.dec()
        for stream in self.streams:
            stream.cancel()


class EventStream:
    """The response body of a streamed generation; `close()` (client gone, or done) cancels it.

    NOTE: a plain generator would not do: closing a generator that never started runs none of
    its code, so a client that left before the first token would leave its choices running.
    """

    def __init__(self, generation: Generation) -> None:
        self._generation = generation
        self._events = generation.events()

    def __iter__(self) -> Iterator[str]:
        return self._events

    def close(self) -> None:
        self._events.close()
        self._generation.close()


def _outputs_of(stream: Any, failed: Any) -> Iterator[Any]:
    """`stream`'s outputs; a request's own failure (a `BadRequest` without a field) through
    `failed`, which names the field."""
    try:
        yield from stream
    except ApiError:
        raise
    except BadRequest as exc:
        if getattr(exc, "param", None) is not None:
            raise
        raise failed(exc) from None


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, allow_nan=False)}\n\n"


def _token_text(tokenizer: Any) -> TokenText:
    """A token's name in `tokens` (special tokens by theirs), and as `shown`, what it writes
    into the text (nothing for a special token), which `text_offset` counts."""
    if tokenizer is None:
        return lambda token_id: f"<{token_id}>"

    def token_text(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False)

    token_text.shown = lambda token_id: tokenizer.decode([token_id], skip_special_tokens=True)
    return token_text
