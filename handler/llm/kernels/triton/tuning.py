"""Which config each autotuned Triton kernel runs, chosen without timing anything on the way
to a request.

A kernel made by `kernels.autotuned` has several configs (block sizes, warps, pipeline
depth); the first call of each `(kernel, key)` (the key: the shapes and flags its `key`
names, and its tensors' dtypes) decides which one it runs from then on:

1. **pinned**: the config the init phase chose, recorded in the snapshot (`kernel_choices` of
   its section) and pinned before a restore's first kernel runs (`pin_choices`). A restore
   runs exactly the init's configs — the same bits — and times nothing.
2. With SNAPFN_KERNEL_TUNING=init: **tuned**, timed over the kernel's configs by triton's
   autotuner right there (the tables below are not read). Calls happen in the init phase's
   warmup and graph capture (the engine runs each bucket once before capturing it), and the
   timings land in the compile cache the snapshot carries.
3. With the default, SNAPFN_KERNEL_TUNING=shipped, nothing is timed: **shipped**, the config
   of the tuned table for this GPU (`tuned/<gpu>.json` beside this module, made by
   `snapfn tune` on the machine its name says, then each file of SNAPFN_TUNED_CONFIGS,
   `FILE[:FILE...]`, later files win), else **default**, the kernel's untuned default config.
   A kernel compiles one config per key.

Every choice is recorded (`recorded_choices`): the init's go into the snapshot, their count
by source into the startup manifest (`choice_counts`), and `snapfn tune` writes them out as a
table. Configs are named by `config_id` (`BLOCK_K=128,BLOCK_N=8,w4,s3`); a pinned or shipped
name that is not one of the kernel's own configs is refused, so a snapshot can only choose
among the configs the code declares.

NOTE: the tuning in force is process-wide, like the autotuners' own caches: the runtime_env
stage sets it (`use_tuning`) before the first kernel runs. This module imports neither torch
nor triton.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from snapfn.snapshot.errors import BadRequest, BadSnapshot

MODES = ("shipped", "init")
SOURCES = ("pinned", "shipped", "tuned", "default")
TABLES_DIR = Path(__file__).parent / "tuned"
MAX_CHOICES = 100_000  # a snapshot's kernel_choices: far more than any model makes
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")

Table = dict[str, dict[str, str]]  # kernel name → key → config id


def config_id(kwargs: Mapping[str, Any], num_warps: int, num_stages: int) -> str:
    """A config's name: its constexpr values in name order, then warps and stages."""
    values = ",".join(f"{k}={kwargs[k]}" for k in sorted(kwargs))
    return f"{values + ',' if values else ''}w{num_warps},s{num_stages}"


def gpu_slug(gpu_name: str) -> str:
    """`NVIDIA H200` → `nvidia-h200`: the name of that GPU's shipped table."""
    return re.sub(r"[^a-z0-9]+", "-", gpu_name.lower()).strip("-")


@dataclass(frozen=True)
class KernelTuning:
    """How untimed choices are made: `mode` ("shipped" or "init") and the extra tables."""

    mode: str = "shipped"
    table_files: tuple[Path, ...] = ()

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise BadRequest(
                f"SNAPFN_KERNEL_TUNING must be one of {', '.join(MODES)}, not {self.mode!r}"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> KernelTuning:
        files = [f for f in environ.get("SNAPFN_TUNED_CONFIGS", "").split(":") if f]
        return cls(environ.get("SNAPFN_KERNEL_TUNING") or "shipped", tuple(map(Path, files)))

    @property
    def times_configs(self) -> bool:
        return self.mode == "init"

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "tables": [str(f) for f in self.table_files]}


