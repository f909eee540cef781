"""The front door's end of a restored process-snapshot worker: requests by id, replies routed.

    client = ProcessClient(worker)          one reader thread routes replies by "id"
    replies = client.request({"op": "generate", ...})   a queue of that request's replies
    reply = client.call({"op": "info"}, timeout_s)      one reply (None: none in time)
    client.close()                          asks the worker to exit, then kills it

If the worker dies, every waiting request gets {"event": "error", "code": "worker_exited"} and
later requests fail at once (`dead` says why): a front door then reports FAILED readiness.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable
from typing import Any

WORKER_EXITED = "worker_exited"


class ProcessClient:
    def __init__(self, worker: Any, on_exit: Callable[[str], None] | None = None) -> None:
        self.worker = worker
        self.dead: str | None = None
        self._waiting: dict[int, queue.Queue] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._on_exit = on_exit
        self._reader = threading.Thread(target=self._read, name="snapfn-worker-rx", daemon=True)
        self._reader.start()

    def request(self, message: dict[str, Any]) -> queue.Queue:
        """Send `message` with a fresh id; its replies arrive on the returned queue (`forget`
        the id when done with them)."""
        return self._send(message)[1]

    def call(self, message: dict[str, Any], timeout_s: float | None) -> dict[str, Any] | None:
        """Send `message` and return its one reply, None if none came within `timeout_s`; the
        id is forgotten either way."""
        rid, replies = self._send(message)
        try:
            return replies.get(timeout=timeout_s)
        except queue.Empty:
            return None
        finally:
            self.forget(rid)

    def _send(self, message: dict[str, Any]) -> tuple[int, queue.Queue]:
        replies: queue.Queue = queue.Queue()
        with self._lock:
            rid = next(self._ids)
            if self.dead is not None:
                replies.put(_exited(rid, self.dead))
                return rid, replies
            self._waiting[rid] = replies
        try:
            self.worker.channel.send({**message, "id": rid})
        except OSError as exc:
            self._fail(f"cannot write to the worker: {exc}")
        return rid, replies

    def notify(self, message: dict[str, Any]) -> None:
        """Send a message that has no reply (cancel)."""
        if self.dead is None:
            try:
                self.worker.channel.send(message)
            except OSError as exc:
                self._fail(f"cannot write to the worker: {exc}")

    def forget(self, rid: int) -> None:
        with self._lock:
            self._waiting.pop(rid, None)

    def close(self) -> None:
        self.notify({"op": "close"})
        self._fail("closed")
        self.worker.kill()

    def _read(self) -> None:
        while True:
            try:
                message = self.worker.channel.recv()
            except (OSError, ValueError) as exc:
                message, reason = None, f"bad message from the worker: {exc}"
            else:
                reason = f"worker pid {self.worker.pid} exited"
            if message is None:
                self._fail(reason)
                return
            with self._lock:
                replies = self._waiting.get(message.get("id"))
            if replies is not None:
                replies.put(message)

    def _fail(self, reason: str) -> None:
        with self._lock:
            if self.dead is not None:
                return
            self.dead = reason
            waiting, self._waiting = self._waiting, {}
        for rid, replies in waiting.items():
            replies.put(_exited(rid, reason))
        if self._on_exit is not None and reason != "closed":
            self._on_exit(reason)


def _exited(rid: int, reason: str) -> dict[str, Any]:
    return {"id": rid, "event": "error", "code": WORKER_EXITED, "message": reason}
