"""Page-cache residency, pre-warm and drop on real files (Linux)."""

from __future__ import annotations

import os
import subprocess

import pytest

from snapfn.snapshot.portable.pagecache import drop, prewarm, residency


def write_synced(path, num_bytes: int):
    with open(path, "wb") as f:
        f.write(os.urandom(num_bytes))
        f.flush()
        os.fsync(f.fileno())  # clean pages: the only kind POSIX_FADV_DONTNEED may drop
    return path


def filesystem_of(path) -> str:
    out = subprocess.run(["df", "--output=fstype", str(path)], capture_output=True, text=True)
    return out.stdout.split()[-1] if out.returncode == 0 else "unknown"


@pytest.fixture
def files(tmp_path):
    return [
        write_synced(tmp_path / "a", 3 << 20),
        write_synced(tmp_path / "b", (1 << 20) + 3),  # odd size: the last page is partial
        write_synced(tmp_path / "empty", 0),
    ]


def test_empty_file_counts_as_resident(tmp_path):
    report = residency([write_synced(tmp_path / "empty", 0)])
    assert (report.num_files, report.total_bytes, report.resident_bytes) == (1, 0, 0)
    assert report.fraction == 1.0


def test_missing_file_raises(tmp_path):
    with pytest.raises(FileNotFoundError):
        residency([tmp_path / "nope"])


def test_prewarm_reads_everything(files):
    report = prewarm(files, num_threads=3, block_bytes=64 << 10)
    total = sum(p.stat().st_size for p in files)
    assert report.num_bytes == total == report.after.total_bytes
    assert report.after.num_files == 3
    assert report.after.fraction >= 0.99
    assert report.after.resident_bytes <= total
    assert report.gbps > 0 and report.elapsed_s > 0


def test_drop_lowers_residency(files):
    warm = prewarm(files).after
    dropped = drop(files)
    after = residency(files)
    if not dropped:
        pytest.skip(
            f"posix_fadvise(DONTNEED) left {after.fraction:.0%} resident on "
            f"{filesystem_of(files[0])} (tmpfs and some overlays ignore it)"
        )
    assert after.resident_bytes < warm.resident_bytes
    assert prewarm(files).before.fraction < warm.fraction  # the next read came from disk


def test_drop_with_nothing_resident(files):
    drop(files)
    assert drop([files[2]])  # an empty file: nothing to drop, nothing left
