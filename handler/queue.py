"""`snapfn worker`: run batch jobs from an SQS queue (and the Lambda-style SQS batch handler).

    snapfn worker --queue-url URL [--endpoint-url URL] [--region R]
                  [--model DIR | --snapshot DIR | --function module:fn]

One message is one job (wire format and result document: `queue_jobs`). The worker:
- long-polls (`WaitTimeSeconds` 20) for up to 10 messages at a time, holding at most
  `max_in_flight`; every prompt of every held job is submitted to the LLMService as soon as the
  message arrives, so jobs batch together in the engine (continuous batching across messages);
- extends the visibility of every held message on a heartbeat thread (every third of the
  visibility timeout), so a job longer than the timeout is not delivered twice;
- deletes a message only after its result is durably written (S3 put or reply send succeeded);
- never deletes a message it could not finish: an unparseable or invalid job, or one that
  failed, is made visible again after `retry_delay_s`, and the queue's redrive policy moves it to
  the dead-letter queue after `maxReceiveCount` receives;
- is idempotent by job id: a job whose result exists (or that this worker wrote) is deleted
  without running; S3 results are written create-only, so a redelivery never replaces one;
- on SIGTERM stops receiving, lets held jobs finish (up to `drain_timeout_s`), gives back the
  rest (visibility 0) and exits 0.

`handle_sqs_batch(event, context, runner=...)` runs the same jobs for an SQS event (`Records`,
as Lambda delivers it) and returns `{"batchItemFailures": [{"itemIdentifier": messageId}]}`:
the event source deletes the others.
"""

from __future__ import annotations

import argparse
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from snapfn.snapshot.errors import BadRequest, InitFailed

from .queue_jobs import JobRunner, Log, ResultStore, RunningJob, parse_job, stderr_log

MAX_RECEIVE = 10  # SQS's limit per ReceiveMessage


@dataclass(frozen=True)
class QueueConfig:
    """How the worker polls. CLI defaults come from here."""

    queue_url: str
    endpoint_url: str | None = None  # SQS (and S3, unless s3_endpoint_url) endpoint override
    s3_endpoint_url: str | None = None
    region: str | None = None  # None: the queue URL's region, else boto3's (AWS_REGION, …)
    wait_time_s: int = 20  # long polling
    max_in_flight: int = 10  # messages held at once
    visibility_timeout_s: int = 60  # set on receive and renewed by the heartbeat
    heartbeat_s: float = 0.0  # 0: a third of the visibility timeout
    retry_delay_s: int = 10  # visibility after a failed attempt, before the next receive
    job_timeout_s: float = 900.0
    drain_timeout_s: float = 25.0
    startup_timeout_s: float = 600.0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> QueueConfig:
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        return cls(**values).validate()

    def validate(self) -> QueueConfig:
        checks = [
            (0 <= self.wait_time_s <= 20, "wait_time_s must be in [0, 20]"),
            (self.max_in_flight >= 1, "max_in_flight must be >= 1"),
            (1 <= self.visibility_timeout_s <= 43200, "visibility_timeout_s must be in [1, 43200]"),
            (self.heartbeat_interval_s < self.visibility_timeout_s, "heartbeat_s must be shorter"),
            (0 <= self.retry_delay_s <= 43200, "retry_delay_s must be in [0, 43200]"),
        ]
        for ok, message in checks:
            if not ok:
                raise BadRequest(message)
        return self

    @property
    def heartbeat_interval_s(self) -> float:
        return self.heartbeat_s or self.visibility_timeout_s / 3


