"""Timed init stages, the startup manifest, and the readiness state.

Every stage of an init or a restore runs through one mechanism, `StageRunner.run(name, fn)`:
it records wall time (and the offset from the start, for the waterfall), the figures the stage
reports (bytes moved, GB/s, counts …) and, if it raised, the error. The startup manifest is
plain JSON:

    {"kind": "init" | "restore", "tier": "cold" | "portable" | …, "started_at": unix_s,
     "total_s": float, "ok": bool,
     "stages": [{"name", "start_s", "seconds", "ok", "figures": {…}, "error"?: str}],
     "fallbacks": [{"from", "to", "step", "reason"}],
     "info": {…}}   # memory plan, graph buckets, compile caches, versions: set by the function
"""

from __future__ import annotations

import enum
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

Log = Callable[[str], None]


def stderr_log(line: str) -> None:
    """The runtime's default log: one "[snapfn] …" line on stderr."""
    print(f"[snapfn] {line}", file=sys.stderr, flush=True)


class Readiness(enum.Enum):
    STARTING = "starting"
    UP = "up"
    FAILED = "failed"


class ReadinessState:
    """Thread-safe three-state readiness that front doors expose (`/health`)."""

    def __init__(self) -> None:
        self._state = Readiness.STARTING
        self._reason = ""
        self._changed = threading.Condition()

    @property
    def state(self) -> Readiness:
        return self._state

    @property
    def reason(self) -> str:
        return self._reason

    def set(self, state: Readiness, reason: str = "") -> None:
        with self._changed:
            self._state, self._reason = state, reason
            self._changed.notify_all()

    def wait_until_settled(self, timeout_s: float | None = None) -> Readiness:
        """Block until UP or FAILED (or the timeout); return the state."""
        with self._changed:
            self._changed.wait_for(lambda: self._state is not Readiness.STARTING, timeout_s)
            return self._state


@dataclass
class StageRecord:
    name: str
    start_s: float
    seconds: float = 0.0
    ok: bool = True
    figures: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


@dataclass
class StartupManifest:
    kind: str  # "init" or "restore"
    tier: str
    started_at: float = field(default_factory=time.time)
    total_s: float = 0.0
    ok: bool = False
    stages: list[StageRecord] = field(default_factory=list)
    fallbacks: list[dict[str, str]] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StartupManifest:
        stages = [StageRecord(**s) for s in data.get("stages", [])]
        return cls(**{**data, "stages": stages})

    def stage(self, name: str) -> StageRecord | None:
        return next((s for s in self.stages if s.name == name), None)

    def add_fallback(self, from_tier: str, to_tier: str, step: str, reason: str) -> None:
        self.fallbacks.append({"from": from_tier, "to": to_tier, "step": step, "reason": reason})

    def add_failed_process_restore(self, failed: Any, to_tier: str, first: bool = False) -> None:
        """Record a tier-1 restore that failed (a ProcessRestoreFailed: its `step` and the
        `startup` manifest of the attempt) and the tier that ran instead; `first` puts the
        record before the fallbacks already there (those of the tier that ran instead)."""
        record = {"from": "process", "to": to_tier, "step": failed.step, "reason": str(failed)}
        self.fallbacks.insert(0 if first else len(self.fallbacks), record)
        self.info["failed_process_restore"] = failed.startup.to_json()


class StageRunner:
    """Runs named stages in order, timing each into a StartupManifest."""

    def __init__(
        self,
        manifest: StartupManifest,
        clock: Callable[[], float] = time.perf_counter,
        log: Callable[[str], None] | None = None,
        offset_s: float = 0.0,
    ) -> None:
        """`offset_s`: seconds already spent (continuing a manifest another runner started)."""
        self.manifest = manifest
        self._clock = clock
        self._t0 = clock() - offset_s
        self._log = log

    def run(self, name: str, fn: Callable[[dict[str, Any]], Any]) -> Any:
        """Run `fn(figures)`; `fn` fills `figures`. Re-raises after recording a failure."""
        record = StageRecord(name=name, start_s=self._clock() - self._t0)
        self.manifest.stages.append(record)
        start = self._clock()
        try:
            return fn(record.figures)
        except BaseException as exc:
            record.ok = False
            record.error = f"{type(exc).__name__}: {exc}".splitlines()[0]
            raise
        finally:
            record.seconds = self._clock() - start
            self.manifest.total_s = self._clock() - self._t0
            if self._log is not None:
                self._log(format_stage(record))

    def finish(self, ok: bool) -> StartupManifest:
        self.manifest.ok = ok
        self.manifest.total_s = self._clock() - self._t0
        return self.manifest


def format_stage(record: StageRecord) -> str:
    figures = ", ".join(
        f"{k}={_fmt(v)}" for k, v in record.figures.items() if not isinstance(v, dict | list)
    )
    status = "" if record.ok else f"  FAILED: {record.error}"
    return f"{record.name:<20} {record.seconds:8.3f} s  {figures}{status}"


def _fmt(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)
