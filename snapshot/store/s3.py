"""The S3 side of the snapshot store: where a snapshot lives, clients, ranged reads, progress.

A snapshot stored at `s3://BUCKET/PREFIX` is one object per file, `PREFIX/<relpath>`, and its
manifest at `PREFIX/manifest.json` (transfer.py writes it last and reads it first).
`S3Location.parse` reads such a URI; `make_s3_client` builds the boto3 client (endpoint from
the argument, else boto3's own `AWS_ENDPOINT_URL` / `AWS_ENDPOINT_URL_S3`); `read_range_into`
streams one ranged GET into a file with pwrite at its offset, hashing as it goes;
`TransferProgress` reports bytes and bytes/s through a log callable, at most once per interval.
Errors from S3 come back as one-line BadSnapshot refusals naming the snapshot (`s3_refusal`).

boto3 and botocore are imported inside the functions that need them: `snapfn --help` and the
front doors that never see an s3:// URI do not pay for them.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from snapfn.snapshot.errors import BadRequest, BadSnapshot, bad_snapshot
from snapfn.snapshot.stages import Log

S3_SCHEME = "s3://"
_BLOCK_BYTES = 1 << 20  # what one read of a GET body asks for
_MAX_ATTEMPTS = 3  # a ranged GET whose body breaks off is retried this many times in all


def is_s3_uri(value: object) -> bool:
    return isinstance(value, str) and value.startswith(S3_SCHEME)


@dataclass(frozen=True)
class S3Location:
    """`s3://bucket/prefix`: the bucket and the key prefix (no slash at either end)."""

    bucket: str
    prefix: str

    @classmethod
    def parse(cls, uri: str) -> S3Location:
        if not is_s3_uri(uri):
            raise BadRequest(f"{uri!r} is not an s3://bucket/prefix URI")
        bucket, _, prefix = uri[len(S3_SCHEME) :].partition("/")
        prefix = prefix.strip("/")
        if not bucket or "//" in prefix or any(p in (".", "..") for p in prefix.split("/")):
            raise BadRequest(f"{uri!r} is not an s3://bucket/prefix URI")
        return cls(bucket, prefix)

    @property
    def name(self) -> str:
        """The last part of the prefix (the bucket's name where there is no prefix)."""
        return self.prefix.rsplit("/", 1)[-1] if self.prefix else self.bucket

    def key(self, relpath: str) -> str:
        return f"{self.prefix}/{relpath}" if self.prefix else relpath

    def __str__(self) -> str:
        return f"{S3_SCHEME}{self.bucket}/{self.prefix}" if self.prefix else S3_SCHEME + self.bucket


def make_s3_client(endpoint_url: str | None = None, max_connections: int = 16) -> Any:
    """A boto3 S3 client with a connection pool for `max_connections` threads."""
    import boto3
    from botocore.config import Config

    config = Config(
        max_pool_connections=max_connections, retries={"mode": "standard", "max_attempts": 5}
    )
    return boto3.client("s3", endpoint_url=endpoint_url or None, config=config)


def s3_refusal(where: S3Location, key: str, exc: Exception) -> BadSnapshot:
    """A one-line BadSnapshot for a failed S3 request on `key` (a missing object says so)."""
    from botocore.exceptions import ClientError

    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        code = str(error.get("Code", "?"))
        if code in ("NoSuchKey", "404", "NotFound"):
            return bad_snapshot(where, f"object {key!r} is missing (an incomplete upload?)")
        if code == "InvalidRange":
            return bad_snapshot(where, f"object {key!r} is shorter than the manifest says")
        return bad_snapshot(where, f"cannot read {key!r}: {code} ({error.get('Message', '')})")
    return bad_snapshot(where, f"cannot read {key!r}: {type(exc).__name__}: {exc}")


def read_range_into(
    client: Any,
    where: S3Location,
    key: str,
    span: tuple[int, int, int],
    fd: int,
    progress: TransferProgress | None = None,
) -> str:
    """GET bytes [offset, offset+length) of `key` into `fd` at the same offset; their sha256.

    `span` is (offset, length, the object's size per the manifest); another object size or a
    short body is refused. A body that breaks off is fetched again (`_MAX_ATTEMPTS` in all).
    """
    from botocore.exceptions import BotoCoreError, ClientError

    for attempt in range(1, _MAX_ATTEMPTS + 1):
        try:
            return _read_once(client, where, key, span, fd, progress)
        except ClientError as exc:
            raise s3_refusal(where, key, exc) from None
        except BotoCoreError as exc:
            if attempt == _MAX_ATTEMPTS:
                raise s3_refusal(where, key, exc) from None
    raise AssertionError("unreachable")


def _read_once(client, where, key, span, fd, progress) -> str:
    offset, length, object_size = span
    assert length > 0, "an empty range needs no GET"
    end = offset + length - 1
    response = client.get_object(Bucket=where.bucket, Key=key, Range=f"bytes={offset}-{end}")
    total = response.get("ContentRange", "").rpartition("/")[2]
    if total != str(object_size):
        raise bad_snapshot(
            where, f"object {key!r} has {total or '?'} bytes, the manifest says {object_size}"
        )
    digest, written, body = hashlib.sha256(), 0, response["Body"]
    try:
        while written < length and (block := body.read(min(_BLOCK_BYTES, length - written))):
            digest.update(block)
            os.pwrite(fd, block, offset + written)
            written += len(block)
            if progress is not None:
                progress.add(len(block))
    except BaseException:
        if progress is not None:
            progress.add(-written)  # a retry counts them again
        raise
    finally:
        body.close()
    if written != length:
        raise bad_snapshot(where, f"object {key!r} bytes {offset}..{end}: got {written} bytes")
    return digest.hexdigest()


class TransferProgress:
    """Bytes moved so far, logged with the rate at most once per `interval_s` (thread-safe)."""

    def __init__(self, verb: str, total_bytes: int, log: Log | None, interval_s: float = 1.0):
        self.verb, self.total_bytes, self.done_bytes = verb, total_bytes, 0
        self._log, self._interval_s = log, interval_s
        self._start = self._last = time.monotonic()
        self._lock = threading.Lock()

    def add(self, num_bytes: int) -> None:
        with self._lock:
            self.done_bytes += num_bytes
            now = time.monotonic()
            if self._log is None or now - self._last < self._interval_s:
                return
            self._last = now
            line = self._line(now)
        self._log(line)

    def elapsed_s(self) -> float:
        return time.monotonic() - self._start

    def rate(self) -> str:
        return f"{format_bytes(self.done_bytes / max(self.elapsed_s(), 1e-9))}/s"

    def _line(self, now: float) -> str:
        share = self.done_bytes / self.total_bytes if self.total_bytes else 1.0
        return (
            f"{self.verb}: {format_bytes(self.done_bytes)} of {format_bytes(self.total_bytes)} "
            f"({share:.0%}) at {self.rate()}"
        )


def format_bytes(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(num_bytes) < 1024:
            return f"{num_bytes:.1f} {unit}" if unit != "B" else f"{num_bytes:.0f} B"
        num_bytes /= 1024
    return f"{num_bytes:.1f} TiB"
