"""The private-memory census a process checkpoint records (snapshot/process/smaps.py)."""

from __future__ import annotations

import mmap
import os

import pytest

from snapfn.snapshot.process import smaps


def test_census_counts_touched_anonymous_memory_and_names_file_mappings(tmp_path):
    before = smaps.census(os.getpid())
    block = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    block.write(b"x" * (64 << 20))  # every page present
    path = tmp_path / "data.bin"
    path.write_bytes(b"\0" * (4 << 20))
    with open(path, "r+b") as f:
        written = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE)
        written[:] = b"y" * (4 << 20)  # copy-on-write: private pages of a file mapping
        after = smaps.census(os.getpid(), top=50)
        written.close()
    block.close()
    assert after["private_bytes"] - before["private_bytes"] >= (64 + 4) << 20
    assert [str(path), 4 << 20] in after["top"]


def test_census_or_reason_names_a_missing_process():
    found = smaps.census_or_reason(2**22 + 12345)
    assert "error" in found and "FileNotFoundError" in found["error"]


def test_census_of_a_missing_process_raises():
    with pytest.raises(OSError):
        smaps.census(2**22 + 12345)
