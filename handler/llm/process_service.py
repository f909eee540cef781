"""ProcessLLMService: an LLMService whose engine runs in a restored process-snapshot worker.

Front doors use it exactly like LLMService (`submit` → a stream of RequestOutput, `tokenizer`,
`max_req_input_len`, `kv_usage`, `stats`, `close`); requests and outputs cross the worker's
channel as JSON (see process_host.py). The tokenizer is loaded here too, from the snapshot's
model folder, so prompts are encoded without a round trip. No torch import.
"""

from __future__ import annotations

import dataclasses
import queue
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from snapfn.snapshot.errors import BadRequest, SnapfnError

from ..process_client import ProcessClient
from .engine.request import GenerationResult, RequestOutput, SamplingParams
from .service_stats import ServiceStats

INFO_TIMEOUT_S = 10.0


class WorkerError(SnapfnError):
    """The worker failed a request it had accepted, or exited."""

    code = "worker_error"


class RemoteStream:
    """The outputs of one request in the worker, in order (LLMService's Stream, remotely)."""

    def __init__(
        self,
        service: ProcessLLMService,
        rid: int,
        replies: queue.Queue,
        accepted: dict,
        prompt_ids: list[int],
    ) -> None:
        self.request_id = accepted["request_id"]
        self.prompt_ids = prompt_ids
        self.submitted_at = time.perf_counter()
        self.first_token_at: float | None = None
        self._service, self._rid, self._replies = service, rid, replies
        self._done = False

    def __iter__(self) -> Iterator[RequestOutput]:
        return self._iter_until(None)

    def _iter_until(self, deadline: float | None) -> Iterator[RequestOutput]:
        while not self._done:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                message = self._replies.get(timeout=wait)
            except queue.Empty:
                self.cancel()
                raise TimeoutError(f"request {self.request_id} did not finish in time") from None
            if message["event"] == "error":
                self._finish()
                raise WorkerError(message["message"])
            out = RequestOutput(
                self.request_id,
                tuple(message["tokens"]),
                tuple(message["logprobs"]),
                message["text"],
                message["finished"],
                message["reason"],
            )
            if self.first_token_at is None:
                self.first_token_at = time.perf_counter()
            if out.finished:
                self._finish()
                self._service.stats.finished += 1
            self._service.stats.generated_tokens += len(out.new_token_ids)
            yield out

    def result(self, timeout_s: float | None = None) -> GenerationResult:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        outs = list(self._iter_until(deadline))
        return GenerationResult(
            self.request_id,
            tuple(self.prompt_ids),
            tuple(t for o in outs for t in o.new_token_ids),
            tuple(lp for o in outs for lp in o.new_logprobs),
            "".join(o.text_delta for o in outs),
            (outs[-1].finish_reason if outs else None) or "unknown",
        )

    def cancel(self) -> None:
        if not self._done:
            self._finish()
            self._service.stats.cancelled += 1
            self._service.client.notify({"op": "cancel", "request_id": self.request_id})

    def _finish(self) -> None:
        self._done = True
        self._service.client.forget(self._rid)


def load_tokenizer(model_dir: Path):
    from .tokenizer import Tokenizer

    folder = Path(model_dir)
    return Tokenizer.from_dir(folder) if (folder / "tokenizer.json").is_file() else None


class ProcessLLMService:
    def __init__(self, client: ProcessClient, tokenizer: Any) -> None:
        """`tokenizer`: the model's (`load_tokenizer`), or None for a model without one."""
        self.client = client
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
        replies = self.client.request({"op": "info"})
        try:
            message = replies.get(timeout=INFO_TIMEOUT_S)
        except queue.Empty:
            raise WorkerError(
                f"the worker did not answer 'info' within {INFO_TIMEOUT_S} s"
            ) from None
        if message["event"] == "error":
            raise WorkerError(message["message"])
        return message

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> RemoteStream:
        """Queue a request in the worker; BadRequest (the worker's message) if it refused it."""
        wire = dataclasses.asdict(params)
        replies = self.client.request(
            {"op": "generate", "prompt_ids": list(prompt_ids), "params": wire}
        )
        first = replies.get()
        if first["event"] == "error":
            if first.get("code") == BadRequest.code:
                raise BadRequest(first["message"])
            raise WorkerError(first["message"])
        self.stats.requests += 1
        self.stats.prompt_tokens += len(prompt_ids)
        return RemoteStream(self, first["id"], replies, first, list(prompt_ids))

    def generate(
        self, prompt_ids: list[int], params: SamplingParams, timeout_s: float | None = None
    ) -> GenerationResult:
        return self.submit(prompt_ids, params).result(timeout_s)

    def cancel(self, request_id: str) -> None:
        self.client.notify({"op": "cancel", "request_id": request_id})

    def kv_usage(self) -> float:
        return float(self.info()["kv_usage"])

    def close(self, timeout_s: float = 5.0) -> None:
        self.client.close()