@dataclass(frozen=True)
class Message:
    """One received SQS message, from ReceiveMessage or from a Lambda SQS event record."""

    message_id: str
    receipt_handle: str
    body: str
    receive_count: int

    @classmethod
    def from_sqs(cls, raw: dict[str, Any]) -> Message:
        count = raw.get("Attributes", {}).get("ApproximateReceiveCount", "0")
        return cls(raw["MessageId"], raw["ReceiptHandle"], raw.get("Body", ""), int(count))

    @classmethod
    def from_record(cls, raw: dict[str, Any]) -> Message:
        count = raw.get("attributes", {}).get("ApproximateReceiveCount", "0")
        return cls(raw["messageId"], raw.get("receiptHandle", ""), raw.get("body", ""), int(count))


class InFlight:
    """Jobs this worker runs, each with the messages carrying it (a redelivery joins its job)."""

    def __init__(self) -> None:
        self._jobs: dict[str, tuple[RunningJob, list[Message]]] = {}
        self._num_settling = 0  # jobs whose messages are being deleted or given back
        self._changed = threading.Condition()

    def add(self, running: RunningJob, message: Message) -> None:
        with self._changed:
            self._jobs[running.job.id] = (running, [message])

    def attach(self, job_id: str, message: Message) -> bool:
        with self._changed:
            if job_id not in self._jobs:
                return False
            self._jobs[job_id][1].append(message)
            return True

    @contextmanager
    def settling(self, job_id: str) -> Iterator[list[Message]]:
        """Take the job's messages out (no more join it) and count it until they are settled."""
        with self._changed:
            _, messages = self._jobs.pop(job_id, (None, []))
            self._num_settling += 1
        try:
            yield messages  # deleted or given back by the caller meanwhile
        finally:
            with self._changed:
                self._num_settling -= 1
                self._changed.notify_all()

    def pop_all(self) -> list[tuple[RunningJob, list[Message]]]:
        with self._changed:
            jobs, self._jobs = list(self._jobs.values()), {}
            self._changed.notify_all()
            return jobs

    def messages(self) -> list[Message]:
        with self._changed:
            return [m for _, messages in self._jobs.values() for m in messages]

    def wait_for_room(self, max_messages: int, timeout_s: float) -> int:
        """Block until fewer than `max_messages` are held (or the timeout); return the room."""
        with self._changed:
            self._changed.wait_for(lambda: self._count() < max_messages, timeout_s)
            return max(0, max_messages - self._count())

    def wait_empty(self, timeout_s: float) -> bool:
        with self._changed:
            return self._changed.wait_for(
                lambda: not self._jobs and not self._num_settling, timeout_s
            )

    def _count(self) -> int:
        return sum(len(messages) for _, messages in self._jobs.values())


class Heartbeat:
    """Calls `extend(held())` every `interval_s` on its own thread while held() is non-empty."""

    def __init__(
        self,
        extend: Callable[[list[Message]], None],
        held: Callable[[], list[Message]],
        interval_s: float,
    ) -> None:
        self._extend, self._held, self.interval_s = extend, held, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="snapfn-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            messages = self._held()
            if messages:
                self._extend(messages)


