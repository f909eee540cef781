"""The keeper's restore ops (snapshot/keeper/daemon.py) on CPU: the GPU work stands in as fakes (a
prefetch whose regions are memfds, a recorded CUDA restore), the protocol and the fallbacks are
real — a restore uses the keeper when it answers and does the work itself when it does not or
refuses, a closed lease cancels a hand-over nobody took, a GPU-less keeper refuses GPU ops with
its reason; a keeper of another user (a child dropped to uid 65534) is refused by the restore,
which does the work itself, and the keeper refuses such a user's connections. The CUDA half runs
in tests/test_process_gpu.py."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

import pytest

from snapfn.snapshot.cuda import checkpoint as cuda_checkpoint
from snapfn.snapshot.errors import RestoreFailed
from snapfn.snapshot.keeper import client as keeper
from snapfn.snapshot.keeper import region_prefetch
from snapfn.snapshot.keeper.client import KeeperNotTrusted, KeeperPrefetch, KeeperUnavailable
from snapfn.snapshot.keeper.daemon import Keeper
from snapfn.snapshot.keeper.pinned_cache import PinnedCache
from snapfn.snapshot.keeper.region_prefetch import RegionSpec, prefetch_doc
from snapfn.snapshot.process import worker_process as process
from snapfn.snapshot.process.snapshot import _current_compat

from test_region_prefetch import MemfdPrefetch, spec
from test_unix_socket import (
    NOBODY,
    foreign_client,
    foreign_listener,
    needs_root,
    open_up,
    reachable_dir,
)


class FakeGpuKeeper(Keeper):
    """A keeper whose GPU work is faked: memfd regions; what it was asked is recorded."""

    def __init__(self) -> None:
        super().__init__(PinnedCache("memfd"), cuda=False)
        self.prefetches: list[MemfdPrefetch] = []
        self.finished: list[bool] = []

    def _need_cuda(self) -> None:
        pass

    def _make_prefetch(self, doc):
        made = MemfdPrefetch(
            [RegionSpec.from_json(s) for s in doc["specs"]],
            doc["snapshot_dir"],
            doc["address"],
            timeout_s=doc["timeout_s"],
        )
        self.prefetches.append(made)
        run = made.run
        made.run = lambda: self.finished.append(run()) or self.finished[-1]
        return made


def serving(keeper_: Keeper, address: str):
    stop = threading.Event()
    thread = threading.Thread(target=keeper_.serve, args=(address, stop), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not os.path.exists(address):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return stop, thread


@pytest.fixture
def fake_keeper(tmp_path):
    k = FakeGpuKeeper()
    address = str(tmp_path / "keeper.sock")
    stop, thread = serving(k, address)
    yield k, address
    stop.set()
    thread.join(5)


@pytest.fixture
def recorded_cuda(monkeypatch):
    """cuda_checkpoint.restore / unlock recorded instead of called (by the keeper or here)."""
    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(
        cuda_checkpoint, "restore", lambda pid: calls.append(("restore", pid)) or 0.2
    )
    monkeypatch.setattr(
        cuda_checkpoint, "unlock", lambda pid: calls.append(("unlock", pid)) or 0.01
    )
    return calls


def test_the_cuda_restore_is_the_keepers_when_it_answers(fake_keeper, recorded_cuda):
    _, address = fake_keeper
    figures: dict = {}
    process._cuda_restore(4242, figures, address)
    assert recorded_cuda == [("restore", 4242), ("unlock", 4242)]
    assert figures == {"restore_s": 0.2, "unlock_s": 0.01, "by": "keeper"}


def test_the_callers_work_starts_while_the_keeper_restores(fake_keeper, monkeypatch):
    """`started` runs once the keeper has the request, not after its answer: the restorer's
    own work (the tokenizer) overlaps the CUDA restore instead of delaying its request."""
    _, address = fake_keeper
    started, order = threading.Event(), []

    def restore(pid: int) -> float:  # the keeper's: waits for the restorer's work to start
        assert started.wait(5), "started() had not run while the keeper restored"
        order.append("restore")
        return 0.2

    monkeypatch.setattr(cuda_checkpoint, "restore", restore)
    monkeypatch.setattr(cuda_checkpoint, "unlock", lambda pid: 0.01)
    figures: dict = {}
    process._cuda_restore(5, figures, address, lambda: order.append("started") or started.set())
    assert figures["by"] == "keeper" and order == ["started", "restore"]


def test_the_callers_work_starts_once_when_the_keeper_fails_after_the_request(
    fake_keeper, monkeypatch
):
    _, address = fake_keeper
    calls: list[str] = []

    def keeper_then_local(pid: int) -> float:
        calls.append("restore")
        if len(calls) == 2:  # the keeper's attempt ("started", "restore") fails
            raise RestoreFailed("the driver said no")
        return 0.2

    monkeypatch.setattr(cuda_checkpoint, "restore", keeper_then_local)
    monkeypatch.setattr(cuda_checkpoint, "unlock", lambda pid: 0.01)
    figures: dict = {}
    process._cuda_restore(6, figures, address, lambda: calls.append("started"))
    assert calls == ["started", "restore", "restore"]
    assert "the driver said no" in figures["keeper"] and "by" not in figures


def test_without_a_keeper_or_when_it_refuses_the_restore_does_it_itself(
    tmp_path, recorded_cuda, monkeypatch
):
    figures: dict = {}
    process._cuda_restore(7, figures, str(tmp_path / "nobody.sock"))
    assert recorded_cuda == [("restore", 7), ("unlock", 7)]
    assert figures["keeper"].startswith("no keeper at") and "by" not in figures
    gpu_less = Keeper(PinnedCache("memfd"), cuda=False)  # refuses: no GPU
    address = str(tmp_path / "gpuless.sock")
    stop, thread = serving(gpu_less, address)
    try:
        figures = {}
        process._cuda_restore(8, figures, address)
    finally:
        stop.set()
        thread.join(5)
    assert recorded_cuda[2:] == [("restore", 8), ("unlock", 8)]
    assert "this keeper has no GPU" in figures["keeper"]
    recorded_cuda.clear()
    process._cuda_restore(9, {}, "")  # keeper off: not even looked for
    assert recorded_cuda == [("restore", 9), ("unlock", 9)]


def test_a_keeper_that_fails_the_restore_says_why(fake_keeper, monkeypatch):
    _, address = fake_keeper

    def failing(pid):
        raise RestoreFailed(
            f"cuCheckpointProcessRestore(pid {pid}) failed: CUDA_ERROR_OUT_OF_MEMORY"
        )

    monkeypatch.setattr(cuda_checkpoint, "restore", failing)
    with pytest.raises(RestoreFailed, match="CUDA_ERROR_OUT_OF_MEMORY") as raised:
        keeper.cuda_restore(address, 11)
    assert not isinstance(raised.value, KeeperUnavailable)  # it answered: not "no keeper"


def test_the_keepers_prefetch_hands_the_regions_to_the_worker(fake_keeper, tmp_path):
    k, address = fake_keeper
    specs = [RegionSpec.from_json(spec(name="w", address=1 << 40))]
    doc = prefetch_doc(specs, tmp_path, timeout_s=10)
    lease = KeeperPrefetch(address, doc)
    try:
        message, fds, sock = region_prefetch.receive(lease.address, timeout_s=10)
        assert message["ok"] and os.pread(fds[1 << 40], 8, 0) == b"w"
        os.close(fds[1 << 40])
        region_prefetch.ack(sock)
    finally:
        lease.close()
    _wait_for(lambda: k.finished == [True])  # handed over and acknowledged
    assert not os.path.exists(os.path.dirname(lease.address))  # the private directory is gone


def test_closing_the_lease_cancels_a_hand_over_nobody_took(fake_keeper, tmp_path):
    k, address = fake_keeper
    doc = prefetch_doc([RegionSpec.from_json(spec())], tmp_path, timeout_s=60)
    lease = KeeperPrefetch(address, doc)
    start = time.monotonic()
    lease.close()  # e.g. criu failed: no worker will come
    _wait_for(lambda: k.finished == [False])
    assert time.monotonic() - start < 5  # not the 60 s timeout: the memory is let go now


def test_a_restore_asks_the_keeper_for_the_gpu_fields_or_falls_back(
    fake_keeper, tmp_path, monkeypatch
):
    from snapfn.snapshot.portable import compat

    _, address = fake_keeper
    fields = {"gpu_name": "NVIDIA H200", "compute_capability": "9.0"}
    asked: list[int] = []
    monkeypatch.setattr(compat, "driver_api_fields", lambda i: asked.append(i) or dict(fields))
    config = process.ProcessConfig(pinned_socket=address)
    key = _current_compat("cuda:0", 1, config)
    assert asked == [0] and key["gpu_name"] == "NVIDIA H200" and key["device_type"] == "cuda"
    # no keeper: the driver here (faked too: this machine has none), and the checkpoint API probed
    probed: list[bool] = []
    monkeypatch.setattr(cuda_checkpoint, "available", lambda: probed.append(True) or (True, ""))
    config = process.ProcessConfig(pinned_socket=str(tmp_path / "nobody.sock"))
    assert _current_compat("cuda:0", 1, config)["gpu_name"] == "NVIDIA H200"
    assert asked == [0, 0] and probed == [True]


def test_keeper_off_is_a_setting():
    environ = {"SNAPFN_PROCESS_KEEPER": "off", "SNAPFN_PINNED_SOCKET": "/run/k.sock"}
    config = process.ProcessConfig.from_env(environ)
    assert config.keeper == "off" and config.keeper_address == ""
    assert process.ProcessConfig.from_env({"SNAPFN_PINNED_SOCKET": "/run/k.sock"}).keeper_address
    with pytest.raises(ValueError, match="keeper must be one of auto, off"):
        process.ProcessConfig.from_env({"SNAPFN_PROCESS_KEEPER": "maybe"})


def test_snapfn_keeper_serves_without_a_snapshot_until_stopped(tmp_path):
    address = str(tmp_path / "keeper.sock")
    argv = [sys.executable, "-m", "snapfn.handler.cli", "keeper", "--socket", address]
    proc = subprocess.Popen(argv + ["--backend", "memfd"], stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: os.path.exists(address) or proc.poll() is not None)
        with pytest.raises(RestoreFailed, match="this keeper has no GPU"):
            keeper.device_fields(address, 0)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    assert "0 files, 0.00 GB pinned" in err and f"serving on {address}" in err
    with pytest.raises(KeeperUnavailable, match="no keeper at"):
        keeper.device_fields(address, 0)


def test_snapfn_keeper_without_an_nvidia_driver_says_so(tmp_path, monkeypatch, capsys):
    from snapfn.handler.cli import main
    from snapfn.snapshot.process import doctor

    monkeypatch.setattr(doctor, "_NVIDIA_VERSION", tmp_path / "no-driver")
    assert main(["keeper", "--socket", str(tmp_path / "k" / "keeper.sock")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("snapfn keeper: error [bad_request]: no NVIDIA GPU here (no NVIDIA")
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "k").exists()


# what a fake keeper answers every request with: invented GPU fields and a CUDA restore "done"
FAKE_ANSWER = {"ok": True, "fields": {"gpu_name": "FAKE GPU"}, "restore_s": 0.0, "unlock_s": 0.0}


@needs_root
def test_a_restore_refuses_a_keeper_of_another_user_and_does_the_work_itself(
    tmp_path, recorded_cuda, monkeypatch
):
    from snapfn.snapshot.portable import compat

    address = str(tmp_path / "keeper.sock")
    monkeypatch.setattr(compat, "driver_api_fields", lambda i: {"gpu_name": "NVIDIA H200"})
    monkeypatch.setattr(cuda_checkpoint, "available", lambda: (True, ""))
    with foreign_listener(address, FAKE_ANSWER) as pid:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            sock.connect(address)
            sock.send(b'{"op": "device"}')
            assert json.loads(sock.recv(1 << 16)) == FAKE_ANSWER  # believed without the check
        reason = f"keeper at {address} not trusted: its peer (pid {pid}) runs as uid {NOBODY}"
        with pytest.raises(KeeperNotTrusted, match="^" + re.escape(reason)) as raised:
            keeper.device_fields(address, 0)
        assert isinstance(raised.value, KeeperUnavailable)  # the caller does the work itself
        assert "\n" not in str(raised.value)
        config = process.ProcessConfig(pinned_socket=address)
        assert _current_compat("cuda:0", 1, config)["gpu_name"] == "NVIDIA H200"  # not FAKE
        figures: dict = {}
        process._cuda_restore(5, figures, address)
        assert recorded_cuda == [("restore", 5), ("unlock", 5)]  # done here, not "by" the fake
        assert figures["keeper"].startswith(reason) and "by" not in figures
        doc = prefetch_doc([RegionSpec.from_json(spec())], tmp_path, timeout_s=10)
        with pytest.raises(KeeperNotTrusted, match=re.escape(reason)):
            KeeperPrefetch(address, doc)
        miss = keeper.request(address, tmp_path / "keeper.sock")
        assert miss.reason.startswith(reason)


@needs_root
def test_a_keeper_whose_directory_is_another_users_or_open_is_refused(fake_keeper, tmp_path):
    _, address = fake_keeper
    keeper.probe(address)  # trusted as it is
    os.chown(tmp_path, NOBODY, NOBODY)
    try:
        with pytest.raises(KeeperNotTrusted, match=f"{tmp_path} is owned by uid {NOBODY}"):
            keeper.call(address, {"op": "device"})
    finally:
        os.chown(tmp_path, 0, 0)
    os.chmod(tmp_path, 0o777)
    try:
        with pytest.raises(KeeperNotTrusted, match=f"{tmp_path} is mode 0777, not 0700"):
            keeper.call(address, {"op": "device"})
    finally:
        os.chmod(tmp_path, 0o700)


@needs_root
def test_the_keeper_refuses_connections_of_another_user(recorded_cuda):
    gpu_less = Keeper(PinnedCache("memfd"), cuda=False)
    with reachable_dir() as directory:
        address = str(directory / "keeper.sock")
        stop, thread = serving(gpu_less, address)
        try:
            open_up(directory, directory / "keeper.sock")  # anyone may connect: still refused
            answer = json.loads(foreign_client(address, {"op": "cuda_restore", "pid": 1}))
            assert answer["ok"] is False
            assert answer["reason"].startswith("not trusted: its peer (pid ")
            assert f"runs as uid {NOBODY}, not this user (uid 0)" in answer["reason"]
            assert recorded_cuda == []  # nothing was done for it
            os.chmod(directory, 0o700)
            with pytest.raises(RestoreFailed, match="this keeper has no GPU"):  # we are answered
                keeper.cuda_restore(address, 1)
        finally:
            stop.set()
            thread.join(5)


def test_the_keeper_serves_only_in_a_private_directory(tmp_path):
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    loose.chmod(0o755)
    with pytest.raises(RestoreFailed, match=f"{loose} is mode 0755, not 0700"):
        Keeper(PinnedCache("memfd"), cuda=False).serve(str(loose / "keeper.sock"))
    assert not (loose / "keeper.sock").exists()
    # `snapfn keeper` says why in one line and exits non-zero
    argv = [sys.executable, "-m", "snapfn.handler.cli", "keeper", "--backend", "memfd"]
    done = subprocess.run(
        argv + ["--socket", str(loose / "keeper.sock")], capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0
    assert f"{loose} is mode 0755, not 0700" in done.stderr and "Traceback" not in done.stderr


def _wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)
