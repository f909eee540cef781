"""What the queue worker holds: its running jobs with their messages, kept visible.

Contract:
- `InFlight` maps each running job to the messages carrying it (a redelivery of a running job
  joins it); `settling(job_id)` takes the messages out for deletion or give-back and counts the
  job until that is done, so `wait_empty` (drain) does not return while messages are settling.
  `wait_for_room` blocks the poller while `max_in_flight` messages are held.
- `Heartbeat` calls `extend(held())` every `interval_s` on a daemon thread while anything is
  held, so a job longer than the visibility timeout is not delivered twice.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from snapfn.handler.queue.jobs import Message
from snapfn.handler.queue.runner import RunningJob


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
