"""A real local AWS endpoint for tests: moto in server mode on a free loopback port.

boto3 talks to it unmodified through `endpoint_url`, with fake credentials. Every boto3 client
the tests make (in process or in a worker subprocess) reaches the same server, so queues,
buckets and their state are shared like a real account's.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

FAKE_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


@contextlib.contextmanager
def fake_aws(*buckets: str) -> Iterator[MotoServer]:
    """A MotoServer with FAKE_AWS_ENV set in the environment (and `buckets` created), for a
    module-scoped fixture: `with fake_aws("b") as aws: yield aws`."""
    import pytest

    with pytest.MonkeyPatch.context() as env:
        for name, value in FAKE_AWS_ENV.items():
            env.setenv(name, value)
        with MotoServer() as server:
            for bucket in buckets:
                server.client("s3").create_bucket(Bucket=bucket)
            yield server


class MotoServer:
    """`with MotoServer() as aws:` — moto on 127.0.0.1:<free port>, stopped on exit."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.endpoint_url = ""

    def __enter__(self) -> MotoServer:
        # NOTE: moto's server logs every request through werkzeug; tests only want failures.
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint_url = f"http://{host}:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop()

    def client(self, service: str) -> Any:
        import boto3

        return boto3.client(
            service,
            endpoint_url=self.endpoint_url,
            region_name=FAKE_AWS_ENV["AWS_DEFAULT_REGION"],
            aws_access_key_id=FAKE_AWS_ENV["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=FAKE_AWS_ENV["AWS_SECRET_ACCESS_KEY"],
        )


def make_queue(
    sqs: Any, name: str, visibility_s: int = 30, max_receive_count: int | None = None
) -> tuple[str, str | None]:
    """Create a queue (and a DLQ with a redrive policy when `max_receive_count` is set)."""
    attributes = {"VisibilityTimeout": str(visibility_s)}
    dlq_url = None
    if max_receive_count is not None:
        dlq_url = sqs.create_queue(QueueName=f"{name}-dlq")["QueueUrl"]
        dlq_arn = sqs.get_queue_attributes(QueueUrl=dlq_url, AttributeNames=["QueueArn"])
        policy = {
            "deadLetterTargetArn": dlq_arn["Attributes"]["QueueArn"],
            "maxReceiveCount": str(max_receive_count),
        }
        attributes["RedrivePolicy"] = json.dumps(policy)
    url = sqs.create_queue(QueueName=name, Attributes=attributes)["QueueUrl"]
    return url, dlq_url


def queue_counts(sqs: Any, url: str) -> tuple[int, int]:
    """(visible, in flight) message counts of a queue, as two reads in a row agree.

    NOTE: moto takes the two counts at two instants; a read made as a message's visibility
    timeout ends can count it in neither ((0, 0) with the message still there)."""
    names = ["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"]

    def read() -> tuple[int, int]:
        attrs = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=names)["Attributes"]
        return int(attrs[names[0]]), int(attrs[names[1]])

    counts, last = read(), None
    while counts != last:
        counts, last = read(), counts
    return counts


def wait_for(
    predicate: Callable[[], Any], timeout_s: float, what: str | Callable[[], str], step_s=0.1
):
    """Poll `predicate` until it returns something truthy; fail the test after `timeout_s`.

    `what` names what is awaited; a callable is called on failure (to show the state then).
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step_s)
    raise AssertionError(
        f"timed out after {timeout_s} s waiting for {what() if callable(what) else what}"
    )
