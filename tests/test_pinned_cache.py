"""The pinned-copy keeper's protocol on CPU (memfd copies standing in for pinned CUDA host
allocations): a file is served by its identity, a changed or unknown file is refused with the
reason, no keeper is a quick miss, a lease that is not a whole copy of the file asked for is a
miss too; and `snapfn pin` as a process. The CUDA copies and the helper's fill from them:
tests/test_process_gpu.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from snapfn.snapshot.keeper import pinned_cache
from snapfn.snapshot.keeper.client import request
from snapfn.snapshot.keeper.daemon import Keeper
from snapfn.snapshot.keeper.pinned_cache import Lease, Miss, PinnedCache


@pytest.fixture
def keeper(tmp_path):
    weights = tmp_path / "weights.bin"
    weights.write_bytes(os.urandom((3 << 20) + 77))
    cache = PinnedCache("memfd")
    cache.add(weights)
    address, stop = str(tmp_path / "k.sock"), threading.Event()
    thread = threading.Thread(
        target=Keeper(cache, cuda=False).serve, args=(address, stop), daemon=True
    )
    thread.start()
    _wait_for(lambda: os.path.exists(address))
    yield address, weights
    stop.set()
    thread.join(5)
    cache.close()
    assert not os.path.exists(address)  # the keeper removes its socket


def _wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def _read_all(fd: int, size: int) -> bytes:
    return os.pread(fd, size, 0)


def test_a_pinned_file_is_served_by_its_identity(keeper):
    address, weights = keeper
    lease = request(address, weights)
    assert isinstance(lease, Lease), lease
    try:
        assert (lease.size, lease.location) == (weights.stat().st_size, "memfd")
        assert _read_all(lease.fd, lease.size) == weights.read_bytes()
    finally:
        os.close(lease.fd)
    link = weights.parent / "same-file"  # another name of the same file is the same file
    link.hardlink_to(weights)
    second = request(address, link)
    assert isinstance(second, Lease)
    os.close(second.fd)


def test_a_changed_or_unknown_file_or_no_keeper_is_a_miss_with_the_reason(keeper, tmp_path):
    address, weights = keeper
    other = tmp_path / "other.bin"
    other.write_bytes(b"x" * 4096)
    assert request(address, other) == Miss("this file is not pinned here")
    data = bytearray(weights.read_bytes())
    data[0] ^= 0xFF
    weights.write_bytes(bytes(data))  # same inode, same size, newer modification time
    os.utime(weights, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert "changed since it was pinned" in request(address, weights).reason
    assert request(str(tmp_path / "none.sock"), weights).reason.startswith("no keeper at")
    assert request("", weights).reason == "no keeper at (none configured)"


def test_a_bad_request_is_answered_and_the_keeper_keeps_serving(keeper):
    address, weights = keeper
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(5)
        sock.connect(address)
        sock.send(b'{"path": "nope"}')
        assert b"bad request" in sock.recv(1 << 16)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(5)
        sock.connect(address)
        sock.send(b'{"op": "reboot"}')
        assert b"unknown op 'reboot'" in sock.recv(1 << 16)
    lease = request(address, weights)
    assert isinstance(lease, Lease)
    os.close(lease.fd)


def _answer_once(address: str, reply: dict, fd_bytes: int) -> threading.Thread:
    """A keeper of this user that answers one "file" request with `reply` and a memfd."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(address)
    listener.listen(1)

    def answer() -> None:
        with listener:
            conn, _ = listener.accept()
            fd = os.memfd_create("fake")
            os.ftruncate(fd, fd_bytes)
            with conn:
                conn.recv(1 << 16)
                socket.send_fds(conn, [json.dumps(reply).encode()], [fd])
            os.close(fd)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    return thread


def test_a_lease_that_is_not_a_whole_copy_of_the_file_asked_for_is_a_miss(tmp_path):
    weights = tmp_path / "weights.bin"
    weights.write_bytes(b"w" * 8192)
    asked = pinned_cache.FileIdentity.of(weights).to_json()
    good = {"ok": True, "identity": asked, "size": 8192, "alloc_bytes": 8192, "location": "memfd"}
    cases = [
        ({**good, "identity": {**asked, "ino": asked["ino"] + 1}}, 8192, "not of the file asked"),
        ({**good, "size": 4096}, 8192, "a copy of 4096 bytes of a file of 8192"),
        ({**good, "alloc_bytes": 4096}, 8192, "an allocation of 4096 bytes for 8192"),
        ({**good, "location": "device"}, 8192, "a copy in 'device'"),
        (good, 100, "a memfd of 100 bytes for 8192"),
        ({**good, "size": "many"}, 8192, "invalid literal"),
    ]
    for n, (reply, fd_bytes, reason) in enumerate(cases):
        address = str(tmp_path / f"k{n}.sock")
        thread = _answer_once(address, reply, fd_bytes)
        miss = request(address, weights)
        thread.join(5)
        assert isinstance(miss, Miss), reply
        assert (
            miss.reason.startswith(f"keeper at {address} answered badly: ")
            and reason in miss.reason
        )
    fds_before = len(os.listdir("/proc/self/fd"))
    address = str(tmp_path / "good.sock")
    thread = _answer_once(address, good, 8192)
    lease = request(address, weights)
    thread.join(5)
    assert isinstance(lease, Lease) and lease.size == 8192
    os.close(lease.fd)
    assert len(os.listdir("/proc/self/fd")) == fds_before  # every refused lease's fd was closed


