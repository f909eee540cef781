"""ProcessLLMService: an LLMService whose engine runs in a restored process-snapshot worker.

Front doors use it exactly like LLMService (`submit` → a stream of RequestOutput, `tokenizer`,
`max_req_input_len`, `kv_usage`, `stats`, `close`); requests and outputs cross the worker's
channel as JSON (see process_host.py). The tokenizer is loaded here too, from the snapshot's
model folder, so prompts are encoded without a round trip. No torch import.
"""

from __future__ import annotations

import queue
import time
from typing import Any

from snapfn.handler.llm.engine.request import GenerationResult, RequestOutput, SamplingParams
from snapfn.handler.llm.stream import ServiceStats, Stream
from snapfn.snapshot.errors import BadRequest, SnapfnError
from snapfn.snapshot.process.client import ProcessClient

INFO_TIMEOUT_S = 10.0


class WorkerError(SnapfnError):
    """The worker failed a request it had accepted, or exited."""

    code = "worker_error"


class RemoteStream(Stream):
    """The outputs of one request in the worker, in order: an LLMService Stream whose items
    arrive as the worker's messages (routed by the ProcessClient to `replies`)."""

    def __init__(
        self,
        service: ProcessLLMService,
        rid: int,
        replies: queue.Queue,
        request_id: str,
        prompt_ids: list[int],
    ) -> None:
        super().__init__(service, request_id, prompt_ids)
        self._rid, self._replies = rid, replies

    def _take(self, timeout_s: float | None) -> RequestOutput:
        message = self._replies.get(timeout=timeout_s)
        if message["event"] == "error":
            raise WorkerError(message["message"])
        out = RequestOutput(
            self.request_id,
            tuple(message["tokens"]),
            tuple(message["logprobs"]),
            message["text"],
            message["finished"],
            message["reason"],
            new_top_logprobs=tuple(_top(t) for t in message.get("top", ())),
            prompt_logprobs=tuple(message.get("prompt_logprobs", ())),
            prompt_top_logprobs=tuple(
                None if t is None else _top(t) for t in message.get("prompt_top", ())
            ),
        )
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        stats = self._service.stats
        stats.generated_tokens += len(out.new_token_ids)
        stats.finished += out.finished
        return out

    def _on_done(self) -> None:
        self._service.client.forget(self._rid)


class ProcessLLMService:
    def __init__(self, client: ProcessClient, tokenizer: Any) -> None:
        """`tokenizer`: the model's (`load_tokenizer`), or None for a model without one."""
        self.client = client
        self.on_close = None  # run after the worker was closed (several ranks: the others')
        self.stats = ServiceStats()
        self._tokenizer = tokenizer
        self._max_req_input_len = int(self.info()["max_req_input_len"])

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def max_req_input_len(self) -> int:
        return self._max_req_input_len

    def info(self) -> dict[str, Any]:
        message = self.client.call({"op": "info"}, INFO_TIMEOUT_S)
        if message is None:
            raise WorkerError(f"the worker did not answer 'info' within {INFO_TIMEOUT_S} s")
        if message["event"] == "error":
            raise WorkerError(message["message"])
        return message

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> RemoteStream:
        """Queue a request in the worker; BadRequest (the worker's message) if it refused it."""
        wire = params.to_json()
        replies = self.client.request(
            {"op": "generate", "prompt_ids": list(prompt_ids), "params": wire}
        )
        first = replies.get()
        if first["event"] == "error":
            self.client.forget(first["id"])
            if first.get("code") == BadRequest.code:
                raise BadRequest(first["message"])
            raise WorkerError(first["message"])
        self.stats.requests += 1
        self.stats.prompt_tokens += len(prompt_ids)
        return RemoteStream(self, first["id"], replies, first["request_id"], list(prompt_ids))

    def generate(
        self, prompt_ids: list[int], params: SamplingParams, timeout_s: float | None = None
    ) -> GenerationResult:
        return self.submit(prompt_ids, params).result(timeout_s)

    def cancel(self, request_id: str) -> None:
        self.stats.cancelled += 1
        self.client.notify({"op": "cancel", "request_id": request_id})

    def kv_usage(self) -> float:
        return float(self.info()["kv_usage"])

    def prefix_cache_stats(self) -> dict[str, int] | None:
        return self.info().get("prefix_cache")

    def spec_stats(self) -> dict[str, float] | None:
        return self.info().get("speculative")

    def preemptions(self) -> int:
        return int(self.info().get("preemptions", 0))

    def close(self, timeout_s: float = 5.0) -> None:
        self.client.close()
        if self.on_close is not None:
            self.on_close()


def _top(pairs) -> tuple[tuple[int, float], ...]:
    """One token's (token id, logprob) alternatives as the engine gives them."""
    return tuple((int(token), float(logprob)) for token, logprob in pairs)
