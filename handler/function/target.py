"""What a worker serves (`ServeTarget`) and the error a front door maps to 503 (`NotReady`).

Split from runtime.py; runtime.py re-exports both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from snapfn.handler.api import parse_function_spec
from snapfn.snapshot.errors import BadRequest, SnapfnError

if TYPE_CHECKING:
    from snapfn.handler.llm.init_config import InitConfig
    from snapfn.snapshot.store.cache import SnapshotCacheConfig

KINDS = ("llm", "function")
DEFAULT_TIMEOUT_S = 900.0  # Lambda's longest function timeout


def _default_init_config() -> InitConfig:
    # NOTE: imported lazily: init_config imports torch, which a kind="function" target may not
    # need and which the gunicorn master should not pay for.
    from snapfn.handler.llm.init_config import InitConfig

    return InitConfig()


@dataclass(frozen=True)
class ServeTarget:
    """What a worker serves. Validated when built (BadRequest says what to fix)."""

    kind: str = "llm"  # "llm" (built-in) or "function"
    model_dir: Path | None = None  # llm: HF model folder for a cold init (default: embedded)
    snapshot_dir: Path | None = (
        None  # restore from here (llm: tier 1 → 0 → cold init, rewriting it;
    )
    # function: its process snapshot → cold init)
    function: str | None = None  # "module:function" for kind="function"
    init_config: InitConfig = field(default_factory=_default_init_config)
    function_dir: Path | None = None  # function: searched first for its module (Lambda task root)
    timeout_s: float = DEFAULT_TIMEOUT_S  # an invocation's deadline unless invoke() gives one
    # llm: an s3:// snapshot that missed the cache: the worker pulls it into `snapshot_dir`
    # (its cache entry's folder) with `snapshot_cache`, restoring as it arrives
    snapshot_uri: str | None = None
    snapshot_cache: SnapshotCacheConfig | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise BadRequest(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "function":
            if self.function is None:
                raise BadRequest('kind="function" needs function="module:function"')
            parse_function_spec(self.function)
        elif self.function is not None:
            raise BadRequest(f'function={self.function!r} needs kind="function"')
        if (self.snapshot_uri is None) != (self.snapshot_cache is None):
            raise BadRequest("snapshot_uri and snapshot_cache go together")
        if not self.timeout_s > 0:
            raise BadRequest(f"timeout_s must be > 0, got {self.timeout_s}")


class NotReady(SnapfnError):
    """The worker is still starting (or was closed): retry later (HTTP 503 + Retry-After)."""

    code = "not_ready"
