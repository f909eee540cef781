"""Where job results go: written durably, at most once per job id, as canonical bytes.

Contract:
- `encode_document(document)` is the canonical JSON of a result document (sorted keys, no
  whitespace): equal documents give equal bytes, so a redelivered job writes the same bytes.
- `ResultStore.already_written(job)` asks S3 whether the job's result exists (a reply queue
  cannot be asked: False); `ResultStore.write(job, body)` writes it durably and says whether
  this call wrote it (True) or a first result was kept (False).
- S3 writes are create-only (`If-None-Match: *`); reply queues get one `send_message` (a FIFO
  reply queue deduplicates by job id). Any other error propagates: the job is retried.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from snapfn.handler.queue.jobs import Job, ReplyQueue, S3Result


def encode_document(document: dict[str, Any]) -> bytes:
    """Canonical bytes of a result document (equal documents give equal bytes)."""
    return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()


class ResultStore:
    """Writes each job's result document where the job asks, at most once per job id.

    S3: a create-only put (`If-None-Match: *`): the first write of a key wins and a later one
    gets 412 and is dropped (`write` returns False), so a key never holds two different results.
    Reply queues: one `send_message`; a FIFO reply queue deduplicates by job id within its
    5-minute window; a standard one is at-least-once (a rare duplicate is the same document).
    """

    def __init__(self, s3: Any, sqs: Any) -> None:
        self.s3 = s3
        self.sqs = sqs

    def already_written(self, job: Job) -> bool:
        """True if the job's S3 result exists (reply queues cannot be asked: False)."""
        if not isinstance(job.result, S3Result):
            return False
        try:
            self.s3.head_object(Bucket=job.result.bucket, Key=job.result.key)
        except Exception as exc:
            if _http_status(exc) == 404:
                return False
            raise
        return True

    def write(self, job: Job, body: bytes) -> bool:
        """Write durably; True if this call wrote it, False if a first result was kept."""
        if isinstance(job.result, ReplyQueue):
            self.sqs.send_message(**_reply_message(job.id, job.result.queue_url, body))
            return True
        try:
            self.s3.put_object(
                Bucket=job.result.bucket,
                Key=job.result.key,
                Body=body,
                ContentType="application/json",
                IfNoneMatch="*",
            )
        except Exception as exc:
            if _http_status(exc) == 412:  # PreconditionFailed: the first result stays
                return False
            raise
        return True


def describe(target: S3Result | ReplyQueue) -> str:
    if isinstance(target, S3Result):
        return f"s3://{target.bucket}/{target.key}"
    return target.queue_url


def _reply_message(job_id: str, queue_url: str, body: bytes) -> dict[str, Any]:
    message = {
        "QueueUrl": queue_url,
        "MessageBody": body.decode(),
        "MessageAttributes": {"job_id": {"DataType": "String", "StringValue": job_id}},
    }
    if queue_url.endswith(".fifo"):
        message["MessageGroupId"] = job_id
        message["MessageDeduplicationId"] = hashlib.sha256(job_id.encode()).hexdigest()
    return message


def _http_status(exc: BaseException) -> int | None:
    """The HTTP status of a botocore ClientError (None for anything else)."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None
    return response.get("ResponseMetadata", {}).get("HTTPStatusCode")
