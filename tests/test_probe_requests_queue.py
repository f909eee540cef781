"""Malformed queue jobs (`handler/queue/jobs.py`, `worker.py`): each one is refused as a
`BadRequest` saying what is wrong, and the worker gives its message back and keeps polling."""

from __future__ import annotations

import pytest

from snapfn.handler.queue.jobs import parse_job
from snapfn.handler.queue.runner import JobRunner
from snapfn.handler.queue.worker import QueueConfig, QueueWorker
from snapfn.snapshot.errors import BadRequest

RESULT = '"result": {"s3": "s3://b/k"}'
MALFORMED = [
    ("[" * 100_000 + "]" * 100_000, "not JSON"),  # nested past the decoder's recursion limit
    ('{"id": "a", "prompt": "x", "max_tokens": ' + "9" * 5000 + "}", "not JSON"),  # 5000 digits
    (
        '{"id": "a", "prompt": "x", "params": {"temperature": ' + "1" * 400 + "}, " + RESULT + "}",
        "params.temperature",
    ),
    (
        '{"id": "a", "prompt": "x", "params": {"top_p": -' + "1" * 400 + "}, " + RESULT + "}",
        "params.top_p",
    ),
    ('{"id": "a", "messages": [{"role": "user"}], ' + RESULT + "}", r"messages\[0\]"),
    (
        '{"id": "a", "messages": [{"role": "user", "content": "x"}, {"role": 5, "content": [1]}], '
        + RESULT
        + "}",
        r"messages\[1\]",
    ),
]


@pytest.mark.parametrize(("body", "says"), MALFORMED)
def test_malformed_job_bodies_are_bad_requests(body, says):
    with pytest.raises(BadRequest, match=says):
        parse_job(body)


class RecordingSqs:
    """Hands out `bodies` once, then nothing; records every message given back."""

    def __init__(self, bodies: list[str]) -> None:
        self.messages = [
            {"MessageId": f"m{i}", "ReceiptHandle": f"r{i}", "Body": body}
            for i, body in enumerate(bodies)
        ]
        self.given_back: list[tuple[str, int]] = []

    def receive_message(self, **kwargs):
        messages, self.messages = self.messages, []
        return {"Messages": messages}

    def change_message_visibility(self, ReceiptHandle, VisibilityTimeout, **kwargs):
        self.given_back.append((ReceiptHandle, VisibilityTimeout))


def test_a_worker_gives_every_malformed_job_back_and_keeps_polling():
    sqs = RecordingSqs([body for body, _ in MALFORMED])
    logs: list[str] = []
    config = QueueConfig(queue_url="q", wait_time_s=0, retry_delay_s=7)
    worker = QueueWorker(config, JobRunner(None, None, log=logs.append), sqs, log=logs.append)
    assert worker.poll_once() == len(MALFORMED)
    assert sqs.given_back == [(f"r{i}", 7) for i in range(len(MALFORMED))], logs
    assert worker.num_held == 0
    assert sum("invalid job" in line for line in logs) == len(MALFORMED), logs
    assert worker.poll_once() == 0  # the loop goes on