class QueueWorker:
    """Polls one queue and runs its jobs; `run()` until `stop()` (SIGTERM), then drains."""

    def __init__(self, config: QueueConfig, runner: JobRunner, sqs: Any, log: Log = stderr_log):
        self.config = config
        self.runner = runner
        self.sqs = sqs
        self.log = log
        self._in_flight = InFlight()
        self._stopping = threading.Event()
        self._heartbeat = Heartbeat(
            self._extend, self._in_flight.messages, config.heartbeat_interval_s
        )

    def stop(self) -> None:
        """Ask `run()` to stop receiving and drain (safe from a signal handler)."""
        self._stopping.set()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    @property
    def num_held(self) -> int:
        return len(self._in_flight.messages())

    def run(self) -> int:
        """Receive and run jobs until stopped; then drain. Returns the exit status (0)."""
        self._warn_without_redrive()
        self._heartbeat.start()
        self.log(f"polling {self.config.queue_url}")
        try:
            while not self._stopping.is_set():
                self.poll_once()
        finally:
            self._drain()
            self._heartbeat.stop()
        return 0

    def poll_once(self) -> int:
        """Receive one batch (as room allows) and start its jobs; returns how many arrived."""
        room = self._in_flight.wait_for_room(self.config.max_in_flight, timeout_s=1.0)
        if room == 0 or self._stopping.is_set():
            return 0
        messages = self._receive_unless_stopped(min(room, MAX_RECEIVE))
        for message in messages:
            self._accept(message)
        if messages:
            self.log(f"holding {self.num_held} messages")
        return len(messages)

    # ---- one message --------------------------------------------------------------------------
    def _accept(self, message: Message) -> None:
        try:
            job = parse_job(message.body)
        except BadRequest as exc:
            self._give_back(message, f"invalid job: {exc}")
            return
        if self._in_flight.attach(job.id, message):
            self.log(f"job {job.id}: delivered again while it runs here; both messages join it")
            return
        try:
            if self.runner.is_done(job):
                self.log(f"job {job.id}: result already written; deleting the message")
                self._delete([message])
                return
            running = self.runner.start(job)
        except Exception as exc:
            self._give_back(message, f"job {job.id} cannot start: {_one_line(exc)}")
            return
        self._in_flight.add(running, message)
        name = f"snapfn-job-{job.id}"
        threading.Thread(target=self._complete, args=(running,), name=name, daemon=True).start()

    def _complete(self, running: RunningJob) -> None:
        """Collecting thread: wait, write the result, then (and only then) delete the messages."""
        deadline = time.monotonic() + self.config.job_timeout_s
        try:
            finished = self.runner.finish(running, deadline)
        except Exception as exc:
            with self._in_flight.settling(running.job.id) as messages:
                for message in messages:
                    self._give_back(message, f"job {running.job.id} failed: {_one_line(exc)}")
            return
        with self._in_flight.settling(running.job.id) as messages:
            if finished:
                self._delete(messages)

    def _give_back(self, message: Message, reason: str) -> None:
        """Not deleted: visible again after retry_delay_s; the redrive policy decides the DLQ."""
        self.log(
            f"message {message.message_id} (receive #{message.receive_count}): {reason}; "
            f"retry in {self.config.retry_delay_s} s, the redrive policy sends it to the DLQ"
        )
        self._release([message], self.config.retry_delay_s)

    # ---- SQS calls ----------------------------------------------------------------------------
    def _receive_unless_stopped(self, max_messages: int) -> list[Message]:
        """Long-poll on a side thread, so stop() need not wait out the poll.

        NOTE: messages that arrive after stop() are given back at once (visibility 0); if the
        process has exited by then, they reappear after their visibility timeout instead.
        """
        box: Future[list[Message]] = Future()
        arrived = threading.Event()
        box.add_done_callback(lambda _: arrived.set())
        args = (box, max_messages)
        threading.Thread(
            target=self._receive_into, args=args, name="snapfn-receive", daemon=True
        ).start()
        while not arrived.wait(0.2):
            if self._stopping.is_set():
                box.add_done_callback(self._give_back_late)
                return []
        if box.exception() is not None:
            self.log(f"receive failed: {_one_line(box.exception())}; retrying in 1 s")
            self._stopping.wait(1.0)
            return []
        return box.result()

    def _receive_into(self, box: Future, max_messages: int) -> None:
        try:
            response = self.sqs.receive_message(
                QueueUrl=self.config.queue_url,
                MaxNumberOfMessages=max_messages,
                WaitTimeSeconds=self.config.wait_time_s,
                VisibilityTimeout=self.config.visibility_timeout_s,
                MessageSystemAttributeNames=["ApproximateReceiveCount"],
            )
            box.set_result([Message.from_sqs(m) for m in response.get("Messages", [])])
        except Exception as exc:
            box.set_exception(exc)

    def _give_back_late(self, box: Future) -> None:
        if box.exception() is None and box.result():
            self._release(box.result(), 0)

    def _delete(self, messages: list[Message]) -> None:
        for message in messages:
            try:
                self.sqs.delete_message(
                    QueueUrl=self.config.queue_url, ReceiptHandle=message.receipt_handle
                )
            except Exception as exc:  # the job is done; a redelivery is found already written
                self.log(f"delete of {message.message_id} failed: {_one_line(exc)}")

    def _release(self, messages: list[Message], visibility_s: int) -> None:
        for message in messages:
            try:
                self.sqs.change_message_visibility(
                    QueueUrl=self.config.queue_url,
                    ReceiptHandle=message.receipt_handle,
                    VisibilityTimeout=visibility_s,
                )
            except Exception as exc:  # it reappears after its visibility timeout anyway
                self.log(f"release of {message.message_id} failed: {_one_line(exc)}")

    def _extend(self, messages: list[Message]) -> None:
        for start in range(0, len(messages), MAX_RECEIVE):
            chunk = messages[start : start + MAX_RECEIVE]
            entries = [
                {
                    "Id": str(i),
                    "ReceiptHandle": m.receipt_handle,
                    "VisibilityTimeout": self.config.visibility_timeout_s,
                }
                for i, m in enumerate(chunk)
            ]
            try:
                response = self.sqs.change_message_visibility_batch(
                    QueueUrl=self.config.queue_url, Entries=entries
                )
            except Exception as exc:  # never let the heartbeat thread die
                self.log(f"heartbeat failed: {_one_line(exc)}")
                continue
            for failed in response.get("Failed", []):
                self.log(
                    f"heartbeat: {chunk[int(failed['Id'])].message_id}: {failed.get('Message')}"
                )

    # ---- start and stop -----------------------------------------------------------------------
    def _drain(self) -> None:
        self.log(f"draining: {self.num_held} messages held")
        if self._in_flight.wait_empty(self.config.drain_timeout_s):
            return
        for running, messages in self._in_flight.pop_all():
            running.abandon()
            self.log(f"job {running.job.id}: unfinished at drain timeout; giving it back")
            self._release(messages, 0)

    def _warn_without_redrive(self) -> None:
        try:
            attrs = self.sqs.get_queue_attributes(
                QueueUrl=self.config.queue_url, AttributeNames=["RedrivePolicy"]
            ).get("Attributes", {})
        except Exception as exc:
            self.log(f"cannot read the queue's attributes: {_one_line(exc)}")
            return
        if "RedrivePolicy" not in attrs:
            self.log("WARNING: the queue has no redrive policy: failing jobs are retried forever")


