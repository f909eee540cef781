"""Sample snapshots for the format and publish tests: a writer, a one-line-refusal check, a flip.

`write_snapshot` publishes a small snapshot with one file split into 5 chunks of `CHUNK` bytes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from snapfn.snapshot.portable.compat import FORMAT_VERSION
from snapfn.snapshot.portable.format import validate_snapshot
from snapfn.snapshot.portable.publish import SnapshotWriter

CHUNK = 1024
COMPAT = {"format_version": FORMAT_VERSION, "device_type": "cpu", "machine": "x86_64"}
BIG = bytes(range(256)) * 20  # 5120 bytes: 5 chunks of CHUNK


def write_snapshot(dest: Path, marker: str = "one", **fields) -> Path:
    with SnapshotWriter(dest, chunk_bytes=CHUNK) as w:
        (w.root / "tokenizer.json").write_text(json.dumps({"marker": marker}))
        (w.root / "weights").mkdir()
        (w.root / "weights" / "table.json").write_text("{}")
        (w.root / "weights" / "big.bin").write_bytes(BIG)
        return w.publish({"compat": COMPAT, "marker": marker, **fields})


def refusal(exc_type: type[Exception], snapshot: Path, **kwargs) -> str:
    with pytest.raises(exc_type) as info:
        validate_snapshot(snapshot, **kwargs)
    message = str(info.value)
    assert "\n" not in message and "\r" not in message, message
    return message


def flip_bit(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def siblings(dest: Path) -> list[str]:
    return sorted(os.listdir(dest.parent))
