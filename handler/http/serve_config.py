"""`ServeConfig`: how `snapfn serve` listens and what its HTTP app accepts.

Contract: a frozen dataclass built once, before any worker forks: its defaults, then the
`SNAPFN_<FIELD>` environment variables (`from_env(environ, ...)`, with the mapping passed in),
then the CLI flags given as overrides (None = not given). Bad values raise `BadRequest` naming
the field or variable. The CLI (`serve.py`), the app (`http.create_app`), the start-up gate and
the scale-to-zero activator (`activator/app.py`, on when `idle_timeout_s` is set) read it; nothing
writes it back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from snapfn.snapshot.errors import BadRequest

FUNCTION_ERRORS = ("http", "lambda")


@dataclass(frozen=True)
class ServeConfig:
    """How `snapfn serve` listens and what its app accepts. Built once: `from_env` + CLI flags."""

    host: str = "127.0.0.1"
    port: int = 8000  # 0 = any free port (the printed URL says which)
    workers: int = 1  # each worker initialises (or restores) its own copy: one per GPU
    threads: int = 32  # gthread threads per worker = requests served at once per worker
    worker_timeout_s: int = 120  # gunicorn kills a worker whose main loop is silent this long
    graceful_timeout_s: int = 30
    api_key: str | None = None
    model_name: str | None = None  # the name clients send as "model"; None = from the target
    max_body_bytes: int = 4 << 20
    # a request's headers and body must arrive within this, else a 408 and the connection
    # closes (`receive_deadline.py`); streaming the answer back is not timed
    receive_timeout_s: float = 30.0
    max_choices: int = 64  # prompts × n per generation request
    startup_queue_size: int = 64  # requests allowed to wait for start-up (0: refuse at once)
    startup_wait_s: float = 300.0
    retry_after_s: int = 5
    invoke_timeout_s: float | None = None  # /invoke deadline; None = the target's own
    # a function's error on /invoke: "http" a 500, "lambda" a 200 with X-Amz-Function-Error
    # (as Lambda's Invoke API answers); both carry X-Snapfn-Function-Error
    function_errors: str = "http"
    access_log: str | None = None  # gunicorn's access log: a file, or "-" for stdout; None: off
    # a worker whose start failed answers /health (503, the reason) this long, then exits with
    # gunicorn's boot-error code: the server stops, non-zero, for an orchestrator to restart
    failed_start_exit_s: float = 5.0
    # the scale-to-zero activator (`activator/app.py`): on when idle_timeout_s is set
    idle_timeout_s: float | None = None  # stop an instance idle this long (down to zero)
    max_instances: int | None = None  # None: one per GPU (1 on a machine without GPUs)
    target_concurrency: int = 8  # requests in flight per instance before another one starts
    instance_start_timeout_s: float = 600.0  # an instance not up by then is killed
    # "on": the activator runs a `snapfn keeper` per GPU (snapshot/keeper/daemon.py) for its
    # instances' tier-1 restores; "off": none (an instance restores without one)
    keeper: str = "off"

    def __post_init__(self) -> None:
        positive = ("workers", "threads", "worker_timeout_s", "max_body_bytes", "max_choices")
        for name in positive + ("retry_after_s",):
            if getattr(self, name) < 1:
                raise BadRequest(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.port <= 65535:
            raise BadRequest(f"port must be in [0, 65535], got {self.port}")
        if self.startup_queue_size < 0 or self.startup_wait_s < 0:
            raise BadRequest("startup_queue_size and startup_wait_s must be >= 0")
        if self.function_errors not in FUNCTION_ERRORS:
            raise BadRequest(
                f"function_errors must be one of {', '.join(FUNCTION_ERRORS)}, "
                f"got {self.function_errors!r}"
            )
        if not self.receive_timeout_s > 0:
            raise BadRequest(f"receive_timeout_s must be > 0, got {self.receive_timeout_s}")
        if not self.failed_start_exit_s >= 0:
            raise BadRequest(f"failed_start_exit_s must be >= 0, got {self.failed_start_exit_s}")
        self._check_activator_fields()

    def _check_activator_fields(self) -> None:
        if self.idle_timeout_s is not None and not self.idle_timeout_s > 0:
            raise BadRequest(f"idle_timeout_s must be > 0, got {self.idle_timeout_s}")
        if self.max_instances is not None and self.max_instances < 1:
            raise BadRequest(f"max_instances must be >= 1, got {self.max_instances}")
        if self.target_concurrency < 1 or not self.instance_start_timeout_s > 0:
            raise BadRequest("target_concurrency must be >= 1, instance_start_timeout_s > 0")
        if self.max_instances is not None and self.idle_timeout_s is None:
            raise BadRequest(
                "max_instances needs idle_timeout_s (the activator): add --idle-timeout"
            )
        if self.keeper not in ("on", "off"):
            raise BadRequest(f"keeper must be on or off, got {self.keeper!r}")
        if self.keeper == "on" and self.idle_timeout_s is None:
            raise BadRequest("keeper needs idle_timeout_s (the activator): add --idle-timeout")

    @classmethod
    def from_env(cls, environ: Mapping[str, str], **overrides: object) -> ServeConfig:
        """Defaults, then `SNAPFN_<FIELD>` variables (`SNAPFN_API_KEY` …), then overrides."""
        values: dict[str, object] = {}
        for f in fields(cls):
            raw = environ.get(f"SNAPFN_{f.name.upper()}")
            if raw is not None and raw != "":
                values[f.name] = _parse_field(f"SNAPFN_{f.name.upper()}", str(f.type), raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def _parse_field(variable: str, type_name: str, raw: str) -> object:
    kind = int if type_name.startswith("int") else float if type_name.startswith("float") else str
    try:
        return kind(raw)
    except ValueError:
        raise BadRequest(f"{variable}={raw!r} is not a valid {kind.__name__}") from None
