"""LLMService: the engine driven by one background thread, shared by every front door.

Front doors (HTTP handler threads, the queue worker) call `submit()` from any thread and read
the returned `Stream`; one loop thread owns the engine and steps it while there is work, so
requests from all callers are batched together (continuous batching). A stream that its
caller abandons (`cancel()`, client disconnect) has its request cancelled and its KV pages
freed at the next step.

Thread-safety: `Engine.add_request` / `cancel` / `step` take the engine's lock; the loop is the
only caller of `step`. Outputs reach streams through per-request queues.

With a `lockstep` (rank 0 of a tensor-parallel group, `lockstep.py`) a request is checked where
it is submitted but added, like a cancel, by the loop between steps, each change and each step
sent to the other ranks first; `close()` tells them to stop, then `on_close` runs (the group
is left).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from snapfn.handler.llm.engine.engine import Engine
from snapfn.handler.llm.engine.request import GenerationResult, RequestOutput, SamplingParams
from snapfn.handler.llm.stream import ServiceStats, Stream
from snapfn.snapshot.errors import BadRequest


@dataclass
class LLMService:
    engine: Engine
    idle_wait_s: float = 0.05
    stats: ServiceStats = field(default_factory=ServiceStats)
    lockstep: Any = None  # a `lockstep.Lockstep`: this service drives the other ranks
    on_close: Callable[[], None] | None = None

    def __post_init__(self) -> None:
        self._changes: list[list[Any]] = []  # with a lockstep: applied by the loop
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
            if self.lockstep is None:
                request_id = self.engine.add_request(list(prompt_ids), params)
            else:
                self.engine.check_request(list(prompt_ids), params)
                request_id = f"req-{uuid.uuid4().hex}"
                self._changes.append(["add", request_id, list(prompt_ids), params.to_json()])
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
            if self._streams.pop(request_id, None) is None:
                return
            if self.lockstep is not None:
                self._changes.append(["cancel", request_id])
                self.stats.cancelled += 1
            elif self.engine.cancel(request_id):
                self.stats.cancelled += 1

    def kv_usage(self) -> float:
        return self.engine.kv_usage()

    def prefix_cache_stats(self) -> dict[str, int] | None:
        return self.engine.prefix_cache_stats()

    def spec_stats(self) -> dict[str, float] | None:
        return self.engine.spec_stats()

    def preemptions(self) -> int:
        """Running requests preempted since start (engine/scheduler.py)."""
        return self.engine.scheduler.num_preemptions

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)
        if self.lockstep is not None and not self._thread.is_alive():
            self.lockstep.send({"stop": True})
        if self.on_close is not None:
            self.on_close()

    def _loop(self) -> None:
        while not self._stop.is_set():
            if self.lockstep is not None:
                try:
                    self._lockstep_changes()
                except Exception as exc:  # a rank is gone: nothing can step any more
                    self._fail_all(exc)
                    return
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
            try:
                self._deliver(outputs)
            except Exception as exc:  # never the loop: its requests would wait for good
                self._fail_all(exc)

    def _lockstep_changes(self) -> None:
        """Apply the requests added and cancelled since the last step, then tell the other ranks
        those changes and whether this loop steps now."""
        from snapfn.handler.llm.lockstep import apply

        with self._lock:
            changes, self._changes = self._changes, []
        apply(self.engine, changes)
        self.lockstep.send({"changes": changes, "step": self.engine.has_work()})

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        with self._lock:
            for out in outputs:
                stream = self._streams.get(out.request_id)
                self.stats.generated_tokens += len(out.new_token_ids)
                if out.finished:
                    self._streams.pop(out.request_id, None)
                    if out.error is not None:
                        self.stats.failed += 1
                    else:
                        self.stats.finished += 1
                if stream is not None:
                    # a request that failed alone: its error, a 400 where nothing was sent yet
                    stream._put(BadRequest(out.error) if out.error is not None else out)

    def _fail_all(self, exc: Exception) -> None:
        with self._lock:
            streams, self._streams = self._streams, {}
            self.stats.failed += len(streams)
        for request_id, stream in streams.items():
            self.engine.cancel(request_id)
            # one exception object per stream: threads re-raising a shared one would splice
            # their tracebacks into each other's
            failure = RuntimeError(f"engine step failed: {type(exc).__name__}: {exc}")
            failure.__cause__ = exc
            stream._put(failure)
