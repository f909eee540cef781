"""Running jobs: a job's work in the runtime, and the writing of its result.

Contract:
- `JobRunner.start(job)` submits the job's work at once (every prompt goes to the LLMService,
  so jobs held together batch together in the engine) and returns a `RunningJob`; a job that
  cannot run here (a prompt job on a function worker, text without a tokenizer) is BadRequest.
- `JobRunner.finish(running, deadline)` waits for the result document, writes it through the
  `ResultStore` and remembers the id (`is_done`); an abandoned job (drain) is not written.
- `handle_sqs_batch(event, context, runner=...)` runs an SQS event's jobs together (the Lambda
  path) and returns `{"batchItemFailures": [...]}` naming the messages to retry; the event
  source deletes the others.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from snapfn.handler.queue.jobs import Job, Message, Prompt, parse_job
from snapfn.handler.queue.results import ResultStore, describe, encode_document
from snapfn.snapshot.errors import BadRequest

Log = Callable[[str], None]


def stderr_log(line: str) -> None:
    print(f"[snapfn worker] {line}", file=sys.stderr, flush=True)


def one_line(exc: BaseException) -> str:
    """`Type: message`, first line only (for one-line log entries)."""
    return f"{type(exc).__name__}: {exc}".splitlines()[0]


# ---- a job's work in the runtime ---------------------------------------------------------------
class RunningJob:
    """A started job. `collect()` waits for it and returns its result document."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.abandoned = False

    def collect(self, deadline: float) -> dict[str, Any]:
        raise NotImplementedError

    def abandon(self) -> None:
        """Give the job up (drain, shutdown): its result must not be written."""
        self.abandoned = True


class PromptJob(RunningJob):
    """Every prompt of the job already submitted to the LLMService (batched with other jobs)."""

    def __init__(self, job: Job, streams: list) -> None:
        super().__init__(job)
        self.streams = streams

    def collect(self, deadline: float) -> dict[str, Any]:
        try:
            results = [s.result(max(0.0, deadline - time.monotonic())) for s in self.streams]
        except BaseException:
            self.abandon()
            raise
        outputs = [_output(i, r, self.job.include_logprobs) for i, r in enumerate(results)]
        return {"id": self.job.id, "status": "ok", "outputs": outputs}

    def abandon(self) -> None:
        super().abandon()
        for stream in self.streams:
            stream.cancel()


class EventJob(RunningJob):
    """A function event, invoked when collected (in the collecting thread)."""

    def __init__(self, job: Job, runtime: Any) -> None:
        super().__init__(job)
        self.runtime = runtime

    def collect(self, deadline: float) -> dict[str, Any]:
        timeout_s = max(0.001, deadline - time.monotonic())  # the Context needs a positive one
        output = self.runtime.invoke(self.job.event, timeout_s=timeout_s, request_id=self.job.id)
        return {"id": self.job.id, "status": "ok", "output": output}


def start_job(job: Job, runtime: Any) -> RunningJob:
    """Submit the job's prompts now (so held jobs batch together); BadRequest if it cannot run."""
    if job.event is not None:
        return EventJob(job, runtime)
    llm = getattr(runtime, "llm", None)
    if llm is None:
        raise BadRequest("this worker runs a function: send the job's input as 'event'")
    prompt_ids = [_encode(llm.tokenizer, p) for p in job.prompts]
    streams: list = []
    try:
        for index, ids in enumerate(prompt_ids):
            streams.append(llm.submit(ids, job.sampling(index)))
    except BaseException:
        for stream in streams:
            stream.cancel()
        raise
    return PromptJob(job, streams)


def _encode(tokenizer: Any, prompt: Prompt) -> list[int]:
    if isinstance(prompt, str):
        _require_tokenizer(tokenizer)
        return tokenizer.encode(prompt)
    if prompt and isinstance(prompt[0], dict):
        _require_tokenizer(tokenizer)
        text = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)
    return list(prompt)


def _require_tokenizer(tokenizer: Any) -> None:
    if tokenizer is None:
        raise BadRequest("this model has no tokenizer: send 'prompt_ids'")


def _output(index: int, result: Any, include_logprobs: bool) -> dict[str, Any]:
    out = {
        "index": index,
        "text": result.text,
        "token_ids": list(result.token_ids),
        "finish_reason": result.finish_reason,
        "prompt_tokens": len(result.prompt_ids),
        "completion_tokens": len(result.token_ids),
    }
    if include_logprobs:
        out["logprobs"] = list(result.logprobs)
    return out


# ---- writing results ----------------------------------------------------------------------
class RecentJobs:
    """Ids of jobs whose results this process wrote (bounded, oldest forgotten first)."""

    def __init__(self, max_ids: int = 4096) -> None:
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._max_ids = max_ids
        self._lock = threading.Lock()

    def add(self, job_id: str) -> None:
        with self._lock:
            self._ids[job_id] = None
            while len(self._ids) > self._max_ids:
                self._ids.popitem(last=False)

    def __contains__(self, job_id: str) -> bool:
        with self._lock:
            return job_id in self._ids


class JobRunner:
    """Starts jobs in a runtime and writes their results; shared by the worker and Lambda path."""

    def __init__(self, runtime: Any, store: ResultStore, log: Log = stderr_log) -> None:
        self.runtime = runtime
        self.store = store
        self.log = log
        self._written = RecentJobs()

    def is_done(self, job: Job) -> bool:
        return job.id in self._written or self.store.already_written(job)

    def start(self, job: Job) -> RunningJob:
        """Submit the job's work now (BadRequest if it cannot run here)."""
        return start_job(job, self.runtime)

    def finish(self, running: RunningJob, deadline: float) -> bool:
        """Collect the result and write it; False if the job was abandoned. Raises on failure."""
        document = running.collect(deadline)
        if running.abandoned:
            return False
        wrote = self.store.write(running.job, encode_document(document))
        self._written.add(running.job.id)
        kept = "written to" if wrote else "already in (first result kept)"
        self.log(f"job {running.job.id}: result {kept} {describe(running.job.result)}")
        return True


# ---- the Lambda-style path ------------------------------------------------------------------------
def handle_sqs_batch(event: dict[str, Any], context: Any, *, runner: JobRunner) -> dict[str, Any]:
    """Run an SQS event's jobs together; report the messages to retry (partial batch failure).

    Deletion is the event source's: it deletes every message not listed. `context` may be None;
    with `get_remaining_time_in_millis()` the jobs get what remains of its deadline.
    """
    deadline = _deadline(context)
    failures: list[str] = []
    started: dict[str, tuple[RunningJob, list[str]]] = {}
    for record in event.get("Records", []):
        message = Message.from_record(record)
        try:
            job = parse_job(message.body)
            if job.id in started:
                started[job.id][1].append(message.message_id)
            elif not runner.is_done(job):
                started[job.id] = (runner.start(job), [message.message_id])
        except Exception as exc:
            runner.log(f"message {message.message_id}: {one_line(exc)}")
            failures.append(message.message_id)
    for running, message_ids in started.values():
        try:
            runner.finish(running, deadline)
        except Exception as exc:
            runner.log(f"job {running.job.id} failed: {one_line(exc)}")
            failures += message_ids
    return {"batchItemFailures": [{"itemIdentifier": m} for m in failures]}


def _deadline(context: Any, default_s: float = 900.0, margin_s: float = 1.0) -> float:
    remaining = getattr(context, "get_remaining_time_in_millis", None)
    budget_s = default_s if remaining is None else remaining() / 1000 - margin_s
    return time.monotonic() + max(0.0, budget_s)
