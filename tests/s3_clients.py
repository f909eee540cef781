"""A boto3 S3 client stand-in for the store tests: records ranged GETs, fails on demand.

`RecordingClient(client)` passes every call through to a real client (moto's), recording each
ranged GET as (key, Range). `fail_gets_after=N` makes every ranged GET after the first N fail
as a lost connection would (botocore's EndpointConnectionError); `fail_put_suffix` makes the
upload of a key ending so fail with a server error.
"""

from __future__ import annotations

import threading
from typing import Any


class RecordingClient:
    def __init__(
        self, client: Any, fail_gets_after: int | None = None, fail_put_suffix: str | None = None
    ) -> None:
        self.client = client
        self.ranged_gets: list[tuple[str, str]] = []
        self.failed_gets = 0
        self._fail_gets_after = fail_gets_after
        self._fail_put_suffix = fail_put_suffix
        self._lock = threading.Lock()

    def get_object(self, **kwargs: Any) -> Any:
        if "Range" in kwargs:
            with self._lock:
                if self._fail_gets_after is not None and (
                    len(self.ranged_gets) >= self._fail_gets_after
                ):
                    self.failed_gets += 1
                    from botocore.exceptions import EndpointConnectionError

                    raise EndpointConnectionError(endpoint_url="http://injected-failure")
                self.ranged_gets.append((kwargs["Key"], kwargs["Range"]))
        return self.client.get_object(**kwargs)

    def put_object(self, **kwargs: Any) -> Any:
        if self._fail_put_suffix and kwargs["Key"].endswith(self._fail_put_suffix):
            from botocore.exceptions import ClientError

            error = {"Error": {"Code": "InternalError", "Message": "injected"}}
            raise ClientError(error, "PutObject")
        return self.client.put_object(**kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)
