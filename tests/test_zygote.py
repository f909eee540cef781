"""The zygote fork server: preloaded imports, millisecond forks, exit reporting, clean close; its
socket trusted only between processes of one user (or root), both ends, in a private directory."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from snapfn.snapshot.errors import BadRequest, InitFailed
from snapfn.snapshot.zygote.owner import Zygote, run_worker_inline

from test_unix_socket import (
    NOBODY,
    foreign_client,
    foreign_listener,
    needs_root,
    open_up,
    reachable_dir,
)

TESTS_DIR = Path(__file__).resolve().parent


def zygote_env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


def start(preload, tmp_path, **kwargs) -> Zygote:
    return Zygote.start(preload, env=zygote_env(), socket_dir=tmp_path, **kwargs)


def is_alive(pid: int) -> bool:
    """True while pid exists, zombies included: os.kill(pid, 0) answers for those too."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def fork():
    """zygote.fork, closing every worker's channel and connection at teardown."""
    workers = []

    def fork(zygote, target, args, **kwargs):
        workers.append(zygote.fork(target, args, **kwargs))
        return workers[-1]

    yield fork
    for worker in workers:
        worker.close()


@pytest.fixture(scope="module")
def torch_zygote(tmp_path_factory):
    zygote = start(["torch", "zygote_targets"], tmp_path_factory.mktemp("zygote"))
    yield zygote
    zygote.close()


@pytest.fixture
def light_zygote(tmp_path):
    """A zygote without torch, for tests that only need processes."""
    zygote = start(["zygote_targets"], tmp_path)
    yield zygote
    zygote.close()


def test_worker_sees_preloaded_torch_without_cuda_in_milliseconds(torch_zygote, fork):
    start_s = time.perf_counter()
    worker = fork(torch_zygote, "zygote_targets:report", {"t_request": time.monotonic()})
    fork_s = time.perf_counter() - start_s
    report = worker.channel.recv(timeout_s=10)
    assert worker.wait(10) == 0
    assert report["torch_loaded"] and not report["cuda_initialized"]
    assert report["pid"] == worker.pid and report["ppid"] == torch_zygote.pid
    assert report["sid"] == worker.pid  # its own session
    assert fork_s < 0.5 and report["since_request_s"] < 0.5
    assert torch_zygote.preload_seconds_by_module["torch"] > 0.5 > fork_s
    print(f"fork round trip {fork_s * 1e3:.1f} ms; preload {torch_zygote.preload_seconds:.2f} s")


def test_workers_in_a_row_get_own_pids_and_reseeded_random(torch_zygote, fork):
    reports = []
    for _ in range(2):
        worker = fork(torch_zygote, "zygote_targets:report", {"t_request": time.monotonic()})
        reports.append(worker.channel.recv(timeout_s=10))
        assert worker.wait(10) == 0
    assert reports[0]["pid"] != reports[1]["pid"]
    assert reports[0]["random"] != reports[1]["random"]


def test_channel_carries_messages_both_ways_stdout_and_env(torch_zygote, fork):
    read_fd, write_fd = os.pipe()
    worker = fork(torch_zygote, "zygote_targets:echo", {"tag": "t1"}, stdout=write_fd)
    os.close(write_fd)
    for n in range(3):
        worker.channel.send({"n": n})
    assert [worker.channel.recv(timeout_s=10) for _ in range(3)] == [
        {"echo": {"n": n}, "tag": "t1"} for n in range(3)
    ]
    worker.channel.close()  # EOF for the target: it returns
    assert worker.wait(10) == 0
    with os.fdopen(read_fd, "rb") as pipe:
        assert pipe.read() == b"echoed 3\n"
    env = {"ZYGOTE_TEST_FLAG": "on"}
    env_worker = fork(torch_zygote, "zygote_targets:report", {"t_request": 0.0}, env=env)
    assert env_worker.channel.recv(timeout_s=10)["env"] == "on"
    assert env_worker.wait(10) == 0


def test_raising_worker_exits_1_with_traceback_on_passed_stderr(torch_zygote, fork):
    read_fd, write_fd = os.pipe()
    worker = fork(torch_zygote, "zygote_targets:fail", {"n": 7}, stderr=write_fd)
    os.close(write_fd)
    assert worker.wait(10) == 1
    with os.fdopen(read_fd, "rb") as pipe:
        err = pipe.read().decode()
    assert "Traceback" in err and "ValueError: boom 7" in err
    assert fork(torch_zygote, "zygote_targets:exit_with", {"code": 5}).wait(10) == 5


