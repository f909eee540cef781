"""CRIU wrapper: lookup, version refusal and error reasons (fake criu scripts, always run), then
real dump/restore cycles of a Python process holding torch (CPU), skipped with `check()`'s reason
when criu cannot work here (not root, no criu 4.x: run infra/install-criu.sh, kernel refuses).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from snapfn.snapshot.errors import RestoreFailed
from snapfn.snapshot.process.criu import (
    CriuConfig,
    TreeOptions,
    check,
    dump,
    find_criu,
    is_running,
    restore,
)

from criu_fakes import fake_criu

# A worker holding torch state, answering "<sum of t> <sum of t @ t> <requests served>" to each
# connection on a listening unix socket (the matmul runs on torch's thread pool).
WORKER = """
import socket, sys
import torch
torch.manual_seed(0)
t = torch.randn(512, 512)
served = 0
listener = socket.socket(socket.AF_UNIX)
listener.bind(sys.argv[1])
listener.listen(8)
while True:
    conn, _ = listener.accept()
    with conn:
        conn.recv(16)
        served += 1
        conn.sendall(f"{t.sum().item()!r} {(t @ t).sum().item()!r} {served}".encode())
"""


def ask(sock_path, timeout_s: float = 30.0) -> tuple[float, float, int]:
    """One request to the worker; retries while the socket is not there or not yet accepting."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.socket(socket.AF_UNIX) as conn:
                conn.settimeout(timeout_s)
                conn.connect(str(sock_path))
                conn.sendall(b"state")
                total, product, served = conn.recv(256).decode().split()
                return float(total), float(product), int(served)
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def kill_and_wait(pid: int) -> None:
    """SIGKILL (a pid-namespace init ignores SIGTERM) and wait until it is gone or a zombie."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 10
    while is_running(pid) and time.monotonic() < deadline:
        time.sleep(0.01)


# -- the wrapper's own logic, against fake criu binaries --------------------------------------


def test_missing_criu_is_reported_with_the_fix(tmp_path):
    result = check(CriuConfig(prefix=str(tmp_path / "none"), search_path=str(tmp_path)))
    assert not result.ok and result.version is None
    assert "install-criu.sh" in result.reason
    explicit = check(CriuConfig(binary=str(tmp_path / "nope")))
    assert not explicit.ok and "SNAPFN_CRIU=" in explicit.reason


def test_lookup_order_is_explicit_then_prefix_then_path(tmp_path):
    on_path = fake_criu(tmp_path, "exit 0\n")
    prefix = tmp_path / "prefix"
    (prefix / "bin").mkdir(parents=True)
    installed = shutil.copy(on_path, prefix / "bin" / "criu")
    config = CriuConfig.from_env({"PATH": str(tmp_path), "SNAPFN_CRIU_PREFIX": str(prefix)})
    assert find_criu(config) == installed
    assert find_criu(CriuConfig(prefix=str(tmp_path / "no"), search_path=str(tmp_path))) == on_path
    explicit = CriuConfig.from_env({"SNAPFN_CRIU": str(on_path), "SNAPFN_CRIU_PREFIX": str(prefix)})
    assert find_criu(explicit) == on_path


def test_criu_3_is_refused_before_criu_check_runs(tmp_path, monkeypatch):
    binary = fake_criu(tmp_path, "echo Looks good.; exit 0\n")
    monkeypatch.setenv("FAKE_VERSION", "3.17.1")
    result = check(CriuConfig(binary=str(binary)))
    assert not result.ok and result.version == "3.17.1"
    assert "too old" in result.reason and "vDSO" in result.reason


def test_failing_criu_check_reason_is_one_line(tmp_path):
    body = 'echo "CRIU needs to have the CAP_SYS_ADMIN capability:"; echo "setcap ..."; exit 1\n'
    result = check(CriuConfig(binary=str(fake_criu(tmp_path, body))))
    assert not result.ok and result.version == "4.1.1"
    assert (
        result.reason
        == "criu check failed: CRIU needs to have the CAP_SYS_ADMIN capability: setcap ..."
    )


def test_failed_dump_reports_criu_first_real_error(tmp_path):
    # criu's log: sandbox noise, the cause, then the summary line; the reason is the cause
    body = """
