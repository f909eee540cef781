"""snapshot/portable/ioprio.py: a thread's I/O class set and read back through the kernel, the
read-ahead's thread put in the idle class, and what a disk's scheduler is."""

from __future__ import annotations

import platform
import threading

import pytest

from snapfn.handler.llm.init_config import InitConfig
from snapfn.snapshot.errors import BadRequest
from snapfn.snapshot.portable import ioprio, pagecache

known = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "aarch64"), reason="ioprio syscall numbers not known"
)


def _in_thread(fn):
    out = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


@known
def test_a_thread_set_idle_reads_back_idle_and_leaves_the_other_threads_alone():
    before = ioprio.thread_class()
    assert _in_thread(lambda: (ioprio.set_thread_class("idle"), ioprio.thread_class())) == (
        None,
        "idle",
    )
    assert ioprio.thread_class() == before != "idle"


@known
def test_the_read_ahead_thread_runs_idle_and_says_so(tmp_path, monkeypatch):
    seen = []
    real = pagecache.ReadAhead._run

    def run(self):
        real(self)
        seen.append(ioprio.thread_class())

    monkeypatch.setattr(pagecache.ReadAhead, "_run", run)
    data = tmp_path / "w.bin"
    data.write_bytes(b"x" * (1 << 20))
    job = pagecache.ReadAhead([data], io_class="idle")
    job._start()
    job.wait(10)
    assert seen == ["idle"] and job.read_bytes == 1 << 20
    figures = job.figures()
    assert figures["io_class"] == "idle" and "scheduler" in figures
    assert "io_class" not in pagecache.ReadAhead([data]).figures()


def test_a_failed_ioprio_call_is_a_figure_not_a_failure(tmp_path, monkeypatch):
    monkeypatch.setattr(
        ioprio, "set_thread_class", lambda name: "ioprio_set: Operation not permitted"
    )
    data = tmp_path / "w.bin"
    data.write_bytes(b"y" * 4096)
    job = pagecache.ReadAhead([data], io_class="idle")
    job._start()
    job.wait(10)
    assert job.read_bytes == 4096
    assert job.figures()["io_class"] == "ioprio_set: Operation not permitted"


def test_the_scheduler_of_a_file_on_no_block_device_is_none(tmp_path):
    assert ioprio.scheduler("/proc/self/status") is None
    assert ioprio.scheduler(tmp_path / "missing") is None


def test_the_setting_takes_normal_or_idle_only():
    assert InitConfig().restore_read_ahead_priority == "normal"
    config = InitConfig.from_env({"SNAPFN_RESTORE_READ_AHEAD_PRIORITY": "idle"})
    assert config.restore_read_ahead_priority == "idle"
    with pytest.raises(BadRequest, match="must be normal or idle, got 'low'"):
        InitConfig.from_env({"SNAPFN_RESTORE_READ_AHEAD_PRIORITY": "low"})
