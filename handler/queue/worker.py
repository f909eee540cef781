"""`QueueWorker`: the SQS polling loop (receive, run, delete or give back, heartbeat, drain).

Contract (configured by `QueueConfig`):
- `poll_once()` long-polls for up to `MAX_RECEIVE` messages while fewer than `max_in_flight` are
  held; each job starts at once (`JobRunner.start`) and is collected on its own thread.
- A message is deleted only after its job's result is durably written, or when the job's result
  already exists (idempotent by job id). An invalid job, or one that cannot start or fails, is
  given back: visible again after `retry_delay_s`, so the redrive policy sends it to the DLQ.
- `stop()` (safe from a signal handler) ends `run()`: it stops receiving, lets held jobs finish
  for up to `drain_timeout_s`, then abandons the rest and gives their messages back at once.
- SQS errors never kill the loop or the heartbeat: they are logged and retried.
"""

from __future__ import annotations

import argparse
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, fields
from typing import Any

from snapfn.handler.queue.inflight import Heartbeat, InFlight
from snapfn.handler.queue.jobs import Message, parse_job
from snapfn.handler.queue.runner import JobRunner, Log, RunningJob, one_line, stderr_log
from snapfn.snapshot.errors import BadRequest

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
            self._give_back(message, f"job {job.id} cannot start: {one_line(exc)}")
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
                    self._give_back(message, f"job {running.job.id} failed: {one_line(exc)}")
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
            self.log(f"receive failed: {one_line(box.exception())}; retrying in 1 s")
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
                self.log(f"delete of {message.message_id} failed: {one_line(exc)}")

    def _release(self, messages: list[Message], visibility_s: int) -> None:
        for message in messages:
            try:
                self.sqs.change_message_visibility(
                    QueueUrl=self.config.queue_url,
                    ReceiptHandle=message.receipt_handle,
                    VisibilityTimeout=visibility_s,
                )
            except Exception as exc:  # it reappears after its visibility timeout anyway
                self.log(f"release of {message.message_id} failed: {one_line(exc)}")

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
                self.log(f"heartbeat failed: {one_line(exc)}")
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
            self.log(f"cannot read the queue's attributes: {one_line(exc)}")
            return
        if "RedrivePolicy" not in attrs:
            self.log("WARNING: the queue has no redrive policy: failing jobs are retried forever")
