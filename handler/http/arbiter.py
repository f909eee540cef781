"""gunicorn's arbiter for `snapfn serve`: a worker that was up and then exited is replaced.

gunicorn's arbiter stops the whole server when a worker exits with `WORKER_BOOT_ERROR` (3) or
`APP_LOAD_ERROR` (4): it takes that worker for one that could not boot, and another would fail
the same way. A worker that had served can exit with those codes too (a function calling
`os._exit(3)`), and must then be replaced like any other dead worker.

The arbiter cannot tell them apart by itself: `worker.booted` is set in the forked worker, never
in the arbiter's copy. So each worker carries an `UpMark`, one byte of memory shared with the
arbiter (made before the fork, `workers.py`), which the worker sets once it serves: booted by
gunicorn and its runtime up (`serve.SnapfnServer.watch_start`). `SnapfnArbiter.reap_workers`
reaps a worker whose mark is set and whose exit code is a boot-error code itself, logs it as a
worker that exited after it was up, and leaves every other exit to gunicorn, so a failed start
(never marked) still stops the server. The up workers are kept out of gunicorn's sight while
it reaps, so one exiting between the two passes is reaped there as an unknown child (gunicorn
27 reaps those without a halt) and replaced after it. A worker class without a mark (gevent, …)
is never taken for up.
"""

from __future__ import annotations

import mmap
import os
from typing import Any

from gunicorn.arbiter import Arbiter

from snapfn.snapshot.portable.staging import pid_alive


class UpMark:
    """One byte of memory shared by the arbiter and the worker it forks: the worker sets it once
    it serves, the arbiter reads it when the worker exits."""

    def __init__(self) -> None:
        self._byte = mmap.mmap(-1, 1)  # anonymous and shared: both sides of the fork see it

    def set(self) -> None:
        self._byte[0] = 1

    def is_set(self) -> bool:
        return self._byte[0] == 1


def was_up(worker: Any) -> bool:
    """Whether a gunicorn worker set its `UpMark` (False for a worker class without one)."""
    mark = getattr(worker, "up_mark", None)
    return mark is not None and mark.is_set()


class SnapfnArbiter(Arbiter):
    """gunicorn's arbiter, but a worker that was up and exits with a boot-error code is
    replaced instead of stopping the server."""

    BOOT_ERROR_CODES = (Arbiter.WORKER_BOOT_ERROR, Arbiter.APP_LOAD_ERROR)

    def reap_workers(self) -> None:
        up = [pid for pid, w in self.WORKERS.items() if was_up(w)]
        running = [pid for pid in up if self._reap_if_boot_error_code(pid, self.WORKERS[pid])]
        # NOTE: the up workers still running are out of WORKERS while gunicorn reaps: one that
        # exits after the pass above is reaped there as an unknown child (never a halt), and
        # replaced below; those that had exited otherwise are gunicorn's (it logs how)
        hidden = {pid: self.WORKERS.pop(pid) for pid in running}
        try:
            super().reap_workers()
        finally:
            self.WORKERS.update(hidden)
        for pid, worker in hidden.items():
            if not pid_alive(pid):
                self._replace(pid, worker, "its exit status reaped by gunicorn")

    def _reap_if_boot_error_code(self, pid: int, worker: Any) -> bool:
        """Reap and replace the worker if it exited with a boot-error code; whether it is
        still running (False: it exited, reaped here or left for gunicorn)."""
        try:  # NOTE: WNOWAIT: a worker that exited otherwise is left for gunicorn to reap
            exited = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return False
        if exited is None:
            return True
        if exited.si_code == os.CLD_EXITED and exited.si_status in self.BOOT_ERROR_CODES:
            os.waitpid(pid, 0)
            self._replace(pid, worker, f"code {exited.si_status}")
        return False

    def _replace(self, pid: int, worker: Any, how: str) -> None:
        """Forget a reaped worker that was up, as gunicorn forgets any dead worker (the
        arbiter's loop then starts another)."""
        self.WORKERS.pop(pid, None)
        self.log.error(
            "Worker (pid:%s) exited with %s after it was up (not a failed boot)", pid, how
        )
        worker.tmp.close()
        self.cfg.child_exit(self, worker)