# ---- Lambda-style path --------------------------------------------------------------------------
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
            runner.log(f"message {message.message_id}: {_one_line(exc)}")
            failures.append(message.message_id)
    for running, message_ids in started.values():
        try:
            runner.finish(running, deadline)
        except Exception as exc:
            runner.log(f"job {running.job.id} failed: {_one_line(exc)}")
            failures += message_ids
    return {"batchItemFailures": [{"itemIdentifier": m} for m in failures]}


def _deadline(context: Any, default_s: float = 900.0, margin_s: float = 1.0) -> float:
    remaining = getattr(context, "get_remaining_time_in_millis", None)
    budget_s = default_s if remaining is None else remaining() / 1000 - margin_s
    return time.monotonic() + max(0.0, budget_s)


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0]


# ---- command line -------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    d = QueueConfig(queue_url="")
    queue = p.add_argument_group("queue")
    queue.add_argument("--queue-url", required=True, help="the SQS queue to consume")
    queue.add_argument("--endpoint-url", help="SQS endpoint (e.g. a local emulator)")
    queue.add_argument("--s3-endpoint-url", help="S3 endpoint (default: --endpoint-url)")
    queue.add_argument("--region", help="AWS region (default: the queue URL's, else boto3's)")
    queue.add_argument("--wait-time-s", type=int, default=d.wait_time_s, help="long poll")
    queue.add_argument("--max-in-flight", type=int, default=d.max_in_flight, help="jobs held")
    queue.add_argument("--visibility-timeout-s", type=int, default=d.visibility_timeout_s)
    queue.add_argument("--heartbeat-s", type=float, default=d.heartbeat_s, help="0: visibility/3")
    queue.add_argument("--retry-delay-s", type=int, default=d.retry_delay_s)
    queue.add_argument("--job-timeout-s", type=float, default=d.job_timeout_s)
    queue.add_argument("--drain-timeout-s", type=float, default=d.drain_timeout_s)
    queue.add_argument("--startup-timeout-s", type=float, default=d.startup_timeout_s)
    # the same target flags as `snapfn serve`, read by the same `serve_target`
    what = p.add_argument_group("what to run (default: the embedded model)")
    what.add_argument("--model", type=Path, help="HF model folder (cold init, or fallback)")
    what.add_argument("--snapshot", type=Path, help="restore from this snapshot folder")
    what.add_argument("--function", help="run a user function, module:function")
    what.add_argument("--function-dir", type=Path, help="folder searched first for its module")
    engine = p.add_argument_group("engine (llm)")
    engine.add_argument("--device", help="cpu or cuda[:N] (default: SNAPFN_DEVICE or cpu)")
    engine.add_argument("--dtype", help="auto, float32, bfloat16 or float16")
    engine.add_argument("--max-model-len", type=int, help="longest sequence served")
    engine.add_argument("--max-running-requests", type=int, help="decode batch limit")
    engine.add_argument("--kv-cache-mb", type=int, help="KV pool size on CPU, MiB")


