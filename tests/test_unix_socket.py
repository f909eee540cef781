"""Private socket directories and the peer check (snapshot/unix_socket.py). The foreign peers are
real: a child process forked here drops to uid 65534 ('nobody') and listens or connects there,
so these cases need root (as CI runs) and skip without it. `foreign_listener` and
`foreign_client` serve the keeper's, the zygote's and the prefetch's tests too."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import tempfile
from pathlib import Path

import pytest

from snapfn.snapshot import unix_socket
from snapfn.snapshot.unix_socket import (
    default_dir,
    ensure_private_dir,
    peer_credentials,
    peer_problem,
    private_dir_problem,
)

NOBODY = 65534
needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root: a child process drops to uid 65534 ('nobody')"
)


def _become_nobody() -> None:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


@contextlib.contextmanager
def foreign_listener(path: str | Path, reply: dict, fds: tuple[int, ...] = ()):
    """A SEQPACKET server at `path` whose listening process runs as uid 65534: the socket is
    bound here, then a forked child drops to nobody before `listen`, which is what the kernel
    records as the peer's credentials. Each connection gets `reply` (with `fds`) at once."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.bind(str(path))
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(ready_r)
            _become_nobody()
            sock.listen(8)
            os.write(ready_w, b"1")
            while True:
                conn, _ = sock.accept()
                conn.settimeout(5)
                with contextlib.suppress(OSError):
                    socket.send_fds(conn, [json.dumps(reply).encode()], list(fds))
                    conn.recv(1 << 16)  # until the client hangs up
                conn.close()
        finally:
            os._exit(0)
    os.close(ready_w)
    sock.close()
    try:
        assert os.read(ready_r, 1) == b"1", "the foreign listener did not start"
        os.close(ready_r)
        yield pid
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def foreign_client(path: str | Path, message: dict | None) -> bytes:
    """What a process running as uid 65534 is answered when it connects to `path` and sends
    `message` (None: sends nothing; b"" when it is hung up on; the connection's error, as
    bytes, when it fails). A send that fails (a server that has hung up already) still reads
    what it was sent."""
    answer_r, answer_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(answer_r)
            _become_nobody()
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
                sock.settimeout(10)
                try:
                    sock.connect(str(path))
                    with contextlib.suppress(BrokenPipeError):
                        if message is not None:
                            sock.send(json.dumps(message).encode())
                    answer = sock.recv(1 << 16)
                except OSError as exc:
                    answer = f"error: {exc}".encode()
            os.write(answer_w, answer)
        finally:
            os._exit(0)
    os.close(answer_w)
    with os.fdopen(answer_r, "rb") as answers:
        answer = answers.read()
    os.waitpid(pid, 0)
    return answer


@contextlib.contextmanager
def reachable_dir():
    """A fresh private directory straight under the system temp dir (pytest's own are inside
    directories only root can enter): `open_up` then lets another user reach a socket in it."""
    directory = Path(tempfile.mkdtemp(prefix="snapfn-test-"))
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def open_up(directory: Path, sock: Path) -> None:
    """Let any user reach `sock` (the directory searchable, the socket writable): a
    misconfiguration the peer check must still catch."""
    os.chmod(directory, 0o711)
    os.chmod(sock, 0o666)


def test_the_default_directory_is_this_users_under_the_runtime_dir_or_tmp():
    uid = os.geteuid()
    assert default_dir({"XDG_RUNTIME_DIR": "/run/user/7"}) == Path(f"/run/user/7/snapfn-{uid}")
    assert default_dir({}) == Path(f"/tmp/snapfn-{uid}")
    assert default_dir({"XDG_RUNTIME_DIR": ""}) == Path(f"/tmp/snapfn-{uid}")


def test_a_servers_directory_is_made_private_and_a_loose_one_refused_unchanged(tmp_path):
    made = tmp_path / "made"
    assert ensure_private_dir(made) is None
    st = made.stat()
    assert (st.st_mode & 0o777, st.st_uid) == (0o700, os.geteuid())
    assert ensure_private_dir(made) is None  # an existing private directory is fine
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o755)
    problem = ensure_private_dir(loose)
    assert (
        problem == f"{loose} is mode 0755, not 0700: other users could reach or place its sockets"
    )
    assert loose.stat().st_mode & 0o777 == 0o755  # refused, not changed
    link = tmp_path / "link"
    link.symlink_to(made)
    assert "is a symbolic link" in ensure_private_dir(link)
    plain = tmp_path / "file"
    plain.write_text("")
    assert ensure_private_dir(plain) == f"{plain} is not a directory"
    assert "cannot make the socket directory" in ensure_private_dir(tmp_path / "no" / "parent")
    assert "No such file" in private_dir_problem(tmp_path / "missing")


@needs_root
def test_a_directory_of_another_user_is_refused_with_its_owner(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, NOBODY, NOBODY)
    assert ensure_private_dir(theirs) == f"{theirs} is owned by uid {NOBODY}, not this user (uid 0)"
    assert private_dir_problem(theirs) == ensure_private_dir(theirs)
    # a client trusts root's directories beside its own; a server only its own
    assert private_dir_problem(tmp_path, owners=frozenset({0})) is None


def test_a_peer_of_this_user_is_trusted(monkeypatch):
    ours, theirs = socket.socketpair()
    with ours, theirs:
        assert peer_problem(ours) is None
        peer = peer_credentials(ours)
        assert (peer.pid, peer.uid) == (os.getpid(), os.geteuid())
        monkeypatch.setattr(unix_socket, "trusted_uids", lambda: frozenset({12345}))
        assert peer_problem(ours).startswith(f"its peer (pid {os.getpid()}) runs as uid")


@needs_root
def test_a_listener_of_another_user_is_named_with_its_uid_and_pid(tmp_path):
    address = tmp_path / "sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with foreign_listener(address, {"ok": True}) as pid, sock:
        sock.connect(str(address))
        assert json.loads(sock.recv(1 << 16)) == {"ok": True}  # it would be believed
        assert peer_problem(sock) == (
            f"its peer (pid {pid}) runs as uid {NOBODY}, not this user (uid 0)"
        )