def test_unimportable_target_exits_1_and_bad_target_is_refused(torch_zygote, fork):
    read_fd, write_fd = os.pipe()
    worker = fork(torch_zygote, "no_such_module_zz:f", {}, stderr=write_fd)
    os.close(write_fd)
    assert worker.wait(10) == 1
    with os.fdopen(read_fd, "rb") as pipe:
        assert "No module named 'no_such_module_zz'" in pipe.read().decode()
    with pytest.raises(BadRequest, match="pkg.module:function"):
        fork(torch_zygote, "zygote_targets.report", {})
    with pytest.raises(BadRequest, match="JSON"):
        fork(torch_zygote, "zygote_targets:report", {"x": object()})


def test_sigkilled_worker_is_reported_and_zygote_serves_on(torch_zygote, fork):
    worker = fork(torch_zygote, "zygote_targets:sleep", {})
    assert worker.channel.recv(timeout_s=10) == {"started": worker.pid}
    with pytest.raises(TimeoutError):
        worker.wait(0.05)
    os.kill(worker.pid, signal.SIGKILL)
    assert worker.wait(10) == -signal.SIGKILL
    assert worker.channel.recv(timeout_s=10) is None  # the worker's end closed with it
    other = fork(torch_zygote, "zygote_targets:sleep", {})
    assert other.channel.recv(timeout_s=10) == {"started": other.pid}
    other.kill(signal.SIGTERM)
    assert other.wait(10) == -signal.SIGTERM
    assert not is_alive(worker.pid) and not is_alive(other.pid)


def test_close_kills_workers_and_leaves_no_process(light_zygote, fork):
    workers = [fork(light_zygote, "zygote_targets:sleep", {}) for _ in range(2)]
    for worker in workers:
        assert worker.channel.recv(timeout_s=10) == {"started": worker.pid}
    socket_dir = light_zygote.socket_path.parent
    light_zygote.close()
    assert [worker.wait(5) for worker in workers] == [-signal.SIGKILL] * 2
    assert not any(is_alive(pid) for pid in [light_zygote.pid, *(w.pid for w in workers)])
    assert not socket_dir.exists()
    with pytest.raises(InitFailed):
        fork(light_zygote, "zygote_targets:sleep", {})


def test_close_without_killing_drains_workers(light_zygote, fork):
    worker = fork(light_zygote, "zygote_targets:sleep", {"seconds": 0.3})
    assert worker.channel.recv(timeout_s=10) == {"started": worker.pid}
    light_zygote.close(kill_workers=False, timeout_s=10)
    assert worker.wait(5) == 0
    assert not is_alive(light_zygote.pid) and not is_alive(worker.pid)


def test_owner_hang_up_closes_zygote_and_its_workers(light_zygote, fork):
    worker = fork(light_zygote, "zygote_targets:sleep", {})
    assert worker.channel.recv(timeout_s=10) == {"started": worker.pid}
    light_zygote.process.stdin.close()  # what the owner's death looks like to the zygote
    assert light_zygote.process.wait(10) == 0
    assert worker.wait(5) == -signal.SIGKILL
    assert not is_alive(worker.pid)


def test_preload_that_initialised_cuda_is_refused(tmp_path):
    with pytest.raises(InitFailed, match="CUDA is initialised in the zygote"):
        start(["zygote_cuda_poison"], tmp_path)
    assert list(tmp_path.iterdir()) == []  # its private dir is gone too


def test_missing_preload_module_fails_start_with_the_reason(tmp_path):
    with pytest.raises(InitFailed, match="No module named 'no_such_module_zz'"):
        start(["zygote_targets", "no_such_module_zz"], tmp_path)


def test_a_module_function_entry_is_called_once_before_fork(tmp_path, fork):
    zygote = start(["zygote_targets", "zygote_targets:preload_call"], tmp_path)
    try:
        got = [fork(zygote, "zygote_targets:preloaded_calls", {}) for _ in range(2)]
        for worker in got:
            assert worker.channel.recv(timeout_s=10)["calls"] == [zygote.process.pid]
        assert "zygote_targets:preload_call" in zygote.preload_seconds_by_module
    finally:
        zygote.close()


