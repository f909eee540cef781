"""The activator's keepers (`snapfn serve --idle-timeout … --keeper on`): one `snapfn keeper`
per GPU, started with the activator and stopped with it, so that every instance's tier-1
restore on that GPU finds a CUDA driver already started and the snapshot's weights pinned in
place (snapshot/keeper/daemon.py; 0.81–0.92 s instead of 1.26–1.57 s to the first token for an 8B
llama on the H200, docs/benchmarks.md).

A keeper is an optimisation, never a dependency: an instance that finds its keeper gone (it
failed to start, it died) restores without it, as with `--keeper off`. So a keeper that exits
is logged, not restarted, and the activator serves on. The keepers' sockets live in a directory
private to this user (`<$XDG_RUNTIME_DIR or /tmp>/snapfn-UID/keepers-PID`, each 0700); when
either directory is another user's or open to others, no keeper starts and the reason is logged.
"""

from __future__ import annotations

import logging
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from snapfn.handler.activator.plan import ActivatorPlan
from snapfn.snapshot.unix_socket import ensure_private_dir

log = logging.getLogger("snapfn.activator")
STOP_TIMEOUT_S = 10.0


@dataclass
class Keepers:
    """The keeper processes of a plan (none when its keeper setting is off)."""

    plan: ActivatorPlan
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    _own_dir: bool = field(default=False, repr=False)  # the sockets' directory passed its check

    def start(self) -> None:
        if not self.plan.keeper_dir:
            return
        keeper_dir = Path(self.plan.keeper_dir)
        untrusted = ensure_private_dir(keeper_dir.parent) or ensure_private_dir(keeper_dir)
        if untrusted is not None:
            log.warning("no keepers: %s (restores go without)", untrusted)
            return
        self._own_dir = True
        for gpu in self.plan.gpu_ids:
            try:
                self.procs[gpu] = subprocess.Popen(
                    self.plan.keeper_argv(gpu),
                    env=self.plan.keeper_env(gpu),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    start_new_session=True,  # NOTE: its own group: a Ctrl-C reaches us, not it
                )
            except OSError as exc:
                log.warning("keeper for GPU %s did not start (%s): restores go without", gpu, exc)
                continue
            what = self.plan.keeper_snapshot or "no snapshot: CUDA kept warm only"
            log.info("keeper for GPU %s: pid %d, %s", gpu, self.procs[gpu].pid, what)

    def exited(self) -> dict[str, int]:
        """The GPUs whose keeper has exited, with its exit status."""
        return {gpu: p.returncode for gpu, p in self.procs.items() if p.poll() is not None}

    def stop(self) -> None:
        """SIGTERM each keeper (it unpins and removes its socket), SIGKILL one that lingers."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for gpu, proc in self.procs.items():
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log.warning(
                    "keeper for GPU %s ignored SIGTERM for %.0f s: killed", gpu, STOP_TIMEOUT_S
                )
                proc.kill()
                proc.wait()
        self.procs = {}
        if self._own_dir:  # never another user's directory
            shutil.rmtree(self.plan.keeper_dir, ignore_errors=True)
            self._own_dir = False