while [ $# -gt 0 ]; do [ "$1" = --log-file ] && log=$2; shift; done
cat > "$log" <<EOF
Error (criu/util.c:1533): rlimit: Can't setup RLIMIT_NOFILE for self: Operation not permitted
Error (criu/sk-unix.c:874): unix: External socket is used. Consider using --ext-unix-sk option.
Error (criu/cr-dump.c:2111): Dumping FAILED.
EOF
exit 1
"""
    config = CriuConfig(binary=str(fake_criu(tmp_path, body)))
    with pytest.raises(RestoreFailed, match=r"pid 42 failed: unix: External socket is used") as err:
        dump(42, tmp_path / "images", config=config)
    assert "\n" not in str(err.value) and "dump.log" in str(err.value)


def test_restore_timeout_is_a_restore_failure(tmp_path):
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "inventory.img").write_bytes(b"")
    config = CriuConfig(binary=str(fake_criu(tmp_path, "sleep 30\n")), restore_timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(RestoreFailed, match="timed out"):
        restore(tmp_path / "images", config=config, work_dir=tmp_path / "work")
    assert time.monotonic() - start < 10


def test_restore_timeout_kills_what_criu_had_started(tmp_path):
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "inventory.img").write_bytes(b"")
    child = tmp_path / "child.pid"
    body = f"sleep 300 &\necho $! > {child}\nsleep 30\n"  # a half-restored task, then a hang
    config = CriuConfig(binary=str(fake_criu(tmp_path, body)), restore_timeout_s=1.0)
    with pytest.raises(RestoreFailed, match="timed out"):
        restore(tmp_path / "images", config=config, work_dir=tmp_path / "work")
    pid = int(child.read_text())
    deadline = time.monotonic() + 10
    while is_running(pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not is_running(pid), "the task criu had forked is still running"


def test_restore_refuses_a_directory_without_images(tmp_path):
    config = CriuConfig(binary=str(fake_criu(tmp_path, "exit 0\n")))
    with pytest.raises(RestoreFailed, match="no criu images"):
        restore(tmp_path, config=config)


# -- real checkpoints (root + criu 4.x) -------------------------------------------------------


def start_worker(sock_path, *, own_pid_namespace: bool):
    """The worker as its own session leader, stdio on /dev/null; returns (Popen, root pid)."""
    argv = [sys.executable, "-c", WORKER, str(sock_path)]
    if own_pid_namespace:  # NOTE: setsid makes the namespace's init a session leader
        argv = ["unshare", "--pid", "--fork", "setsid", *argv]
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=not own_pid_namespace,
    )
    answer = ask(sock_path, timeout_s=180)
    root = proc.pid
    if own_pid_namespace:
        root = int(Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()[0])
    return proc, root, answer


@pytest.fixture(scope="module")
def dumped_worker(criu_config, tmp_path_factory):
    """A torch worker in its own pid namespace, asked twice, dumped (and so killed)."""
    base = tmp_path_factory.mktemp("criu")
    sock_path = base / "w.sock"
    proc, root, _ = start_worker(sock_path, own_pid_namespace=True)
    before = ask(sock_path)
    try:
        result = dump(root, base / "images", config=criu_config)
    finally:
        proc.kill()
        proc.wait()
    print(f"\ndump {result.elapsed_s:.2f} s, image {result.image_bytes / 1e6:.0f} MB")
    return result, sock_path, before


def test_dump_and_restore_in_place_keeps_state_and_pid(criu_config, tmp_path):
    sock_path = tmp_path / "w.sock"
    proc, pid, _ = start_worker(sock_path, own_pid_namespace=False)
    before = ask(sock_path)
    result = dump(pid, tmp_path / "images", config=criu_config)
    assert proc.wait(timeout=10) == -signal.SIGKILL  # dump without leave_running kills it
    start = time.perf_counter()
    restored = restore(result.images_dir, config=criu_config, work_dir=tmp_path / "work")
    restore_s = time.perf_counter() - start
    try:
        after = ask(sock_path)
        answered_s = time.perf_counter() - start
        assert restored == pid
        assert after == (before[0], before[1], before[2] + 1)
    finally:
        kill_and_wait(restored)
    print(
        f"\nin place: dump {result.elapsed_s:.2f} s ({result.image_bytes / 1e6:.0f} MB),"
        f" restore {restore_s:.2f} s, answered {answered_s:.2f} s after restore started"
    )


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_restore_from_own_pid_namespace_twice_at_once(dumped_worker, criu_config, tmp_path, lazy):
    result, sock_path, before = dumped_worker
    pids, times = [], []
    try:
        for i in range(2):  # a fresh pid namespace each time: no pid collision
            start = time.perf_counter()
            pid = restore(
                result.images_dir, config=criu_config, lazy=lazy, work_dir=tmp_path / f"w{i}"
            )
            pids.append(pid)
            restore_s = time.perf_counter() - start
            assert ask(sock_path) == (before[0], before[1], before[2] + 1)
            times.append((restore_s, time.perf_counter() - start))
        assert len(set(pids)) == 2 and all(is_running(pid) for pid in pids)
    finally:
        for pid in pids:
            kill_and_wait(pid)
    mode = "lazy" if lazy else "eager"
    for restore_s, answered_s in times:
        print(f"\n{mode} restore {restore_s:.3f} s, answered {answered_s:.3f} s after start")


def test_attached_restore_returns_once_resumed_with_criu_as_parent(
    dumped_worker, criu_config, tmp_path
):
    result, sock_path, before = dumped_worker
    pid = restore(result.images_dir, config=criu_config, detached=False, work_dir=tmp_path)
    try:
        assert ask(sock_path, timeout_s=5) == (before[0], before[1], before[2] + 1)
        parent = int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
        assert "criu" in Path(f"/proc/{parent}/cmdline").read_text()
    finally:
        kill_and_wait(pid)


def test_restore_onto_a_taken_pid_fails_with_criu_reason(criu_config, tmp_path):
    sock_path = tmp_path / "w.sock"
    code = "import socket,sys,time; s=socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); time.sleep(600)"
    proc = subprocess.Popen([sys.executable, "-c", code, str(sock_path)], start_new_session=True)
    try:
        while not sock_path.exists():
            time.sleep(0.02)
        result = dump(proc.pid, tmp_path / "images", config=criu_config, leave_running=True)
        with pytest.raises(RestoreFailed, match=f"Can't fork for {proc.pid}: File exists"):
            restore(result.images_dir, config=criu_config, work_dir=tmp_path / "work")
        assert proc.poll() is None  # the original was left alone
    finally:
        proc.kill()
        proc.wait()


def test_connection_to_outside_the_tree_cannot_be_dumped(criu_config, tmp_path):
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(tmp_path / "ctl.sock"))
    listener.listen(1)
    code = "import socket,sys,time; s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); time.sleep(600)"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path / "ctl.sock")], start_new_session=True
    )
    conn, _ = listener.accept()
    try:
        with pytest.raises(RestoreFailed, match="External socket is used"):
            dump(proc.pid, tmp_path / "a", config=criu_config, leave_running=True)
        options = TreeOptions(ext_unix_sk=True)  # only helps datagram sockets
        with pytest.raises(RestoreFailed, match="half of stream unix connection"):
            dump(proc.pid, tmp_path / "b", config=criu_config, options=options, leave_running=True)
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
        conn.close()
        listener.close()


# -- snapfn doctor (snapshot/process/doctor.py), which reports the same check ------------------------


def test_wait_exit_returns_at_the_exit_and_times_out_on_a_running_process():
    import subprocess
    import sys
    import time

    from snapfn.snapshot.process.criu import wait_exit

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.2)"])
    start = time.perf_counter()
    assert wait_exit(proc, 10.0) == 0
    assert time.perf_counter() - start < 5.0
    slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            wait_exit(slow, 0.1)
    finally:
        slow.kill()
        slow.wait()
    assert wait_exit(slow, 1.0) == slow.returncode  # already reaped: Popen.wait answers
