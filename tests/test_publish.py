"""Publishing a snapshot: manifest contents, registered digests, misuse, atomic replace, crashes."""

from __future__ import annotations

import fcntl
import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from snapfn.snapshot.errors import BadSnapshot
from snapfn.snapshot.portable import publish
from snapfn.snapshot.portable.compat import FORMAT_VERSION
from snapfn.snapshot.portable.format import (
    MANIFEST,
    chunk_digests,
    read_manifest,
    validate_snapshot,
)
from snapfn.snapshot.portable.publish import SnapshotWriter
from snapfn.snapshot.portable.staging import remove_stale_temp_dirs

from snapshot_samples import BIG, CHUNK, COMPAT, flip_bit, refusal, siblings, write_snapshot


@pytest.fixture
def snap(tmp_path: Path) -> Path:
    return write_snapshot(tmp_path / "snap")


# ---------------------------------------------------------------- publish and validate


def test_publish_then_validate(snap: Path) -> None:
    manifest = validate_snapshot(snap, COMPAT, verify="full")
    assert manifest["format_version"] == FORMAT_VERSION
    assert manifest["marker"] == "one" and manifest["compat"] == COMPAT
    assert manifest["created_at"].endswith("+00:00")
    files = manifest["files"]
    assert list(files) == ["tokenizer.json", "weights/big.bin", "weights/table.json"]
    assert files["weights/table.json"] == {"size": 2, "sha256": hashlib.sha256(b"{}").hexdigest()}
    big = files["weights/big.bin"]
    assert big["size"] == len(BIG) and big["chunk_bytes"] == CHUNK and big["sha256"] is None
    assert big["chunks"] == [
        hashlib.sha256(BIG[i : i + CHUNK]).hexdigest() for i in range(0, len(BIG), CHUNK)
    ]
    assert siblings(snap) == ["snap"]  # no temp dir left behind
    assert validate_snapshot(snap) == read_manifest(snap)


def test_registered_digests_are_trusted_and_checked_in_full_mode(tmp_path: Path) -> None:
    data = os.urandom(3 * 1000 + 7)
    chunks = [hashlib.sha256(data[i : i + 1000]).hexdigest() for i in range(0, len(data), 1000)]
    with SnapshotWriter(tmp_path / "snap") as w:
        (w.root / "rank0.bin").write_bytes(data)
        w.register_chunked("rank0.bin", 1000, chunks, hashlib.sha256(data).hexdigest())
        dest = w.publish({"compat": COMPAT})
    manifest = validate_snapshot(dest, verify="full")
    assert chunk_digests(manifest, "rank0.bin") == (1000, chunks)
    flip_bit(dest / "rank0.bin", 2500)
    assert "'rank0.bin' chunk 2 (bytes 2000..2999) sha256 mismatch" in refusal(
        BadSnapshot, dest, verify="full"
    )


def test_registered_digest_count_must_fit_the_size(tmp_path: Path) -> None:
    expected = "cannot publish 'rank0.bin': 2 chunk digests for 3007 bytes in chunks of 1000"
    with pytest.raises(BadSnapshot, match=expected), SnapshotWriter(tmp_path / "snap") as w:
        (w.root / "rank0.bin").write_bytes(bytes(3007))
        w.register_chunked("rank0.bin", 1000, ["0" * 64] * 2, None)
        w.publish({"compat": COMPAT})
    assert siblings(tmp_path / "snap") == []


def test_publish_refuses_misuse(tmp_path: Path) -> None:
    with SnapshotWriter(tmp_path / "snap") as w:
        with pytest.raises(ValueError, match="set by publish"):
            w.publish({"compat": COMPAT, "files": {}})
        with pytest.raises(ValueError, match="compat"):
            w.publish({"memory_plan": {}})
        with pytest.raises(ValueError, match="escapes"):
            w.register_chunked("../x.bin", 1000, [], None)
        (w.root / MANIFEST).write_text("{}")
        with pytest.raises(ValueError, match="publish\\(\\) writes it"):
            w.publish({"compat": COMPAT})
    assert siblings(tmp_path / "snap") == []


# ---------------------------------------------------------------- atomicity


def test_exception_inside_with_leaves_nothing(tmp_path: Path) -> None:
    dest = tmp_path / "snap"
    with pytest.raises(RuntimeError, match="boom"), SnapshotWriter(dest) as w:
        (w.root / "a.bin").write_bytes(b"a")
        raise RuntimeError("boom")
    assert siblings(dest) == []


def test_exception_inside_with_keeps_the_old_snapshot(snap: Path) -> None:
    with pytest.raises(RuntimeError, match="boom"), SnapshotWriter(snap) as w:
        (w.root / "a.bin").write_bytes(b"a")
        raise RuntimeError("boom")
    assert validate_snapshot(snap)["marker"] == "one" and siblings(snap) == ["snap"]


