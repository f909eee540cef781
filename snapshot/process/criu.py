"""CRIU driven as a subprocess: find it, check it, dump a process tree, restore it.

Contract:

- `find_criu(config)` looks for the binary in order: `config.binary` (`SNAPFN_CRIU`), then
  `<config.prefix>/bin/criu` (where `infra/install-criu.sh` puts it, `SNAPFN_CRIU_PREFIX`), then
  the `PATH` captured in the config. Nothing is read from the environment outside `from_env`.
- `check(config)` says whether process snapshots can work here: criu found, version >= 4.0
  (3.x fails on 6.x kernels with "Unexpected rt vDSO area bounds") and `criu check` passing
  (root, kernel features). It never raises; the result carries a one-line reason.
- `dump(pid, images_dir)` checkpoints the tree rooted at `pid` into `images_dir` (killing it
  unless `leave_running`); `restore(images_dir)` brings it back and returns the root's host pid.
  Both run criu with a timeout and raise `RestoreFailed` whose one-line message is criu's own
  first error from its log (plus the log's path). A restore that fails or times out kills what
  it had restored, and the lazy-pages daemon it started.

What the dumped process must look like (found by experiment, docs/criu.md): a session leader
(`start_new_session=True`; else `shell_job`, which needs a terminal at restore), no connected
stream socket to a process outside the tree (criu cannot dump half of a unix stream connection,
even with `--ext-unix-sk`; listening sockets are fine), stdio on /dev/null or pipes rather than a
regular file that keeps growing (criu refuses to restore a file whose size changed), and its
file locks dumped only on request (`file_locks`). A worker started in its own pid namespace
(`unshare --pid --fork setsid …`) restores under a fresh host pid, so one image can be restored
while the original lives, or many times at once; otherwise the original pid must be free.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from snapfn.snapshot.errors import RestoreFailed, one_line
from snapfn.snapshot.process.proc_stat import GONE_STATES, stat_fields

MIN_MAJOR_VERSION = 4
DEFAULT_PREFIX = "/opt/snapfn-criu"
_VERSION = re.compile(r"Version:\s*(\d+)\.(\d+)(?:\.(\d+))?")
_LOG_ERROR = re.compile(r"Error \([^)]*\):\s*(.*)")
# criu prints these on every run in a sandbox without CAP_SYS_RESOURCE, or as a summary line
_NOISE = ("Can't setup RLIMIT_NOFILE", "Dumping FAILED.", "Restoring FAILED.")
_RESUMED_SCRIPT = '#!/bin/sh\n[ "$CRTOOLS_SCRIPT_ACTION" != post-resume ] || : > "{marker}"\n'


@dataclass(frozen=True)
class CriuConfig:
    """Where criu is and how long each call may take. Built once with `from_env`."""

    binary: str = ""  # an explicit criu path (SNAPFN_CRIU); "" = search
    prefix: str = DEFAULT_PREFIX  # install-criu.sh's prefix (SNAPFN_CRIU_PREFIX)
    search_path: str = ""  # the PATH searched last; from_env copies the environment's
    check_timeout_s: float = 30.0
    dump_timeout_s: float = 300.0
    restore_timeout_s: float = 120.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str], **overrides: object) -> CriuConfig:
        """Defaults, then SNAPFN_CRIU / SNAPFN_CRIU_PREFIX / PATH, then explicit overrides."""
        values: dict[str, object] = {"search_path": environ.get("PATH", os.defpath)}
        if environ.get("SNAPFN_CRIU"):
            values["binary"] = environ["SNAPFN_CRIU"]
        if environ.get("SNAPFN_CRIU_PREFIX"):
            values["prefix"] = environ["SNAPFN_CRIU_PREFIX"]
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


@dataclass(frozen=True)
class TreeOptions:
    """What the process tree holds that criu must be told about; dump and restore must agree."""

    shell_job: bool = False  # root is not a session leader / holds a terminal
    file_locks: bool = False  # the tree holds flock/fcntl locks
    tcp_established: bool = False  # the tree holds established TCP connections
    ext_unix_sk: bool = False  # the tree holds unix datagram sockets bound outside it
    # the root runs in a mount namespace of its own (a copy of ours plus its own /proc): criu
    # dumps it with the tree and needs `--root /` to rebuild it on restore
    mount_namespace: bool = False
    # the root runs in a network namespace of its own, made fresh with only a loopback device:
    # criu dumps it as empty (`--empty-ns net`: no links, addresses, routes or rules, which
    # criu would save with `ip` and `iptables`, neither of which a GPU image need have) and
    # restores a fresh one, its loopback brought up again by criu; its network is not locked
    # (`skip`: no iptables or nft needed) unless the tree holds TCP connections
    net_namespace: bool = False

    def argv(self, restore: bool = False) -> list[str]:
        flags = {
            "--shell-job": self.shell_job,
            "--file-locks": self.file_locks,
            "--tcp-established": self.tcp_established,
            "--ext-unix-sk": self.ext_unix_sk,
        }
        chosen = [flag for flag, wanted in flags.items() if wanted]
        if self.net_namespace:  # nothing to lock in it unless the tree holds TCP connections
            lock = "nftables" if self.tcp_established else "skip"
            chosen += ["--empty-ns", "net", "--network-lock", lock]
        if not self.mount_namespace:
            return chosen
        # NOTE: the namespace is a copy of ours: bind mounts whose source it cannot reach (a
        # container's /usr/local/nvidia, a bind of a tmpfs subfolder) are dumped as external,
        # keyed by their mount point, and bound again from the same paths at restore
        if restore:
            return [*chosen, "--root", "/", "--external", "mnt[]"]
        return [*chosen, "--external", "mnt[]:sm"]


@dataclass(frozen=True)
class CheckResult:
    """Whether criu can checkpoint and restore here; `reason` is one line either way."""

    ok: bool
    version: str | None  # "4.1.1"; None when criu was not found or did not answer
    reason: str
    binary: Path | None = None


@dataclass(frozen=True)
class DumpResult:
    """One finished dump: where the images are, their size and how long criu took."""

    images_dir: Path
    image_bytes: int
    elapsed_s: float
    log_path: Path


def find_criu(config: CriuConfig) -> Path | None:
    """The criu to run: `config.binary`, else the install prefix's, else the first on PATH."""
    if config.binary:
        path = Path(config.binary)
        return path if _is_executable(path) else None
    installed = Path(config.prefix) / "bin" / "criu"
    if _is_executable(installed):
        return installed
    found = shutil.which("criu", path=config.search_path or None)
    return Path(found) if found else None


