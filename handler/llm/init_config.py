"""InitConfig: how the LLM function initialises, frozen once built.

Values found at run time (KV page count, graph buckets actually captured, eos ids) are not
written back here: they live in the `MemoryPlan` and the startup manifest.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path


def read_json_file(path: Path | str, where: str, max_bytes: int) -> object:
    """The JSON value in the file at `path` that an InitConfig field names (`where`: the field
    and the path, for messages), or InitFailed saying why it cannot be used."""
    from snapfn.snapshot.errors import InitFailed, one_line

    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise InitFailed(f"{where}: cannot be read ({exc.strerror or exc})") from None
    if len(raw) > max_bytes:
        raise InitFailed(f"{where}: larger than {max_bytes} bytes")
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise InitFailed(one_line(f"{where}: not JSON ({exc})")) from None


def default_cache_dir(environ: Mapping[str, str]) -> Path:
    base = environ.get("XDG_CACHE_HOME") or str(Path(environ.get("HOME", "/tmp")) / ".cache")
    return Path(base) / "snapfn"


@dataclass(frozen=True)
class InitConfig:
    device: str = "cpu"
    dtype: str = "auto"
    backend: str = "auto"
    page_size: int = 16
    max_running_requests: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    mem_fraction_static: float = 0.85  # share of GPU memory for weights + KV pool (SGLang's rule)
    kv_cache_bytes_cpu: int = 256 << 20  # on CPU there is nothing to profile: a fixed KV budget
    graph_max_batch: int = 64  # decode graph buckets: 1, 2, 4, … up to this; 0: no graphs
    graph_max_seq_len: int = 4096
    overlap_decode: bool = True  # land greedy graph decode steps one step late (engine.py)
    # a step of at most this many tokens that is not a decode step replays a decode graph, a row
    # a token (engine.py); 0: such steps (short prefills) run eagerly
    prefill_graph_tokens: int = 64
    prefix_caching: bool = True  # share full prompt pages across requests (prefix_cache.py)
    preemption: bool = True  # KV pages as tokens need them, preempting (engine/scheduler.py)
    restore_overlap: bool = True  # tier 0: the KV pool and warmup while weights stream
    # tier 0, overlapped: Python's thread switch interval (µs) while the stream runs beside the
    # warmup, whose Python holds the GIL the stream's thread needs for each chunk; 0: Python's
    restore_switch_interval_us: int = 0
    restore_read_ahead: bool = True  # tier 0: the weights file into the page cache from the start
    # the read-ahead's I/O class: "normal" (the process's) or "idle" (the disk serves the
    # process's other reads first: its imports' page faults; snapshot/portable/ioprio.py)
    restore_read_ahead_priority: str = "normal"
    # tier 0: each decode graph captured by its first decode step, not before ready (graphs.py)
    restore_graphs_on_first_use: bool = True
    speculative_tokens: int = 0  # MTP drafts per decode step (engine/speculative.py); 0: off
    overlap_speculative: bool = True  # MTP drafts read after the next verify's launch
    prefill_chunk_sizes: tuple[
        int, ...
    ] = ()  # warmed prefill shapes; () = (max_num_batched_tokens,)
    prewarm_threads: int = 16
    stream_threads: int = 16
    stream_ring_slots: int = (
        12  # x 64 MiB pinned; 12 streamed 31 GB/s on the H200 and pins in 0.3 s
    )
    # how a tier-0 restore pins its stream's host ring: "register" (anonymous memory registered
    # at once, 0.07 s a GiB) or "alloc" (torch's pinned allocation, 0.35-0.53 s a GiB)
    stream_ring_pinning: str = "register"
    cache_dir: Path = field(default_factory=lambda: default_cache_dir(os.environ))
    tier: str = "portable"  # what `snapfn init` writes: "portable" (tier 0) or "process" (tier 1)
    tp_size: int = 1  # tensor-parallel ranks (handler/llm/ranks.py starts them)
    ep_size: int = 1  # expert-parallel ranks of a MoE model (tp_size * ep_size processes)
    ep_dispatch: str = "replicated"  # how tokens meet other ep ranks' experts (parallel.py)
    # a JSON list of structured-output specs compiled at init and kept by the snapshot
    # (structured/configured.py); None: none
    structured_schemas: Path | None = None
    # a JSON list of prompt texts prefilled into the prefix cache at start-up (a system prompt;
    # recipes/prefix_warm.py); None: none
    prefix_warm: Path | None = None

    def __post_init__(self) -> None:
        """A count or size out of its range is refused here, naming the variable that sets it
        (a later stage would fail on it less clearly)."""
        from snapfn.snapshot.errors import BadRequest

        for name, low in _AT_LEAST.items():
            value = getattr(self, name)
            if value < low:
                raise BadRequest(
                    f"{name} (SNAPFN_{name.upper()}) must be at least {low}, got {value}"
                )
        if not 0 < self.mem_fraction_static <= 1:
            raise BadRequest(
                "mem_fraction_static (SNAPFN_MEM_FRACTION_STATIC) must be in (0, 1], got "
                f"{self.mem_fraction_static}"
            )
        if self.stream_ring_pinning not in ("register", "alloc"):
            raise BadRequest(
                "stream_ring_pinning (SNAPFN_STREAM_RING_PINNING) must be register or alloc, "
                f"got {self.stream_ring_pinning!r}"
            )
        if self.restore_read_ahead_priority not in ("normal", "idle"):
            raise BadRequest(
                "restore_read_ahead_priority (SNAPFN_RESTORE_READ_AHEAD_PRIORITY) must be normal"
                f" or idle, got {self.restore_read_ahead_priority!r}"
            )
        if any(size < 1 for size in self.prefill_chunk_sizes):
            raise BadRequest(
                "prefill_chunk_sizes (SNAPFN_PREFILL_CHUNK_SIZES) must be positive, got "
                f"{self.prefill_chunk_sizes}"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str], **overrides: object) -> InitConfig:
        """Defaults, then `SNAPFN_<FIELD>` variables, then explicit overrides (CLI flags)."""
        values: dict[str, object] = {}
        for f in fields(cls):
            name = f"SNAPFN_{f.name.upper()}"
            raw = environ.get(name)
            if raw is not None:
                try:
                    values[f.name] = _parse(f.type, raw)
                except ValueError as exc:
                    from snapfn.snapshot.errors import BadRequest, one_line

                    raise BadRequest(one_line(f"{name}={raw[:80]!r}: {exc}")) from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        if "cache_dir" not in values:
            values["cache_dir"] = default_cache_dir(environ)
        return cls(**values)

    @property
    def world_size(self) -> int:
        return self.tp_size * self.ep_size

    def to_env(self) -> dict[str, str]:
        """This config as the `SNAPFN_<FIELD>` variables `from_env` reads back to an equal one
        (how rank 0 gives its config to the ranks it starts)."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue  # left out: the default
            if isinstance(value, bool):
                value = "1" if value else "0"
            elif isinstance(value, tuple):
                value = ",".join(str(v) for v in value)
            out[f"SNAPFN_{f.name.upper()}"] = str(value)
        return out

    @property
    def chunk_sizes(self) -> tuple[int, ...]:
        return self.prefill_chunk_sizes or (self.max_num_batched_tokens,)

    def engine_options(self, num_pages: int | None = None, parallel=None):
        # NOTE: imported here, not at module level: InitConfig is built by front doors (and for
        # non-LLM functions) that must not pay for `import torch`.
        from snapfn.handler.llm.build import EngineOptions
        from snapfn.handler.llm.engine.engine import SchedulerConfig
        from snapfn.handler.llm.parallel import ParallelConfig

        return EngineOptions(
            parallel=parallel or ParallelConfig(ep_dispatch=self.ep_dispatch),
            device=self.device,
            dtype=self.dtype,
            backend=self.backend,
            num_pages=num_pages,
            kv_cache_bytes=self.kv_cache_bytes_cpu,
            scheduler=SchedulerConfig(
                page_size=self.page_size,
                max_running_requests=self.max_running_requests,
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                overlap_decode=self.overlap_decode,
                prefill_graph_tokens=self.prefill_graph_tokens,
                prefix_caching=self.prefix_caching,
                preemption=self.preemption,
                speculative_tokens=self.speculative_tokens,
                overlap_speculative=self.overlap_speculative,
            ),
        )


