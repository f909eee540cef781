"""The keeper's held process image files (snapshot/keeper/verified_images.py): hashed once under
read leases, answered as verified only while nothing could have changed them — a writer's
open breaks the lease and every file is forgotten before it can write a byte; a replaced file,
another manifest entry or a file open for writing at the start is never answered."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from test_keeper import serving

from snapfn.snapshot.errors import BadSnapshot, SnapfnError
from snapfn.snapshot.keeper import client as keeper
from snapfn.snapshot.keeper.daemon import Keeper
from snapfn.snapshot.keeper.pinned_cache import PinnedCache
from snapfn.snapshot.keeper.verified_images import VerifiedImages, ask
from snapfn.snapshot.portable.format import read_manifest
from snapfn.snapshot.portable.publish import SnapshotWriter

from snapshot_samples import COMPAT

IMAGES = {"process/memory.bin": 3 << 20, "process/pages-1.img": 2 << 20, "process/core-1.img": 64}


@pytest.fixture
def images():
    """A VerifiedImages whose SIGIO handler is this process's for the test (pytest's main
    thread), closed and the handler put back after."""
    before = signal.getsignal(signal.SIGIO)
    made = VerifiedImages.install()
    yield made
    made.drop()
    signal.signal(signal.SIGIO, before)


def lease_problem(folder: Path) -> str | None:
    """Why a read lease cannot be taken on a file in `folder` (its file system, this user), or
    None: what the keeper needs to hold image files."""
    import fcntl

    probe = folder / ".lease-probe"
    probe.write_bytes(b"x")
    fd = os.open(probe, os.O_RDONLY)
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        return None
    except OSError as exc:
        return f"no read lease on {folder}'s file system: {exc.strerror}"
    finally:
        os.close(fd)
        probe.unlink()


@pytest.fixture
def snap(tmp_path) -> Path:
    problem = lease_problem(tmp_path)
    if problem is not None:
        pytest.skip(problem)
    with SnapshotWriter(tmp_path / "snap") as w:
        (w.root / "process").mkdir()
        for relpath, size in IMAGES.items():
            (w.root / relpath).write_bytes(os.urandom(size))
        (w.root / "tokenizer.json").write_text("{}")
        return w.publish({"compat": COMPAT})


def asked(snap: Path, relpaths=IMAGES) -> dict:
    return ask(snap, read_manifest(snap)["files"], relpaths)


def _write_elsewhere(path: Path) -> None:
    """Open `path` for writing in another process and change one byte (its open waits while
    a lease is broken)."""
    code = (
        "import sys\nwith open(sys.argv[1], 'r+b') as f:\n"
        "    b = f.read(1)[0]\n    f.seek(0)\n    f.write(bytes([b ^ 0x55]))"
    )
    subprocess.run([sys.executable, "-c", code, str(path)], check=True, timeout=60)


def test_held_files_are_verified_until_a_writer_opens_one(images, snap):
    assert images.hold(snap) == (3, sum(IMAGES.values()))
    assert sorted(images.verified(asked(snap))) == sorted(str(snap / p) for p in IMAGES)
    _write_elsewhere(snap / "process" / "pages-1.img")  # waits for the keeper's SIGIO handler
    assert images.verified(asked(snap)) == [] and len(images) == 0  # every file forgotten


def test_a_replaced_file_or_another_manifest_entry_is_not_verified(images, snap):
    images.hold(snap)
    question = asked(snap)
    other = dict(question)
    other[str(snap / "process/core-1.img")] = {**question[str(snap / "process/core-1.img")]}
    other[str(snap / "process/core-1.img")]["entry"] = "0" * 64  # another manifest's entry
    assert str(snap / "process/core-1.img") not in images.verified(other)
    replacement = snap / "process" / "replacement"
    replacement.write_bytes((snap / "process/memory.bin").read_bytes())
    os.replace(replacement, snap / "process/memory.bin")  # the same bytes, another inode
    assert sorted(images.verified(asked(snap))) == sorted(
        str(snap / p) for p in IMAGES if p != "process/memory.bin"
    )


def test_a_tampered_file_or_one_open_for_writing_is_not_held(images, snap):
    memory = snap / "process/memory.bin"
    with open(memory, "r+b") as writer:
        with pytest.raises(SnapfnError, match="open for writing elsewhere"):
            images.hold(snap)
        writer.write(b"\xff\xfe")
    with pytest.raises(BadSnapshot, match="process/memory.bin.*sha256 mismatch"):
        images.hold(snap)
    assert len(images) == 0
    held_fds = [fd for fd in os.listdir("/proc/self/fd") if _points_into(fd, snap)]
    assert held_fds == []  # the leased files were closed again


def _points_into(fd: str, snap: Path) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith(str(snap))
    except OSError:
        return False


def test_a_break_while_the_lock_is_taken_drops_the_files_when_it_is_let_go(images, snap):
    images.hold(snap)
    taken, release = threading.Event(), threading.Event()

    def hold_the_lock() -> None:
        with images._lock:
            taken.set()
            release.wait(10)

    thread = threading.Thread(target=hold_the_lock)
    thread.start()
    taken.wait(10)
    images._on_break()  # what SIGIO does: the lock is another thread's
    release.set()
    thread.join(10)
    assert images.verified(asked(snap)) == []  # untrusted at once, closed now
    assert len(images) == 0 and not [
        fd for fd in os.listdir("/proc/self/fd") if _points_into(fd, snap)
    ]


def test_the_keeper_answers_only_what_it_holds(images, snap, tmp_path):
    images.hold(snap)
    address = str(tmp_path / "k" / "keeper.sock")
    stop, thread = serving(Keeper(PinnedCache("memfd"), cuda=False, images=images), address)
    try:
        question = asked(snap)
        question["/elsewhere/memory.bin"] = {"stamp": [1, 2, 3, 4, 5], "entry": "0" * 64}
        assert keeper.verified_images(address, question) == {str(snap / p) for p in IMAGES}
        bare = str(tmp_path / "b" / "keeper.sock")
        stop_bare, thread_bare = serving(Keeper(PinnedCache("memfd"), cuda=False), bare)
        try:
            assert keeper.verified_images(bare, question) == set()  # holds none
        finally:
            stop_bare.set()
            thread_bare.join(5)
    finally:
        stop.set()
        thread.join(5)
    assert keeper.verified_images(address, question) == set()  # no keeper: none, no error


def test_install_needs_the_main_thread():
    failed = []
    thread = threading.Thread(target=lambda: _catch(failed))
    thread.start()
    thread.join(10)
    assert failed and "main thread" in failed[0]


def _catch(failed: list) -> None:
    try:
        VerifiedImages.install()
    except ValueError as exc:
        failed.append(str(exc))


def test_the_bytes_hashed_are_the_leased_files_even_when_their_folder_is_swapped(
    images, snap, monkeypatch
):
    """A folder swapped in while the keeper hashes (and back before it re-stats) cannot make it
    vouch for a tampered file: it hashes through the fds it leased, not by path again."""
    from snapfn.snapshot.keeper import verified_images

    tampered = snap / "process/pages-1.img"
    good = snap.parent / "good"
    good.mkdir()
    for relpath in IMAGES:
        os.link(snap / relpath, good / Path(relpath).name)
    (good / "pages-1.img").unlink()
    (good / "pages-1.img").write_bytes(tampered.read_bytes())
    data = bytearray(tampered.read_bytes())
    data[7] ^= 0xFF
    tampered.write_bytes(bytes(data))  # in place: the manifest's entry no longer matches it
    aside = snap.parent / "aside"
    lease, verify = verified_images._lease, verified_images._verify_held
    leased: list[str] = []

    def lease_then_swap(path, entry, generation):
        held = lease(path, entry, generation)
        leased.append(str(path))
        if len(leased) == len(IMAGES):  # the good copies in the tampered folder's place
            os.rename(snap / "process", aside)
            os.rename(good, snap / "process")
        return held

    def verify_then_swap_back(*args, **kwargs):
        try:
            return verify(*args, **kwargs)
        finally:
            os.rename(snap / "process", good)
            os.rename(aside, snap / "process")

    monkeypatch.setattr(verified_images, "_lease", lease_then_swap)
    monkeypatch.setattr(verified_images, "_verify_held", verify_then_swap_back)
    with pytest.raises(BadSnapshot, match="process/pages-1.img.*sha256 mismatch"):
        images.hold(snap)
    assert len(images) == 0


def test_a_fifo_in_place_of_an_image_file_is_refused_at_once(images, snap):
    core = snap / "process/core-1.img"
    core.unlink()
    os.mkfifo(core)
    failed: list[Exception] = []
    thread = threading.Thread(target=lambda: _hold_into(images, snap, failed), daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "hold waited on a FIFO"
    assert failed and "not a regular file" in str(failed[0])


def _hold_into(images: VerifiedImages, snap: Path, failed: list) -> None:
    try:
        images.hold(snap)
    except SnapfnError as exc:
        failed.append(exc)


def test_the_keeper_answers_malformed_requests_in_one_line(tmp_path):
    import json
    import socket

    address = str(tmp_path / "k" / "keeper.sock")
    stop, thread = serving(Keeper(PinnedCache("memfd"), cuda=False), address)
    try:
        deep = b'{"op": "verified", "files": ' + b"[" * 5000 + b"]" * 5000 + b"}"
        for request in (deep, b'{"op": ["verified"]}', b'{"op": "verified", "files": [1]}'):
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
                sock.settimeout(5)
                sock.connect(address)
                sock.send(request)
                reply = json.loads(sock.recv(1 << 16))
            reason = reply["reason"]
            assert reply["ok"] is False and ("bad request" in reason or "files is not" in reason)
            assert "\n" not in reason and len(reason) < 300, reason
    finally:
        stop.set()
        thread.join(5)