def privilege_flags() -> list[str]:
    """`--unprivileged` when not root: criu then runs with the capabilities its binary carries
    (CAP_SYS_ADMIN, CAP_SYS_PTRACE and CAP_SETPCAP: install-criu.sh --capabilities) and accepts the
    limits of that mode (no namespaces of its own; docs/deploy.md)."""
    return [] if os.geteuid() == 0 else ["--unprivileged"]


def check(config: CriuConfig) -> CheckResult:
    """Find criu, refuse versions below 4.0, then run `criu check`; never raises."""
    binary = find_criu(config)
    if binary is None:
        return CheckResult(False, None, _not_found_reason(config))
    try:
        version = _version(binary, config.check_timeout_s)
        if int(version.split(".")[0]) < MIN_MAJOR_VERSION:
            reason = (
                f"criu {version} at {binary} is too old: need >= {MIN_MAJOR_VERSION}.0 (3.x fails"
                " on 6.x kernels with 'Unexpected rt vDSO area bounds'); run infra/install-criu.sh"
            )
            return CheckResult(False, version, reason, binary)
        done = _run([str(binary), "check", *privilege_flags()], config.check_timeout_s)
    except RestoreFailed as exc:
        return CheckResult(False, None, str(exc), binary)
    if done.returncode != 0:
        return CheckResult(False, version, f"criu check failed: {_output_reason(done)}", binary)
    return CheckResult(True, version, f"criu {version} at {binary}: criu check passed", binary)


def dump(
    pid: int,
    images_dir: str | os.PathLike,
    *,
    config: CriuConfig,
    options: TreeOptions = TreeOptions(),
    leave_running: bool = False,
    work_dir: str | os.PathLike | None = None,
    timeout_s: float | None = None,
) -> DumpResult:
    """Checkpoint the tree rooted at `pid` into `images_dir` (created if missing).

    The tree is killed afterwards unless `leave_running`. The log (`dump.log`) goes to
    `work_dir`, default `images_dir`. The images suit both eager and lazy restores: criu's own
    `dump --lazy-pages` is for live migration (the process must stay around to serve its pages),
    which a snapshot never wants.
    """
    images = Path(images_dir)
    images.mkdir(parents=True, exist_ok=True)
    work = Path(work_dir) if work_dir is not None else images
    log_path = work / "dump.log"
    argv = [str(_require(config)), "dump", *privilege_flags(), "--tree", str(pid)]
    argv += ["--images-dir", str(images)]
    argv += ["--work-dir", str(work), "--log-file", str(log_path), *options.argv()]
    if leave_running:
        argv.append("--leave-running")
    start = time.perf_counter()
    what = f"criu dump of pid {pid}"
    done = _run(argv, timeout_s or config.dump_timeout_s, what=what)
    elapsed_s = time.perf_counter() - start
    if done.returncode != 0:
        raise RestoreFailed(one_line(f"criu dump of pid {pid} failed: {_log_reason(log_path)}"))
    return DumpResult(images, image_bytes(images), elapsed_s, log_path)