# the least value of each count and size (0: may be off)
_AT_LEAST = {
    "page_size": 1,
    "max_running_requests": 1,
    "max_num_batched_tokens": 1,
    "max_model_len": 2,
    "kv_cache_bytes_cpu": 1,
    "graph_max_batch": 0,
    "graph_max_seq_len": 1,
    "prefill_graph_tokens": 0,
    "speculative_tokens": 0,
    "prewarm_threads": 1,
    "stream_threads": 1,
    "stream_ring_slots": 1,
    "tp_size": 1,
    "ep_size": 1,
}

_BOOLS = {
    "1": True,
    "true": True,
    "on": True,
    "yes": True,
    "0": False,
    "false": False,
    "off": False,
    "no": False,
}


def _parse(type_name: object, raw: str) -> object:
    text = str(type_name)
    if text == "bool":
        if raw.strip().lower() not in _BOOLS:
            raise ValueError(f"expected one of {', '.join(sorted(_BOOLS))}")
        return _BOOLS[raw.strip().lower()]
    if "int" in text and "tuple" not in text:
        return _number(int, raw, "an integer")
    if "float" in text:
        return _number(float, raw, "a number")
    if "tuple" in text:
        return tuple(
            _number(int, x, "integers separated by commas") for x in raw.split(",") if x.strip()
        )
    if "Path" in text:
        return Path(raw)
    return raw


def _number(kind: type, raw: str, wanted: str) -> object:
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"expected {wanted}") from None
