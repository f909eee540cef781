"""The start-up gate: requests that need the runtime wait for it, boundedly, or get a 503.

Contract: `StartupGate.admit()` returns at once while the runtime is UP. While it is STARTING,
at most `startup_queue_size` requests wait, each at most `startup_wait_s`; a request beyond
the queue, or one whose wait ran out, raises `ServiceUnavailable` with `retry_after_s` (the
`Retry-After` header). Once the runtime FAILED, every request raises `ServiceUnavailable`
without a retry hint, naming the failure: "the worker failed to start: …", or, for a runtime
that was up (`runtime.stopped`), "the worker stopped: …". Waiters and refusals (by reason:
`queue_full`, `timeout`, `failed`, `stopped`) are counted in the `HttpMetrics`.
"""

from __future__ import annotations

import threading
from typing import Any

from snapfn.handler.http.metrics import HttpMetrics
from snapfn.handler.http.serve_config import ServeConfig
from snapfn.snapshot.errors import SnapfnError
from snapfn.snapshot.stages import Readiness


class ServiceUnavailable(SnapfnError):
    """The worker cannot serve this request now (starting, start-up queue full, failed)."""

    code = "unavailable"

    def __init__(self, message: str, reason: str, retry_after_s: int | None) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s


class StartupGate:
    """Holds requests until the runtime is up: at most `startup_queue_size` of them wait, each
    at most `startup_wait_s`; the rest get a 503 with Retry-After."""

    def __init__(self, runtime: Any, config: ServeConfig, metrics: HttpMetrics) -> None:
        """`runtime`: a `WorkerRuntime` (its `readiness` and `stopped` are read)."""
        self._runtime = runtime
        self._readiness = runtime.readiness
        self._config = config
        self._metrics = metrics
        self._waiters = 0
        self._lock = threading.Lock()

    def admit(self) -> None:
        """Return once UP; raise `ServiceUnavailable` when FAILED, full, or still starting."""
        if self._readiness.state is Readiness.UP:
            return
        self._check_failed()
        with self._lock:
            if self._waiters >= self._config.startup_queue_size:
                raise self._refuse("queue_full", "the start-up queue is full")
            self._waiters += 1
            self._metrics.startup_waiters.inc()
        try:
            state = self._readiness.wait_until_settled(self._config.startup_wait_s)
        finally:
            with self._lock:
                self._waiters -= 1
                self._metrics.startup_waiters.dec()
        if state is Readiness.STARTING:
            raise self._refuse("timeout", "the worker is still starting")
        self._check_failed()

    def _check_failed(self) -> None:
        if self._readiness.state is not Readiness.FAILED:
            return
        reason, what = (
            ("stopped", "stopped") if self._runtime.stopped else ("failed", "failed to start")
        )
        self._metrics.startup_rejections.labels(reason).inc()
        raise ServiceUnavailable(f"the worker {what}: {self._readiness.reason}", reason, None)

    def _refuse(self, reason: str, message: str) -> ServiceUnavailable:
        self._metrics.startup_rejections.labels(reason).inc()
        retry = self._config.retry_after_s
        return ServiceUnavailable(f"{message}; retry in {retry} s", reason, retry)
