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


def finished(job, timeout_s: float = 10.0):
    job.wait(timeout_s)
    assert job._thread is None or not job._thread.is_alive()
    return job.figures()


def test_read_ahead_reads_dropped_files_and_skips_resident_ones(files):
    from snapfn.snapshot.portable.pagecache import read_ahead

    prewarm(files)
    assert finished(read_ahead(files)) == {"skipped": "100% resident already"}
    if not drop(files):
        pytest.skip(f"posix_fadvise(DONTNEED) is ignored on {filesystem_of(files[0])}")
    figures = finished(read_ahead(files))
    assert figures["done"] and figures["read_bytes"] == sum(p.stat().st_size for p in files)
    assert residency(files).fraction >= 0.99


def test_read_ahead_starts_nothing_past_the_free_memory_or_without_files(files, monkeypatch):
    from snapfn.snapshot.portable import pagecache

    drop(files)
    if residency(files).fraction >= pagecache.READ_AHEAD_RESIDENT:
        pytest.skip(f"posix_fadvise(DONTNEED) is ignored on {filesystem_of(files[0])}")
    monkeypatch.setattr(pagecache, "_mem_available", lambda: 1 << 20)  # 1 MB free
    assert "of memory free" in finished(pagecache.read_ahead(files))["skipped"]
    assert pagecache.read_ahead([]).figures() == {"skipped": "no files"}


def test_a_stopped_read_ahead_ends_between_blocks(tmp_path, monkeypatch):
    from snapfn.snapshot.portable import pagecache

    big = write_synced(tmp_path / "big", 8 << 20)
    drop([big])
    if residency([big]).fraction >= pagecache.READ_AHEAD_RESIDENT:
        pytest.skip(f"posix_fadvise(DONTNEED) is ignored on {filesystem_of(big)}")
    monkeypatch.setattr(pagecache, "READ_AHEAD_BLOCK", 1 << 20)
    job = pagecache.ReadAhead([big])
    job.stop()  # before it starts: it reads nothing
    job._start()
    assert finished(job) == {"read_bytes": 0, "done": True, "seconds": job.figures()["seconds"]}


def test_read_ahead_returns_before_it_checks_residency(files, monkeypatch):
    """The residency walk (0.3 s for 16 GB) is the thread's, not the caller's."""
    import threading

    from snapfn.snapshot.portable import pagecache

    checking, release = threading.Event(), threading.Event()

    def slow_residency(paths):
        checking.set()
        release.wait(10)
        return residency(paths)

    monkeypatch.setattr(pagecache, "residency", slow_residency)
    prewarm(files)
    job = pagecache.read_ahead(files)  # returned while its check is still held
    assert checking.wait(10)
    assert job.figures() == {"read_bytes": 0, "done": False}
    release.set()
    assert finished(job) == {"skipped": "100% resident already"}