def make_clients(config: QueueConfig) -> tuple[Any, Any]:
    """(sqs, s3) boto3 clients for `config` (boto3 imported here: `snapfn --help` stays fast)."""
    import boto3

    region = config.region or queue_region(config.queue_url)
    sqs = boto3.client("sqs", endpoint_url=config.endpoint_url, region_name=region)
    s3_endpoint = config.s3_endpoint_url or config.endpoint_url
    s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name=region)
    return sqs, s3


def queue_region(queue_url: str) -> str | None:
    """The region named in an AWS queue URL (`https://sqs.<region>.amazonaws.com/…`), or None."""
    parts = (urlparse(queue_url).hostname or "").split(".")
    if len(parts) >= 4 and parts[0] == "sqs" and parts[2] == "amazonaws":
        return parts[1]
    if len(parts) >= 4 and parts[1] == "queue" and parts[2] == "amazonaws":  # legacy form
        return parts[0]
    return None


def run(args: argparse.Namespace) -> int:
    config = QueueConfig.from_args(args)
    sqs, s3 = make_clients(config)
    runtime = _start_runtime(args)
    worker = QueueWorker(config, JobRunner(runtime, ResultStore(s3, sqs)), sqs)
    handlers = {
        s: signal.signal(s, lambda *_: worker.stop()) for s in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        if not _wait_ready(runtime, worker, config.startup_timeout_s):
            return 0  # stopped while starting
        return worker.run()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        runtime.close()


def _start_runtime(args: argparse.Namespace) -> Any:
    from .runtime import WorkerRuntime
    from .serve import serve_target

    runtime = WorkerRuntime(serve_target(args), log=stderr_log)
    runtime.start(background=True)
    return runtime


def _wait_ready(runtime: Any, worker: QueueWorker, timeout_s: float) -> bool:
    """Wait for UP; False if stopped first; InitFailed if it failed or timed out."""
    from snapfn.snapshot.stages import Readiness

    deadline = time.monotonic() + timeout_s
    while not worker.stopping:
        state = runtime.wait_ready(0.5)
        if state is Readiness.UP:
            return True
        if state is Readiness.FAILED or time.monotonic() > deadline:
            reason = getattr(runtime.readiness, "reason", "") or state.value
            raise InitFailed(f"the worker did not come up ({reason})")
    return False