def image_bytes(images_dir: str | os.PathLike) -> int:
    """The size of criu's images in `images_dir` (its *.img files)."""
    return sum(p.stat().st_size for p in Path(images_dir).glob("*.img"))


def restore(
    images_dir: str | os.PathLike,
    *,
    config: CriuConfig,
    options: TreeOptions = TreeOptions(),
    lazy: bool = False,
    detached: bool = True,
    work_dir: str | os.PathLike | None = None,
    timeout_s: float | None = None,
    inherit_fds: Mapping[int, str] | None = None,
) -> int:
    """Restore the tree dumped in `images_dir`; returns its root's host pid once it runs.

    `lazy`: a `criu lazy-pages` daemon serves the memory on first touch (userfaultfd), so the
    tree resumes before its pages are read. `detached`: criu exits and the tree is reparented
    to the nearest subreaper (or init); otherwise criu stays as its parent until it exits, and
    this returns once criu's post-resume action has run. Logs and sockets go to `work_dir`
    (default: a new temporary directory; keep its path short, it holds a unix socket). The
    images directory is only read. `inherit_fds` maps an fd of this process to a resource the
    dumped tree held ("pipe:[4026]", as /proc/PID/fd showed it at dump): the restored tree gets
    that fd in its place (criu's --inherit-fd).
    """
    images = Path(images_dir)
    if not (images / "inventory.img").is_file():
        raise RestoreFailed(f"criu restore: {images} holds no criu images (no inventory.img)")
    binary = str(_require(config))
    work = Path(work_dir) if work_dir is not None else Path(tempfile.mkdtemp(prefix="snapfn-criu-"))
    work.mkdir(parents=True, exist_ok=True)
    pidfile, lazy_pidfile = work / "restore.pid", work / "lazy-pages.pid"
    for stale in (pidfile, lazy_pidfile, work / "resumed"):
        stale.unlink(missing_ok=True)  # criu refuses to overwrite a pidfile
    deadline_s = time.monotonic() + (timeout_s or config.restore_timeout_s)
    try:
        if lazy:
            _start_lazy_pages(binary, images, work, lazy_pidfile, deadline_s)
        argv = [binary, "restore", *privilege_flags(), "--images-dir", str(images)]
        argv += ["--work-dir", str(work)]
        argv += ["--log-file", str(work / "restore.log"), "--pidfile", str(pidfile)]
        argv += options.argv(restore=True) + (["--lazy-pages"] if lazy else [])
        inherit = dict(inherit_fds or {})
        argv += [f"--inherit-fd=fd[{fd}]:{key}" for fd, key in sorted(inherit.items())]
        if detached:
            _restore_detached(argv, work, deadline_s, tuple(inherit))
        else:
            _restore_attached(argv, work, deadline_s, tuple(inherit))
        return _read_pid(pidfile)
    except BaseException:
        _kill_pidfile(pidfile)
        _kill_pidfile(lazy_pidfile)
        raise