def test_restores_look_for_the_keeper_where_snapfn_pin_serves_by_default(tmp_path):
    from snapfn.snapshot.process.worker_process import ProcessConfig

    environ = {"XDG_RUNTIME_DIR": str(tmp_path)}
    expected = str(tmp_path / f"snapfn-{os.geteuid()}" / "keeper.sock")
    assert pinned_cache.default_socket(environ) == expected
    assert ProcessConfig.from_env(environ).pinned_socket == expected
    assert ProcessConfig.from_env({"SNAPFN_PINNED_SOCKET": ""}).pinned_socket == ""
    assert pinned_cache.default_socket({}) == f"/tmp/snapfn-{os.geteuid()}/keeper.sock"
    # the keeper makes that directory, private, and a restore finds it there
    weights = tmp_path / "weights.bin"
    weights.write_bytes(b"w" * 4096)
    cache, stop = PinnedCache("memfd"), threading.Event()
    cache.add(weights)
    thread = threading.Thread(
        target=Keeper(cache, cuda=False).serve, args=(expected, stop), daemon=True
    )
    thread.start()
    try:
        _wait_for(lambda: os.path.exists(expected))
        st = os.stat(os.path.dirname(expected))
        assert (st.st_mode & 0o777, st.st_uid) == (0o700, os.geteuid())
        assert os.stat(expected).st_mode & 0o777 == 0o600
        assert _leased(expected, weights)
    finally:
        stop.set()
        thread.join(5)
        cache.close()


def test_snapfn_pin_refuses_a_snapshot_without_weight_regions(tmp_path):
    from snapfn.snapshot.errors import BadSnapshot

    with pytest.raises(BadSnapshot, match="no snapshot directory"):
        pinned_cache.files_to_pin(tmp_path / "missing")


def test_snapfn_pin_serves_until_stopped(tmp_path):
    weights = tmp_path / "snap" / "weights" / "rank0.bin"
    weights.parent.mkdir(parents=True)
    weights.write_bytes(os.urandom(1 << 20))
    address = str(tmp_path / "pin.sock")
    code = (
        "import sys; from pathlib import Path; from snapfn.snapshot.keeper import pinned_cache as p;"
        f"p.files_to_pin = lambda d: [Path({str(weights)!r})];"
        "from snapfn.handler.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    argv = [sys.executable, "-c", code, "pin", "--snapshot", str(tmp_path / "snap")]
    keeper = subprocess.Popen(
        argv + ["--socket", address, "--backend", "memfd"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for(lambda: os.path.exists(address) or keeper.poll() is not None)
        lease = request(address, weights)
        assert isinstance(lease, Lease), lease
        assert _read_all(lease.fd, lease.size) == weights.read_bytes()
        os.close(lease.fd)
    finally:
        keeper.terminate()
        _, err = keeper.communicate(timeout=10)
    assert keeper.returncode == 0, err
    assert "1 files, 0.00 GB pinned" in err and f"serving on {address}" in err
    assert not Path(address).exists()


def test_a_second_keeper_does_not_take_over_a_live_one_but_replaces_a_stale_socket(
    keeper, tmp_path
):
    from snapfn.snapshot.errors import RestoreFailed

    address, weights = keeper
    with pytest.raises(RestoreFailed, match="already serves"):
        Keeper(PinnedCache("memfd"), cuda=False).serve(address)
    assert _leased(address, weights)  # the first one still answers
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as dead:
        dead.bind(str(stale))  # a socket file nobody listens on (a keeper that was killed)
    cache, stop = PinnedCache("memfd"), threading.Event()
    cache.add(weights)
    serve = Keeper(cache, cuda=False).serve
    thread = threading.Thread(target=serve, args=(str(stale), stop), daemon=True)
    thread.start()
    _wait_for(lambda: _leased(str(stale), weights))
    stop.set()
    thread.join(5)
    cache.close()


def _leased(address: str, path: Path) -> bool:
    """Whether the keeper at `address` hands out `path` (the fd is closed again)."""
    lease = request(address, path)
    if isinstance(lease, Lease):
        os.close(lease.fd)
        return True
    return False