def test_leaving_without_publish_leaves_nothing(tmp_path: Path) -> None:
    with SnapshotWriter(tmp_path / "snap") as w:
        (w.root / "a.bin").write_bytes(b"a")
    assert siblings(tmp_path / "snap") == []


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2-exchange", "rename-aside"])
def test_replace_is_never_half_visible(
    snap: Path, monkeypatch: pytest.MonkeyPatch, exchange: bool
) -> None:
    """At every rename publish makes, `snap` is the old snapshot, the new one, or (fallback only)
    absent; never a directory that fails validation."""
    seen: list[str] = []

    def observe() -> None:
        if not os.path.lexists(snap):
            seen.append("absent")
            return
        seen.append(validate_snapshot(snap, verify="full")["marker"])

    real_exchange, real_rename = publish._exchange, os.rename

    def spying_exchange(first: Path, second: Path) -> bool:
        observe()
        swapped = real_exchange(first, second) if exchange else False
        observe()
        return swapped

    def spying_rename(src, dst) -> None:
        observe()
        real_rename(src, dst)
        observe()

    monkeypatch.setattr(publish, "_exchange", spying_exchange)
    monkeypatch.setattr(publish.os, "rename", spying_rename)
    write_snapshot(snap, marker="two")
    monkeypatch.undo()
    assert validate_snapshot(snap, verify="full")["marker"] == "two"
    assert siblings(snap) == ["snap"]
    if exchange:
        assert seen == ["one", "two"]
    else:
        assert seen == ["one", "one", "one", "absent", "absent", "two"]


def test_concurrent_reader_always_finds_a_snapshot(snap: Path) -> None:
    if not publish._exchange(snap, snap):  # swapping a path with itself probes for support
        pytest.skip("filesystem without renameat2(RENAME_EXCHANGE)")
    stop, failures = threading.Event(), []

    def read_forever() -> None:
        while not stop.is_set():
            try:
                read_manifest(snap)
            except BadSnapshot as e:
                failures.append(str(e))
            time.sleep(0)  # let the writer thread have the GIL between reads

    reader = threading.Thread(target=read_forever)
    reader.start()
    try:
        for i in range(20):
            write_snapshot(snap, marker=f"v{i}")
    finally:
        stop.set()
        reader.join()
    assert failures == []
    assert validate_snapshot(snap)["marker"] == "v19"


def test_refuses_to_replace_a_directory_that_is_not_a_snapshot(tmp_path: Path) -> None:
    dest = tmp_path / "home"
    dest.mkdir()
    (dest / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a snapshot"):
        write_snapshot(dest)
    assert os.listdir(dest) == ["precious.txt"] and siblings(dest) == ["home"]


# ---------------------------------------------------------------- crashed writers

CRASHING_WRITER = """
import sys, time
from pathlib import Path
from snapfn.snapshot.portable import publish

dest, stage = Path(sys.argv[1]), sys.argv[2]
if stage == "before-install":
    publish._install = lambda staged, dest: time.sleep(600)
with publish.SnapshotWriter(dest) as w:
    (w.root / "first.bin").write_bytes(b"x" * 1000)
    if stage == "between-files":
        print(w.root, flush=True)
        time.sleep(600)
    (w.root / "second.bin").write_bytes(b"y" * 1000)
    print(w.root, flush=True)
    w.publish({"compat": {"device_type": "cpu"}, "marker": "crashed"})
"""


def kill_writer_mid_way(dest: Path, stage: str) -> Path:
    """Run a writer in a child, SIGKILL it at `stage`, reap it; return its temp dir."""
    child = subprocess.Popen(
        [sys.executable, "-c", CRASHING_WRITER, str(dest), stage], stdout=subprocess.PIPE, text=True
    )
    try:
        temp = Path(child.stdout.readline().strip())
        deadline = time.monotonic() + 30
        while stage == "before-install" and not (temp / MANIFEST).exists():
            assert time.monotonic() < deadline and child.poll() is None, "writer never got there"
            time.sleep(0.01)  # publish is hashing; then it writes the manifest and blocks
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
    assert temp.name.startswith(f".{dest.name}.tmp-{child.pid}-") and temp.is_dir()
    return temp


def test_crash_between_files_never_publishes(tmp_path: Path) -> None:
    dest = tmp_path / "snap"
    temp = kill_writer_mid_way(dest, "between-files")
    assert "no snapshot directory" in refusal(BadSnapshot, dest)
    write_snapshot(dest)
    assert not temp.exists() and siblings(dest) == ["snap"]


def test_crash_before_install_keeps_the_old_snapshot(snap: Path) -> None:
    temp = kill_writer_mid_way(snap, "before-install")
    assert validate_snapshot(snap, verify="full")["marker"] == "one"
    assert remove_stale_temp_dirs(snap) == [temp]
    assert siblings(snap) == ["snap"]


def test_live_or_locked_temp_dirs_are_left_alone(tmp_path: Path) -> None:
    dest = tmp_path / "snap"
    dead = subprocess.Popen(["true"])
    dead.wait()
    live = tmp_path / f".snap.tmp-{os.getpid()}-{'a' * 16}"
    locked = tmp_path / f".snap.tmp-{dead.pid}-{'b' * 16}"
    stale = tmp_path / f".snap.tmp-{dead.pid}-{'c' * 16}"
    unrelated = tmp_path / f".snap.tmp-x.tmp-{dead.pid}-{'d' * 16}"
    for path in (live, locked, stale, unrelated):
        path.mkdir()
    fd = os.open(locked, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert remove_stale_temp_dirs(dest) == [stale]
    finally:
        os.close(fd)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in (live, locked, unrelated)
    )