def _restore_detached(
    argv: list[str],
    work: Path,
    deadline_s: float,
    pass_fds: tuple[int, ...] = (),
) -> None:
    try:
        criu = subprocess.Popen(
            argv + ["--restore-detached"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=pass_fds,
        )
    except OSError as exc:
        raise RestoreFailed(one_line(f"criu restore: cannot run {argv[0]}: {exc}")) from None
    timeout_s = _left(deadline_s)
    try:
        wait_exit(criu, timeout_s)
    except subprocess.TimeoutExpired:
        # NOTE: the tasks criu has forked so far would stay behind, half restored and spinning
        # (seen with a truncated image): they go first, then criu
        _kill_tree(criu.pid)
        criu.wait()
        raise RestoreFailed(f"criu restore timed out after {timeout_s:.0f} s") from None
    if criu.returncode != 0:
        raise RestoreFailed(one_line(f"criu restore failed: {_log_reason(work / 'restore.log')}"))


def _restore_attached(
    argv: list[str],
    work: Path,
    deadline_s: float,
    pass_fds: tuple[int, ...] = (),
) -> None:
    """criu restore in the background as the tree's parent; back once the tree resumed."""
    marker, script = work / "resumed", work / "post-resume.sh"
    script.write_text(_RESUMED_SCRIPT.format(marker=marker))
    script.chmod(0o755)
    criu = subprocess.Popen(
        argv + ["--action-script", str(script)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        pass_fds=pass_fds,
    )
    while not marker.exists():
        if criu.poll() is not None:
            reason = _log_reason(work / "restore.log")
            raise RestoreFailed(one_line(f"criu restore exited {criu.returncode}: {reason}"))
        if time.monotonic() > deadline_s:
            criu.kill()
            criu.wait()
            raise RestoreFailed(f"criu restore timed out (log: {work / 'restore.log'})")
        time.sleep(0.002)


def _start_lazy_pages(
    binary: str, images: Path, work: Path, pidfile: Path, deadline_s: float
) -> None:
    """Start the lazy-pages daemon; criu returns once its socket is listening."""
    log_path = work / "lazy-pages.log"
    argv = [binary, "lazy-pages", *privilege_flags(), "--images-dir", str(images)]
    argv += ["--work-dir", str(work)]
    argv += ["--log-file", str(log_path), "--daemon", "--pidfile", str(pidfile)]
    done = _run(argv, _left(deadline_s), what="criu lazy-pages")
    if done.returncode != 0:
        raise RestoreFailed(one_line(f"criu lazy-pages failed: {_log_reason(log_path)}"))


def _kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process below it (collected before any is killed)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").glob("*"):
            with contextlib.suppress(OSError, ValueError):
                todo += [int(c) for c in (task / "children").read_text().split()]
    for victim in reversed(found):
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)


def wait_exit(proc: subprocess.Popen, timeout_s: float) -> int:
    """`proc.wait(timeout_s)`, returning as soon as the process exits: Popen.wait with a timeout
    polls, sleeping up to 50 ms between looks (on a tier-1 restore's critical path, once criu
    is done). A pidfd (Linux 5.3+) becomes readable at the exit; without one, Popen.wait."""
    import select

    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # no pidfd here, or the process is already reaped
        return proc.wait(timeout_s)
    try:
        if not select.select([fd], [], [], max(0.0, timeout_s))[0]:
            raise subprocess.TimeoutExpired(proc.args, timeout_s)
        return proc.wait()
    finally:
        os.close(fd)


def _run(
    argv: list[str],
    timeout_s: float,
    what: str = "criu",
    pass_fds: tuple[int, ...] = (),
) -> subprocess.CompletedProcess:
    """Run criu; a timeout or a missing binary becomes RestoreFailed."""
    try:
        return subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            pass_fds=pass_fds,
        )
    except subprocess.TimeoutExpired:
        raise RestoreFailed(f"{what} timed out after {timeout_s:.0f} s") from None
    except OSError as exc:
        raise RestoreFailed(one_line(f"{what}: cannot run {argv[0]}: {exc}")) from None


def _version(binary: Path, timeout_s: float) -> str:
    done = _run([str(binary), "--version"], timeout_s, what="criu --version")
    match = _VERSION.search(done.stdout)
    if done.returncode != 0 or match is None:
        raise RestoreFailed(f"criu --version at {binary} failed: {_output_reason(done)}")
    return ".".join(part for part in match.groups() if part is not None)


def _require(config: CriuConfig) -> Path:
    binary = find_criu(config)
    if binary is None:
        raise RestoreFailed(_not_found_reason(config))
    return binary


def _not_found_reason(config: CriuConfig) -> str:
    if config.binary:
        return f"SNAPFN_CRIU={config.binary} is not an executable file"
    return (
        f"criu not found (no SNAPFN_CRIU, no {config.prefix}/bin/criu, none on PATH);"
        " run infra/install-criu.sh"
    )


def _log_reason(log_path: Path) -> str:
    """criu's first real error in its log (its later lines are consequences), with the path."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return f"no log at {log_path}"
    errors = [m.group(1) for m in map(_LOG_ERROR.search, lines) if m]
    errors = [e for e in errors if not any(noise in e for noise in _NOISE)]
    tail = [line.strip() for line in lines if line.strip()][-1:]
    reason = errors[0] if errors else (tail[0] if tail else "empty log")
    return f"{reason} (log: {log_path})"


def _output_reason(done: subprocess.CompletedProcess) -> str:
    lines = (done.stdout + done.stderr).splitlines()
    kept = [line.strip() for line in lines if line.strip() and not line.startswith("Warn")]
    return " ".join(kept)[:400] or f"exit status {done.returncode}"


def _read_pid(pidfile: Path) -> int:
    try:
        return int(pidfile.read_text().strip())
    except (OSError, ValueError):
        raise RestoreFailed(f"criu restore wrote no pid to {pidfile}") from None


def _kill_pidfile(pidfile: Path) -> None:
    """SIGKILL the process a pidfile names (a half-restored tree, a lazy-pages daemon)."""
    try:
        pid = int(pidfile.read_text().strip())
    except (OSError, ValueError):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _left(deadline_s: float) -> float:
    return max(0.1, deadline_s - time.monotonic())


def _is_executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def is_running(pid: int) -> bool:
    """Whether `pid` names a live process: neither gone nor a zombie waiting to be reaped."""
    fields = stat_fields(f"/proc/{pid}/stat")
    return fields is not None and fields[0] not in GONE_STATES
