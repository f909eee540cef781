"""LLMService: the engine driven by one background thread, shared by every front door.

Front doors (HTTP handler threads, the queue worker) call `submit()` from any thread and read
the returned `Stream`; one loop thread owns the engine and steps it while there is work, so
requests from all callers are batched together (continuous batching). A stream that its
caller abandons (`cancel()`, client disconnect) has its request cancelled and its KV pages
freed at the next step.

Thread-safety: `Engine.add_request` / `cancel` / `step` take the engine's lock; the loop is the
only caller of `step`. Outputs reach streams through per-request queues.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from .engine.engine import Engine
from .engine.request import GenerationResult, RequestOutput, SamplingParams
from .service_stats import ServiceStats


class Stream:
    """Outputs of one request, in order; iterate it, or call `result()`."""

    def __init__(self, service: LLMService, request_id: str, prompt_ids: list[int]) -> None:
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

    def __iter__(self) -> Iterator[RequestOutput]:
        while not self._done:
            item = self._outputs.get()
            if isinstance(item, BaseException):
                self._done = True
                raise item
            self._done = item.finished
            yield item

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
                item = self._outputs.get(timeout=wait)
            except queue.Empty:
                self.cancel()
                raise TimeoutError(f"request {self.request_id} did not finish in time") from None
            if isinstance(item, BaseException):
                self._done = True
                raise item
            self._done = item.finished
            yield item

    def cancel(self) -> None:
        if not self._done:
            self._done = True
            self._service.cancel(self.request_id)


@dataclass
class LLMService:
    engine: Engine
    idle_wait_s: float = 0.05
    stats: ServiceStats = field(default_factory=ServiceStats)

    def __post_init__(self) -> None:
        self._streams: dict[str, Stream] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="snapfn-engine", daemon=True)
        self._thread.start()

    @property
    def max_req_input_len(self) -> int:
        return self.engine.max_req_input_len

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> Stream:
        """Queue a request (validated now: raises BadRequest) and return its stream."""
        with self._lock:
            request_id = self.engine.add_request(list(prompt_ids), params)
            stream = Stream(self, request_id, list(prompt_ids))
            self._streams[request_id] = stream
            self.stats.requests += 1
            self.stats.prompt_tokens += len(prompt_ids)
        self._wake.set()
        return stream

    def generate(
        self, prompt_ids: list[int], params: SamplingParams, timeout_s: float | None = None
    ) -> GenerationResult:
        return self.submit(prompt_ids, params).result(timeout_s)

    def cancel(self, request_id: str) -> None:
        with self._lock:
            if self._streams.pop(request_id, None) is not None and self.engine.cancel(request_id):
                self.stats.cancelled += 1

    def kv_usage(self) -> float:
        return self.engine.kv.usage()

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self.engine.has_work():
                self._wake.wait(self.idle_wait_s)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a failed step fails its requests, never the loop
                self._fail_all(exc)
                continue
            self.stats.steps += 1
            self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        with self._lock:
            for out in outputs:
                stream = self._streams.get(out.request_id)
                self.stats.generated_tokens += len(out.new_token_ids)
                if out.finished:
                    self._streams.pop(out.request_id, None)
                    self.stats.finished += 1
                if stream is not None:
                    stream._put(out)

    def _fail_all(self, exc: Exception) -> None:
        with self._lock:
            streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            self.engine.cancel(request_id)
            # one exception object per stream: threads re-raising a shared one would splice
            # their tracebacks into each other's
            failure = RuntimeError(f"engine step failed: {type(exc).__name__}: {exc}")
            failure.__cause__ = exc
            stream._put(failure)
