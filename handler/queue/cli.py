"""`snapfn worker`: run batch jobs from an SQS queue (and the Lambda-style SQS batch handler).

    snapfn worker --queue-url URL [--endpoint-url URL] [--region R]
                  [--model DIR | --snapshot DIR | --function module:fn]

One message is one job (wire format and result document: `jobs`). The worker:
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
  rest (visibility 0) and exits 0;
- once its runtime stops after it was up (a function's handler overran its time limit and may
  still be running, a restored worker process died), drains the same way and exits 2 naming
  the reason (`RuntimeStopped`), for its supervisor (ECS, Kubernetes) to start a fresh one. The
  job that overran was given back like any failed job (visible again after `retry_delay_s`,
  counted by the redrive policy); those refused meanwhile too.

`handle_sqs_batch(event, context, runner=...)` runs the same jobs for an SQS event (`Records`,
as Lambda delivers it) and returns `{"batchItemFailures": [{"itemIdentifier": messageId}]}`:
the event source deletes the others.

This module is the command: its flags (the target and engine flags are `function/target_flags`', shared with
`snapfn serve`), the boto3 clients, signals, and the wait for the runtime before polling.
The parts: `worker` (the polling loop, `QueueConfig`), `inflight` (held messages,
heartbeat), `jobs` (wire format), `runner` (running jobs, the Lambda path),
`results` (idempotent result writes).
"""

from __future__ import annotations

import argparse
import signal
import threading
import time
from typing import Any
from urllib.parse import urlparse

from snapfn.handler.function.target_flags import (
    add_engine_arguments,
    add_target_arguments,
    serve_target,
)
from snapfn.handler.queue.results import ResultStore
from snapfn.handler.queue.runner import JobRunner, stderr_log
from snapfn.handler.queue.worker import QueueConfig, QueueWorker
from snapfn.snapshot.errors import InitFailed


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
    add_target_arguments(p, "run")
    add_engine_arguments(p)


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
        threading.Thread(
            target=_stop_when_runtime_stops,
            args=(runtime, worker),
            name="snapfn-runtime-watch",
            daemon=True,
        ).start()
        code = worker.run()
        if runtime.stopped:  # NOTE: read before the close below, which stops it too
            raise _runtime_stopped(runtime)
        return code
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        runtime.close()


def _start_runtime(args: argparse.Namespace) -> Any:
    from snapfn.handler.function.runtime import WorkerRuntime

    runtime = WorkerRuntime(serve_target(args), log=stderr_log)
    runtime.start(background=True)
    return runtime


def _stop_when_runtime_stops(runtime: Any, worker: QueueWorker) -> None:
    """Once the runtime stopped (it serves nothing more): stop the worker, as SIGTERM does."""
    runtime.wait_stopped()
    if worker.stopping:
        return  # stopping already (SIGTERM), or closed after the drain
    stderr_log(f"the runtime stopped ({runtime.readiness.reason}): draining, then exiting")
    worker.stop()


def _runtime_stopped(runtime: Any) -> InitFailed:
    from snapfn.handler.function.runtime import RuntimeStopped

    return RuntimeStopped(
        f"{runtime.function_name} stopped: {runtime.readiness.reason}; start a fresh worker"
    )


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