@dataclass
class _State:
    tuning: KernelTuning = field(default_factory=KernelTuning)
    pinned: Table = field(default_factory=dict)
    tables: dict[str, Table] = field(default_factory=dict)  # gpu slug → merged table
    choices: dict[tuple[str, str], tuple[str, str]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


_STATE = _State()


def use_tuning(tuning: KernelTuning) -> None:
    """Make `tuning` the process's; its tables are read at the first choice that needs them."""
    with _STATE.lock:
        _STATE.tuning, _STATE.tables = tuning, {}


def current_tuning() -> KernelTuning:
    return _STATE.tuning


def pin_choices(choices: Iterable[Mapping[str, str]]) -> int:
    """Pin recorded choices (a snapshot's `kernel_choices`, already `parse_choices`d); returns
    how many. Pins replace earlier pins of the same (kernel, key)."""
    count = 0
    with _STATE.lock:
        for c in choices:
            _STATE.pinned.setdefault(c["kernel"], {})[c["key"]] = c["config"]
            count += 1
    return count


def choose(kernel: str, key: str, config_ids: list[str], gpu_name: str) -> tuple[str | None, str]:
    """(config id, source) for the first call of `kernel` with `key`, among `config_ids` (the
    configs left after the kernel's pruning, in declared order; the first is its default);
    (None, "tuned") where the caller must time them. BadSnapshot for a pinned config that is
    not among them."""
    pinned = _STATE.pinned.get(kernel, {}).get(key)
    if pinned is not None:
        if pinned not in config_ids:
            raise BadSnapshot(
                f"kernel_choices: {kernel} {key}: config {pinned!r} is not one of its configs "
                f"({', '.join(config_ids)})"
            )
        return pinned, "pinned"
    if _STATE.tuning.times_configs:
        return None, "tuned"
    shipped = _table(gpu_name).get(kernel, {}).get(key)
    if shipped is not None and shipped in config_ids:
        return shipped, "shipped"
    return config_ids[0], "default"


def record(kernel: str, key: str, config: str, source: str) -> None:
    with _STATE.lock:
        _STATE.choices[(kernel, key)] = (config, source)


def recorded_choices() -> list[dict[str, str]]:
    """Every choice made in this process, sorted: {kernel, key, config, source}."""
    with _STATE.lock:
        items = sorted(_STATE.choices.items())
    return [{"kernel": k, "key": key, "config": c, "source": s} for (k, key), (c, s) in items]


def choice_counts() -> dict[str, int]:
    """How many (kernel, key) choices each source made, for the startup manifest."""
    counts = Counter(source for _, source in _STATE.choices.values())
    return {source: counts[source] for source in SOURCES if counts[source]}


def forget_choices() -> None:
    """Back to a fresh process's state (pins, records, tables; the tuning stays)."""
    with _STATE.lock:
        _STATE.pinned.clear()
        _STATE.choices.clear()
        _STATE.tables.clear()


def parse_choices(value: Any, where: str = "kernel_choices") -> list[dict[str, str]]:
    """A snapshot's `kernel_choices`, shape-checked: a list of {kernel, key, config[, source]}
    of short strings; BadSnapshot naming the first entry that is not."""
    if not isinstance(value, list) or len(value) > MAX_CHOICES:
        raise BadSnapshot(f"{where} must be a list of at most {MAX_CHOICES} choices")
    out = []
    for i, entry in enumerate(value):
        if not isinstance(entry, dict) or not {"kernel", "key", "config"} <= set(entry):
            raise BadSnapshot(f"{where}[{i}] must be an object with kernel, key and config")
        kernel, key, config = entry["kernel"], entry["key"], entry["config"]
        if not (isinstance(kernel, str) and _NAME.match(kernel)):
            raise BadSnapshot(f"{where}[{i}].kernel must be a kernel's name, not {kernel!r}")
        for name, text in (("key", key), ("config", config)):
            if not isinstance(text, str) or not 0 < len(text) <= 512:
                raise BadSnapshot(f"{where}[{i}].{name} must be a string of 1 to 512 characters")
        out.append({"kernel": kernel, "key": key, "config": config})
    return out


def read_table(path: Path) -> Table:
    """A tuned table's `kernels` ({kernel: {key: config id}}); BadRequest naming the file if it
    cannot be read or is not one."""
    try:
        data = json.loads(Path(path).read_text())
        kernels = data["kernels"]
        choices = [
            {"kernel": k, "key": key, "config": c}
            for k, by_key in kernels.items()
            for key, c in by_key.items()
        ]
        parse_choices(choices, str(path))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, BadSnapshot) as exc:
        raise BadRequest(f"tuned configs {path}: not a table of kernel configs ({exc})") from None
    return {k: dict(by_key) for k, by_key in kernels.items()}


def write_table(path: Path, choices: Iterable[Mapping[str, str]], about: dict[str, Any]) -> int:
    """Merge `choices` into the table at `path` (created if missing; the new choice wins) and
    write it atomically; returns the number of (kernel, key) entries it holds."""
    path = Path(path)
    table = read_table(path) if path.exists() else {}
    for c in choices:
        table.setdefault(c["kernel"], {})[c["key"]] = c["config"]
    ordered = {k: dict(sorted(table[k].items())) for k in sorted(table)}
    text = json.dumps({**about, "kernels": ordered}, indent=1) + "\n"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return sum(len(v) for v in ordered.values())


def _table(gpu_name: str) -> Table:
    slug = gpu_slug(gpu_name)
    with _STATE.lock:
        if slug not in _STATE.tables:
            merged: Table = {}
            files = [TABLES_DIR / f"{slug}.json", *_STATE.tuning.table_files]
            for i, path in enumerate(files):
                if i == 0 and not path.exists():  # no shipped table for this GPU
                    continue
                for kernel, by_key in read_table(path).items():
                    merged.setdefault(kernel, {}).update(by_key)
            _STATE.tables[slug] = merged
        return _STATE.tables[slug]
