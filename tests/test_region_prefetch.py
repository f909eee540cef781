"""The restorer-side region prefetch (snapshot/keeper/region_prefetch.py, region_fill.py): specs, and the hand-over of
region fds to the worker over a unix socket, only between processes of one user (or root) in a
private directory. The CUDA half (cuMemCreate, fills, imports) runs in tests/test_process_gpu.py
on a GPU; here the regions are memfds standing in for CUDA handles."""

from __future__ import annotations

import json
import os
import re
import socket
import threading

import pytest

from snapfn.snapshot.keeper import region_prefetch
from snapfn.snapshot.keeper.region_fill import RegionPrefetch, _Made
from snapfn.snapshot.keeper.region_prefetch import PrefetchHelper, RegionSpec, prefetch_doc

from test_unix_socket import (
    NOBODY,
    foreign_client,
    foreign_listener,
    needs_root,
    open_up,
    reachable_dir,
)

MiB = 1 << 20


def spec(**overrides) -> dict:
    doc = {"name": "weights", "address": 0x7F0000000000, "nbytes": 4 * MiB, "device": 0}
    doc.update(fill="file", path="weights/rank0.bin")
    doc.update(overrides)
    return doc


def test_spec_round_trips_and_refuses_what_a_restorer_must_not_do():
    s = RegionSpec.from_json(spec())
    assert RegionSpec.from_json(s.to_json()) == s
    assert "path" not in RegionSpec.from_json(spec(fill="zero", path="")).to_json()
    ranged = RegionSpec.from_json(spec(offset=6 * MiB))  # one run of a function's memory image
    assert ranged.offset == 6 * MiB and RegionSpec.from_json(ranged.to_json()) == ranged
    assert "offset" not in s.to_json()
    for bad, message in [
        (spec(offset=-1), "negative"),
        (spec(fill="ones"), "fill 'ones'"),
        (spec(nbytes=3 * MiB + 1), "2 MiB multiple"),
        (spec(nbytes=0), "2 MiB multiple"),
        (spec(path="/etc/passwd"), "not inside the snapshot"),
        (spec(path="../other/weights.bin"), "not inside the snapshot"),
        (spec(path=""), "not inside the snapshot"),
    ]:
        with pytest.raises(ValueError, match=message):
            RegionSpec.from_json(bad)


class MemfdPrefetch(RegionPrefetch):
    """Makes each region as a memfd filled with its name: the hand-over without a GPU."""

    def _make_and_fill(self, start: float) -> None:
        for s in self.specs:
            fd = os.memfd_create(s.name)
            os.write(fd, s.name.encode())
            self._made.append(_Made(s, None, fd))
        self.figures["regions"] = len(self._made)

    def _release(self) -> None:
        made, self._made = self._made, []
        for m in made:
            os.close(m.fd)


def serve_in_thread(prefetch: RegionPrefetch) -> tuple[threading.Thread, list]:
    result: list = []
    thread = threading.Thread(target=lambda: result.append(prefetch.run()))
    thread.start()
    return thread, result


def test_worker_receives_one_fd_per_region_keyed_by_address(tmp_path):
    specs = [
        RegionSpec.from_json(spec(name=n, address=a)) for n, a in [("w", 1 << 40), ("kv", 2 << 40)]
    ]
    address = str(tmp_path / "sock")
    thread, result = serve_in_thread(MemfdPrefetch(specs, tmp_path, address, timeout_s=10))
    message, fds, sock = region_prefetch.receive(address, timeout_s=10)
    assert message["ok"] and message["figures"]["regions"] == 2
    assert sorted(fds) == [1 << 40, 2 << 40]
    contents = {a: os.pread(fd, 8, 0) for a, fd in fds.items()}  # the restorer's memory, shared
    assert contents == {1 << 40: b"w", 2 << 40: b"kv"}
    for fd in fds.values():
        os.close(fd)
    region_prefetch.ack(sock)
    thread.join(10)
    assert result == [True]  # handed over and acknowledged


def test_a_failed_prefetch_is_handed_over_as_its_reason(tmp_path):
    class Failing(MemfdPrefetch):
        def _make_and_fill(self, start):
            super()._make_and_fill(start)
            raise RuntimeError("out of memory\nsecond line")

    address = str(tmp_path / "sock")
    thread, result = serve_in_thread(Failing([RegionSpec.from_json(spec())], tmp_path, address))
    message, fds, sock = region_prefetch.receive(address, timeout_s=10)
    region_prefetch.ack(sock)
    thread.join(10)
    assert not message["ok"] and fds == {}
    assert message["error"] == "RuntimeError: out of memory second line"  # one line
    assert result == [False]


def test_receive_waits_for_a_late_listener_then_times_out_without_one(tmp_path):
    address = str(tmp_path / "sock")
    late = threading.Timer(
        0.2,
        lambda: serve_in_thread(MemfdPrefetch([RegionSpec.from_json(spec())], tmp_path, address)),
    )
    late.start()
    message, fds, sock = region_prefetch.receive(address, timeout_s=10)
    assert message["ok"] and len(fds) == 1
    os.close(fds.popitem()[1])
    region_prefetch.ack(sock)
    with pytest.raises(FileNotFoundError):
        region_prefetch.receive(str(tmp_path / "nobody"), timeout_s=0.2)


