"""The stream of one request's outputs and the counters of a service (no torch: the front door
of a process-snapshot worker uses them too).

`Stream` is what `LLMService.submit` returns; `ProcessLLMService` returns a subclass whose
outputs arrive from a restored worker. Iterate a stream, or call `result()`; `cancel()` asks its
service to drop the request.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from snapfn.handler.llm.engine.request import GenerationResult, RequestOutput


@dataclass
class ServiceStats:
    """Counters the metrics endpoint reads."""

    requests: int = 0
    finished: int = 0
    cancelled: int = 0
    failed: int = 0  # ended by an error: their grammar's alone, or every request of a failed step
    generated_tokens: int = 0
    prompt_tokens: int = 0
    steps: int = 0


class Stream:
    """Outputs of one request, in order; iterate it, or call `result()`.

    The service puts outputs (or the exception that ended the request) with `_put`; a subclass
    may instead override `_take(timeout_s)`, which returns the next output or raises
    (`queue.Empty` once `timeout_s` passed), and `_on_done()`, called once the stream ends.
    """

    def __init__(self, service: Any, request_id: str, prompt_ids: list[int]) -> None:
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.submitted_at = time.perf_counter()
        self.first_token_at: float | None = None
        self._service = service
        self._outputs: queue.Queue[RequestOutput | BaseException] = queue.Queue()
        self._done = False

    def _put(self, item: RequestOutput | BaseException) -> None:
        if self.first_token_at is None and isinstance(item, RequestOutput):
            self.first_token_at = time.perf_counter()
        self._outputs.put(item)

    def _take(self, timeout_s: float | None) -> RequestOutput:
        item = self._outputs.get(timeout=timeout_s)
        if isinstance(item, BaseException):
            raise item
        return item

    def _on_done(self) -> None:
        pass

    def __iter__(self) -> Iterator[RequestOutput]:
        return self._iter_until(None)

    def result(self, timeout_s: float | None = None) -> GenerationResult:
        """Wait for the request to finish and collect its tokens, logprobs and text."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        tokens, logprobs, text, reason = [], [], [], None
        for out in self._iter_until(deadline):
            tokens += out.new_token_ids
            logprobs += out.new_logprobs
            text.append(out.text_delta)
            reason = out.finish_reason
        return GenerationResult(
            self.request_id,
            tuple(self.prompt_ids),
            tuple(tokens),
            tuple(logprobs),
            "".join(text),
            reason or "unknown",
        )

    def _iter_until(self, deadline: float | None) -> Iterator[RequestOutput]:
        while not self._done:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                out = self._take(wait)
            except queue.Empty:
                self.cancel()
                raise TimeoutError(f"request {self.request_id} did not finish in time") from None
            except BaseException:
                self._end()
                raise
            if out.finished:
                self._end()
            yield out

    def cancel(self) -> None:
        if not self._done:
            self._end()
            self._service.cancel(self.request_id)

    def _end(self) -> None:
        if not self._done:
            self._done = True
            self._on_done()