def test_a_missing_preload_function_fails_start_with_the_reason(tmp_path):
    with pytest.raises(InitFailed, match="no_such_call"):
        start(["zygote_targets:no_such_call"], tmp_path)


def test_start_times_out_with_a_clear_error(tmp_path):
    with pytest.raises(InitFailed, match="not ready within 0.01 s"):
        start(["torch"], tmp_path, start_timeout_s=0.01)


def test_private_dir_is_owner_only(light_zygote):
    assert light_zygote.socket_path.parent.stat().st_mode & 0o777 == 0o700


def test_inline_runs_the_same_target_in_this_process(capsys):
    worker = run_worker_inline("zygote_targets:echo", {"tag": "i"}, messages=[{"n": 1}])
    assert worker.wait() == 0 and worker.pid == os.getpid()
    assert worker.channel.recv() == {"echo": {"n": 1}, "tag": "i"}
    assert worker.channel.recv() is None
    assert run_worker_inline("zygote_targets:fail", {"n": 2}).returncode == 1
    assert "ValueError: boom 2" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
def test_cuda_worker_initialises_cuda_after_fork(torch_zygote, fork):
    worker = fork(torch_zygote, "zygote_targets:use_cuda", {})
    assert worker.channel.recv(timeout_s=60) == {"sum": 12.0, "cuda_initialized": True}
    assert worker.wait(10) == 0


@needs_root
def test_fork_refuses_a_zygote_socket_of_another_user(tmp_path):
    private_dir = tmp_path / "zygote"
    private_dir.mkdir(mode=0o700)
    socket_path = private_dir / "zygote.sock"
    stand_in = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    zygote = Zygote(stand_in, socket_path, private_dir / "zygote.log", {}, 1, private_dir)
    try:
        with foreign_listener(socket_path, {"ok": True, "pid": 1}) as pid:
            reason = f"zygote {stand_in.pid}'s socket is not trusted: its peer (pid {pid}) runs"
            with pytest.raises(InitFailed, match="^" + re.escape(reason)) as raised:
                zygote.fork("zygote_targets:report", {"t_request": 0.0})
            assert f"as uid {NOBODY}" in str(raised.value) and "\n" not in str(raised.value)
    finally:
        zygote.close()


def test_fork_refuses_a_zygote_directory_opened_to_others(light_zygote, fork):
    light_zygote._private_dir.chmod(0o755)
    with pytest.raises(InitFailed, match=r"is mode 0755, not 0700"):
        fork(light_zygote, "zygote_targets:exit_with", {"code": 0})
    light_zygote._private_dir.chmod(0o700)
    assert fork(light_zygote, "zygote_targets:exit_with", {"code": 4}).wait(10) == 4


@needs_root
def test_the_zygote_refuses_a_fork_request_of_another_user(fork):
    with reachable_dir() as directory:
        zygote = Zygote.start(["zygote_targets"], env=zygote_env(), socket_dir=directory)
        try:
            os.chmod(directory, 0o711)
            open_up(zygote._private_dir, zygote.socket_path)  # anyone may connect: still refused
            answer = json.loads(foreign_client(zygote.socket_path, None))
            assert answer["ok"] is False
            assert answer["error"].startswith("not trusted: its peer (pid ")
            assert f"runs as uid {NOBODY}, not this user (uid 0)" in answer["error"]
            zygote._private_dir.chmod(0o700)
            assert fork(zygote, "zygote_targets:exit_with", {"code": 3}).wait(10) == 3
            assert "zygote: refused a connection: its peer (pid " in zygote.log_path.read_text()
        finally:
            zygote.close()


def test_the_zygote_serves_only_in_a_private_directory(tmp_path):
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o755)
    argv = [sys.executable, "-m", "snapfn.snapshot.zygote.server", "--socket"]
    done = subprocess.run(
        argv + [str(loose / "zygote.sock")], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 4
    assert done.stderr.strip().endswith(
        f"refusing to serve: {loose} is mode 0755, not 0700:"
        " other users could reach or place its sockets"
    )
    assert not (loose / "zygote.sock").exists()