def test_helper_process_without_a_gpu_reports_why_and_exits(tmp_path):
    helper = PrefetchHelper(prefetch_doc([RegionSpec.from_json(spec())], tmp_path, timeout_s=30))
    try:
        message, fds, sock = region_prefetch.receive(helper.address, timeout_s=60)
        region_prefetch.ack(sock)
        assert not message["ok"] and fds == {}
        assert message["error"]  # no cuda.bindings, no driver or no device here
        assert helper.wait(30) == 1
    finally:
        helper.close()
    assert not os.path.exists(helper.address)


def test_a_file_region_takes_its_own_range_of_the_file():
    from snapfn.snapshot.errors import RestoreFailed
    from snapfn.snapshot.keeper.region_fill import _range_bytes

    whole = RegionSpec.from_json(spec())  # 4 MiB, the file from its start
    assert _range_bytes(whole, 3 * MiB) == 3 * MiB
    with pytest.raises(RestoreFailed, match="do not fit"):
        _range_bytes(whole, 5 * MiB)
    ranged = RegionSpec.from_json(spec(offset=6 * MiB))
    assert _range_bytes(ranged, 16 * MiB) == 4 * MiB  # its region's size
    assert _range_bytes(ranged, 8 * MiB) == 2 * MiB  # up to the file's end


@needs_root
def test_the_worker_takes_regions_only_from_a_process_of_its_own_user(tmp_path):
    address = str(tmp_path / "sock")
    region = os.memfd_create("fake-weights")
    offer = {"ok": True, "error": None, "figures": {}, "regions": [1 << 40]}
    try:
        with foreign_listener(address, offer, fds=(region,)) as pid:
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
                sock.connect(address)
                data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 8)
                assert json.loads(data) == offer and len(fds) == 1  # offered, without the check
                os.close(fds[0])
            fds_before = len(os.listdir("/proc/self/fd"))
            reason = f"the regions' socket {address} is not trusted: its peer (pid {pid}) runs"
            with pytest.raises(PermissionError, match="^" + re.escape(reason)):
                region_prefetch.receive(address, timeout_s=5)
            assert len(os.listdir("/proc/self/fd")) == fds_before  # nothing taken from it
    finally:
        os.close(region)


@needs_root
def test_the_prefetch_hands_its_regions_only_to_a_process_of_its_own_user():
    with reachable_dir() as directory:
        address = directory / "sock"
        specs = [RegionSpec.from_json(spec(name="w", address=1 << 40))]
        thread, result = serve_in_thread(
            MemfdPrefetch(specs, directory, str(address), timeout_s=10)
        )
        while not address.exists():
            threading.Event().wait(0.01)
        open_up(directory, address)  # anyone may connect: still refused
        answer = json.loads(foreign_client(address, None))
        assert answer["ok"] is False and answer["error"].startswith("not trusted: its peer")
        message, fds, sock = region_prefetch.receive(str(address), timeout_s=10)
        assert message["ok"] and os.pread(fds[1 << 40], 8, 0) == b"w"  # still ours to take
        assert f"runs as uid {NOBODY}" in message["figures"]["refused"]
        os.close(fds[1 << 40])
        region_prefetch.ack(sock)
        thread.join(10)
        assert result == [True]


def test_a_prefetch_listens_only_in_a_private_directory_and_answers_only_json_objects(tmp_path):
    from snapfn.snapshot.errors import RestoreFailed

    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o755)
    with pytest.raises(RestoreFailed, match=f"{loose} is mode 0755, not 0700"):
        MemfdPrefetch([RegionSpec.from_json(spec())], tmp_path, str(loose / "sock"))
    assert not (loose / "sock").exists()
    address = str(tmp_path / "sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as listener:
        listener.bind(address)
        listener.listen(1)
        for bad, reason in [(b"[1, 2]", "not a JSON object"), (b'{"regions": "x"}', "not a list")]:
            accepted = threading.Thread(target=lambda b=bad: listener.accept()[0].send(b))
            accepted.start()
            with pytest.raises(ValueError, match=reason):
                region_prefetch.receive(address, timeout_s=5)
            accepted.join(5)


def test_take_regions_adopts_or_says_why_and_always_acknowledges(tmp_path):
    from snapfn.snapshot.errors import RestoreFailed

    specs = [RegionSpec.from_json(spec(name="w", address=1 << 40))]
    taken: list = []

    def adopt(fds):
        taken.append(sorted(fds))
        for fd in fds.values():
            os.close(fd)

    for case in ("adopted", "refused"):
        sock_path = str(tmp_path / f"{case}.sock")
        thread, result = serve_in_thread(MemfdPrefetch(specs, tmp_path, sock_path, timeout_s=10))
        figures: dict = {}
        if case == "adopted":
            assert region_prefetch.take_regions(sock_path, 10, adopt, figures)
            assert taken == [[1 << 40]] and "fallback" not in figures
        else:

            def refuse(fds):
                adopt(fds)
                raise RestoreFailed("the regions do not match ours")

            assert not region_prefetch.take_regions(sock_path, 10, refuse, figures)
            assert figures["fallback"] == "the regions do not match ours"
        assert figures["restorer"]["regions"] == 1
        thread.join(10)
        assert result == [True]  # acknowledged either way: the restorer lets go
    figures = {}
    assert not region_prefetch.take_regions(str(tmp_path / "nobody.sock"), 0.05, adopt, figures)
    assert figures["fallback"].startswith("no regions from the restorer")
