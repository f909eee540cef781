"""Process snapshots (tier 1): spawn a worker, checkpoint it with criu (+ the CUDA driver), restore it.

    worker = spawn("pkg.mod:host", args, config)     a worker.py child, warmed by its host
    worker.wait_event("initialized")
    meta = checkpoint(worker, images_dir, config)     hooks → CUDA lock + checkpoint → criu dump
    worker = restore(images_dir, meta, resume, config, runner)   criu → CUDA → resume → serve

The worker runs in its own pid namespace when `unshare --pid` works here (root), so an image
restores under a fresh host pid however many times it is used and whatever took its old pid.
Its channel and its output are pipes whose identities (`pipe:[inode]`) the dump records; every
restore hands criu fresh pipes for them (`--inherit-fd`). Any failure raises RestoreFailed
naming the step, after killing what was started: a half-restored worker never survives.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from snapfn.snapshot.cuda import checkpoint as cuda_checkpoint
from snapfn.snapshot.errors import RestoreFailed, one_line
from snapfn.snapshot.keeper import client as keeper
from snapfn.snapshot.process import criu, smaps
from snapfn.snapshot.process.code_identity import code_fingerprint
from snapfn.snapshot.process.pipe_channel import PipeChannel

if TYPE_CHECKING:
    from snapfn.snapshot.process import image_memory

Log = Callable[[str], None]
PIPES = ("ctl", "rep", "out")  # owner → worker, worker → owner, worker's stdout + stderr


@dataclass(frozen=True)
class ProcessConfig:
    """How process snapshots are made and restored. Built once with `from_env`."""

    criu: criu.CriuConfig = field(default_factory=criu.CriuConfig)
    lazy: str = "auto"  # lazy pages: "auto" (try, then eager), "on", "off"
    # "auto" (when unshare --pid works; "isolated" for a CUDA worker, `for_device`), "on", "off",
    # "mount": a pid namespace and a mount namespace with its own /proc (what CUDA needs inside a
    # pid namespace; measured on the H200), or "isolated": a network namespace too
    # (NAMESPACE_FLAGS)
    pid_namespace: str = "auto"
    init_timeout_s: float = 3600.0
    restore_timeout_s: float = 120.0  # criu restore → worker restored (replay check included)
    pid_wait_s: float = 10.0  # for the pid an image restores into to be freed
    prefetch: str = "auto"  # CUDA: the restorer makes and fills the worker's regions; or "off"
    prefetch_threads: int = 8  # the helper's reader threads
    prefetch_read: str = "pread"  # or "register" (an experiment: snapshot/keeper/region_fill.py)
    # where `snapfn pin` serves pinned copies of the weights (snapshot/keeper/pinned_cache.py); the
    # helper copies from one when it is there, else reads the files; "" = look nowhere
    pinned_socket: str = ""
    # "auto": when a keeper (`snapfn keeper` / `snapfn pin`, snapshot/keeper/daemon.py) answers at
    # pinned_socket, it makes the regions and does the CUDA restore (its driver is initialised
    # already); "off": this restore does both itself
    keeper: str = "auto"
    # "file": large anonymous memory moves from criu's page image to a file the restored worker
    # maps (snapshot/process/image_memory.py); "image": criu copies every page back
    memory: str = "file"

    @classmethod
    def from_env(cls, environ: Mapping[str, str], **overrides: Any) -> ProcessConfig:
        """Defaults, then SNAPFN_PROCESS_<FIELD> (and the criu / pinned-keeper variables), then
        explicit overrides; ValueError naming the field for a value it does not take."""
        from snapfn.snapshot.keeper.pinned_cache import default_socket

        values: dict[str, Any] = {"criu": criu.CriuConfig.from_env(environ)}
        values["pinned_socket"] = environ.get("SNAPFN_PINNED_SOCKET", default_socket(environ))
        for name, cast in _ENV_FIELDS.items():
            raw = environ.get(f"SNAPFN_PROCESS_{name.upper()}")
            if raw:
                values[name] = cast(raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        config = cls(**values)
        for name, allowed in _CHOICES.items():
            if getattr(config, name) not in allowed:
                choices = ", ".join(allowed)
                raise ValueError(f"{name} must be one of {choices}, not {getattr(config, name)!r}")
        if config.prefetch_threads < 1:
            raise ValueError(f"prefetch_threads must be at least 1, not {config.prefetch_threads}")
        return config

    @property
    def keeper_address(self) -> str:
        """Where to ask a keeper for work, or "" (off)."""
        return self.pinned_socket if self.keeper == "auto" else ""

    def for_device(self, device: str) -> ProcessConfig:
        """This config for a worker on `device`. CUDA fails inside a bare pid namespace
        (cudaGetDeviceCount: error 304, measured on the H200) and its workers hold an abstract
        unix socket, so "auto" there means "isolated" (its own /proc and network namespace, so
        that copies of one image restore at once), or none where `unshare` cannot make them."""
        if device.startswith("cuda") and self.pid_namespace == "auto":
            works = pid_namespace_works(extra=NAMESPACE_FLAGS["isolated"])
            return dataclasses.replace(self, pid_namespace="isolated" if works else "off")
        return self


# what SNAPFN_PROCESS_<FIELD> may set, and the values the string fields take
_ENV_FIELDS = {
    "lazy": str,
    "pid_namespace": str,
    "restore_timeout_s": float,
    "pid_wait_s": float,
    "prefetch": str,
    "memory": str,
    "prefetch_threads": int,
    "prefetch_read": str,
    "keeper": str,
}
_CHOICES = {
    "lazy": ("auto", "on", "off"),
    "pid_namespace": ("auto", "on", "off", "mount", "isolated"),
    "prefetch": ("auto", "off"),
    "prefetch_read": ("pread", "register"),
    "memory": ("file", "image"),
    "keeper": ("auto", "off"),
}


class Worker:
    """A live worker (spawned or restored): its host pid, its channel, its output forwarded."""

    def __init__(
        self,
        pid: int,
        channel: PipeChannel,
        out_fd: int,
        log: Log | None,
        own_pid_namespace: bool = False,
    ) -> None:
        self.pid, self.channel = pid, channel
        self.own_pid_namespace = own_pid_namespace  # else its image restores into `pid` only
        self._out = threading.Thread(target=_forward, args=(out_fd, log), daemon=True)
        self._out.start()

    def wait_event(self, name: str, timeout_s: float | None) -> dict[str, Any]:
        """The worker's next message, which must be event `name`; RestoreFailed otherwise."""
        try:
            message = self.channel.recv(timeout_s)
        except TimeoutError:
            raise RestoreFailed(
                f"worker pid {self.pid} sent no {name!r} within {timeout_s:.0f} s"
            ) from None
        if message is None:
            raise RestoreFailed(f"worker pid {self.pid} exited before {name!r} (see its log above)")
        if message.get("event") == "failed":
            raise RestoreFailed(one_line(f"worker {message['step']} failed: {message['error']}"))
        if message.get("event") != name:
            raise RestoreFailed(f"worker sent {message.get('event')!r}, expected {name!r}")
        return message

    def kill(self) -> None:
        """SIGKILL the worker (its whole pid namespace goes with it) and close the channel."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        self.channel.close()


def spawn(
    host: str, args: Mapping[str, Any], config: ProcessConfig, log: Log | None, env=None
) -> Worker:
    """Start `python -m snapfn.snapshot.process.worker host args` as a checkpointable worker."""
    pipes = {name: os.pipe() for name in PIPES}
    ctl, rep, out = pipes["ctl"], pipes["rep"], pipes["out"]
    argv = [sys.executable, "-m", "snapfn.snapshot.process.worker", host, _json(args)]
    argv += [str(ctl[0]), str(rep[1])]
    if _use_pid_namespace(config.pid_namespace):
        argv = ["unshare", "--pid", "--fork", *NAMESPACE_FLAGS[config.pid_namespace], *argv]

    popen = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=out[1],
        stderr=out[1],
        pass_fds=(ctl[0], rep[1]),
        start_new_session=True,
        env=env,
    )
    for fd in (ctl[0], rep[1], out[1]):
        os.close(fd)
    own = argv[0] == "unshare"
    pid = _worker_pid(popen) if own else popen.pid
    threading.Thread(target=popen.wait, daemon=True).start()  # reap unshare / the worker
    return Worker(pid, PipeChannel(rep[0], ctl[1]), out[0], log, own_pid_namespace=own)


def checkpoint(
    worker: Worker,
    images_dir: Path,
    config: ProcessConfig,
    log: Log | None,
    dump_lock: threading.Lock | None = None,
) -> dict:
    """Before-snapshot hooks, CUDA lock + checkpoint, criu dump (which ends the worker).

    Returns the process section of the manifest. The worker is killed on any failure.
    `dump_lock`: held around the criu dump, so that workers checkpointed at once (their hooks
    meeting) are dumped one at a time (two criu dumps at once failed now and then on CPU with
    "Can't create a directory (-17)").
    """
    seconds: dict[str, float] = {}
    try:
        start = time.perf_counter()
        worker.channel.send({"op": "checkpoint"})
        ready = worker.wait_event("ready", config.init_timeout_s)
        seconds["before_snapshot"] = time.perf_counter() - start
        fds = {"ctl": ready["fds"][0], "rep": ready["fds"][1], "out": 1}
        inherit = {name: os.readlink(f"/proc/{worker.pid}/fd/{fd}") for name, fd in fds.items()}
        memory = {"host": smaps.census_or_reason(worker.pid)}
        mount_namespace = _own_namespace(worker.pid, "mnt")
        if ready["uses_cuda"]:
            seconds["cuda_lock"] = cuda_checkpoint.lock(worker.pid)
            seconds["cuda_checkpoint"] = cuda_checkpoint.checkpoint(worker.pid)
            memory["after_cuda_checkpoint"] = smaps.census_or_reason(worker.pid)
        net_namespace = _own_namespace(worker.pid, "net")
        options = criu.TreeOptions(mount_namespace=mount_namespace, net_namespace=net_namespace)
        with dump_lock or contextlib.nullcontext():
            dumped = criu.dump(worker.pid, images_dir, config=config.criu, options=options)
        seconds["criu_dump"] = dumped.elapsed_s
    except BaseException:
        worker.kill()
        raise
    worker.channel.close()
    moved = _move_memory(images_dir, config, seconds)
    image_bytes = criu.image_bytes(images_dir)
    if log is not None:
        log(f"process image: {image_bytes / 1e6:.1f} MB in {images_dir}")
        if moved is not None:
            log(
                f"moved {moved.moved_bytes / 1e6:.1f} MB of anonymous memory in {moved.pieces}"
                f" mappings to {moved.file}; criu restores the rest"
            )
        for stage, found in memory.items():
            log(f"private memory ({stage}): {smaps.describe(found, top=8)}")
    return {
        "images": images_dir.name,
        "code": code_fingerprint(),  # the code the image holds (code_identity.py)
        "inherit": inherit,
        "mount_namespace": mount_namespace,
        "net_namespace": net_namespace,
        # the pid the image restores into (None: its own pid namespace, any number at once)
        "host_pid": None if worker.own_pid_namespace else worker.pid,
        "uses_cuda": ready["uses_cuda"],
        "hooks": ready["hooks"],
        "worker": ready.get("figures", {}),
        "regions": ready.get("regions", []),
        "registered": ready.get("registered", []),
        "image_bytes": image_bytes,
        "memory": moved.to_json() if moved is not None else None,
        "private_memory": memory,
        "seconds": {k: round(v, 4) for k, v in seconds.items()},
    }


def _move_memory(
    images_dir: Path, config: ProcessConfig, seconds: dict[str, float]
) -> image_memory.MovedMemory | None:
    """The memory move after the dump (SNAPFN_PROCESS_MEMORY=file); a failure is the dump's."""
    if config.memory != "file":
        return None
    from snapfn.snapshot.process import image_memory  # NOTE: here: restores never need it

    start = time.perf_counter()
    try:
        moved = image_memory.move_memory(images_dir)
    except (image_memory.ImageError, OSError) as exc:
        raise RestoreFailed(one_line(f"moving the image's memory to a file failed: {exc}")) from exc
    seconds["move_memory"] = time.perf_counter() - start
    return moved


def restore(
    images_dir: Path,
    meta: Mapping[str, Any],
    resume: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
    config: ProcessConfig,
    run_stage: Callable[[str, Callable[[dict], Any]], Any],
    log: Log | None,
    gate: Callable[[dict], Any] | None = None,
    beside: Callable[[], None] | None = None,
) -> tuple[Worker, dict[str, Any]]:
    """criu restore → [gate] → resume + CUDA restore → the worker's "restored" message.

    `run_stage(name, fn)` times each step (a StageRunner's `run`). `gate` (stage "gate") runs
    once the worker exists but before it resumes: checks that ran beside the criu restore
    raise there, and the worker is killed. `resume` (or what calling it returns, just before
    it is sent) goes to the worker in its resume message. `beside()` is called once, when the
    CUDA restore is under way (its request sent to the keeper; without one, just before the
    driver's restore) or the worker resumed without CUDA: the caller's own work, which then
    takes the GIL from no step of the restore that needs it. Returns the worker, serving, and
    its "restored" message (its identity refresh and its own timed stages).
    """
    pipes = {name: os.pipe() for name in PIPES}
    ours = {"ctl": pipes["ctl"][1], "rep": pipes["rep"][0], "out": pipes["out"][0]}
    theirs = {"ctl": pipes["ctl"][0], "rep": pipes["rep"][1], "out": pipes["out"][1]}
    inherit = {theirs[name]: meta["inherit"][name] for name in PIPES}
    pid, worker = None, None
    try:
        if meta.get("memory"):
            theirs["memory"] = _open_memory_file(images_dir, meta["memory"])
            inherit[theirs["memory"]] = meta["memory"]["key"]
        lazy = config.lazy
        if lazy == "auto" and meta["uses_cuda"]:
            # NOTE: measured on the H200 (8B llama): with lazy pages the CUDA restore faults
            # the saved GPU state in page by page, 0.16 GB/s (27 s for 4.2 GB); eager: 0.4 s
            lazy = "off"
        options = criu.TreeOptions(
            mount_namespace=bool(meta.get("mount_namespace")),
            net_namespace=bool(meta.get("net_namespace")),
        )
        if meta.get("host_pid") and Path(f"/proc/{meta['host_pid']}").exists():
            run_stage("pid_free", lambda f: wait_for_pid(meta["host_pid"], config.pid_wait_s, f))
        own = _namespaces(meta)

        def criu_restore(figures: dict) -> int:
            figures["namespaces"] = own  # of its own, e.g. ["pid", "mnt", "net"]; [] the host's
            return _criu_restore(images_dir, inherit, config, figures, lazy, options)

        pid = run_stage("criu_restore", criu_restore)
        for fd in theirs.values():
            os.close(fd)
        theirs = {}
        worker = Worker(pid, PipeChannel(ours["rep"], ours["ctl"]), ours["out"], log)
        ours = {}  # the worker owns them now: its channel, its output thread
        if gate is not None:
            run_stage("gate", gate)
        message = resume() if callable(resume) else resume  # e.g. naming a prefetch helper
        worker.channel.send({"op": "resume", **message})
        if meta["uses_cuda"]:  # _cuda_restore calls `beside` once, as the restore starts
            started = beside or (lambda: None)
            run_stage(
                "cuda_restore", lambda f: _cuda_restore(pid, f, config.keeper_address, started)
            )
        elif beside is not None:
            beside()
        restored = run_stage(
            "resume", lambda f: worker.wait_event("restored", config.restore_timeout_s)
        )
        return worker, restored
    except BaseException:
        if worker is not None:
            worker.kill()
        elif pid is not None:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        for fd in [*theirs.values(), *ours.values()]:
            with contextlib.suppress(OSError):
                os.close(fd)
        raise


def _namespaces(meta: Mapping[str, Any]) -> list[str]:
    """The namespaces an image's tree has of its own: a pid namespace unless it restores into
    its original pid (`host_pid`), a mount and a network namespace where it was dumped with
    them."""
    own = {"pid": not meta.get("host_pid"), "mnt": meta.get("mount_namespace")}
    own["net"] = meta.get("net_namespace")
    return [name for name, yes in own.items() if yes]


def wait_for_pid(pid: int, wait_s: float, figures: dict) -> None:
    """Wait until `pid`, which an image restores into, is free: a worker restored from the
    same image may still be exiting (a CUDA context takes a moment to tear down). RestoreFailed
    naming what holds it after `wait_s`: such an image restores once at a time per machine."""
    deadline = time.monotonic() + wait_s
    start = time.monotonic()
    while Path(f"/proc/{pid}").exists():
        if time.monotonic() >= deadline:
            raise RestoreFailed(
                f"pid {pid}, which this process image restores into, is taken by "
                f"{_command(pid)} after {wait_s:g} s: an image without its own pid namespace "
                "restores once at a time per machine"
            )
        time.sleep(0.005)
    figures["waited_s"] = round(time.monotonic() - start, 4)


def _command(pid: int) -> str:
    try:
        return repr(Path(f"/proc/{pid}/comm").read_text().strip())
    except OSError:
        return "a process that just exited"


def _open_memory_file(images_dir: Path, memory: Mapping[str, Any]) -> int:
    """The moved memory's file, read-only, for criu to map (--inherit-fd); its pages are asked
    into the page cache now, beside the restore, in case they are not there yet."""
    name = memory["file"]
    if not isinstance(name, str) or "/" in name or name in ("", ".", ".."):
        raise RestoreFailed(f"the process image names a bad memory file: {name!r}")
    try:
        fd = os.open(images_dir / name, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise RestoreFailed(one_line(f"the process image's memory file: {exc}")) from None
    with contextlib.suppress(OSError):  # advice only
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    return fd


def _criu_restore(
    images: Path,
    inherit: dict[int, str],
    config: ProcessConfig,
    figures: dict,
    lazy: str,
    options: criu.TreeOptions,
) -> int:
    modes = {"on": [True], "off": [False], "auto": [True, False]}[lazy]
    for lazy in modes:
        try:
            pid = criu.restore(
                images, config=config.criu, options=options, lazy=lazy, inherit_fds=inherit
            )
        except RestoreFailed as exc:
            if lazy and len(modes) > 1:
                figures["lazy_failed"] = str(exc)
                continue
            raise
        figures.update(lazy=lazy, pid=pid)
        return pid
    raise AssertionError("unreachable")


def _once(fn: Callable[[], None] | None) -> Callable[[], None]:
    """`fn`, run by the first call only (none: a no-op)."""
    pending = [fn] if fn is not None else []

    def call() -> None:
        if pending:
            pending.pop()()

    return call


def _cuda_restore(
    pid: int, figures: dict, keeper_address: str, started: Callable[[], None] = lambda: None
) -> None:
    """Restore and unlock the worker's GPU state: by the keeper when one answers (its driver
    is initialised), else here (the keeper's failure noted). `started()` runs once the restore
    is under way: the keeper's request sent, or just before the driver's restore here; once."""
    started = _once(started)
    if keeper_address:
        try:
            done = keeper.cuda_restore(keeper_address, pid, sent=started)
        except RestoreFailed as exc:
            figures["keeper"] = str(exc)
        else:
            figures.update({k: round(v, 4) for k, v in done.items()}, by="keeper")
            return
    started()
    figures["restore_s"] = round(cuda_checkpoint.restore(pid), 4)
    figures["unlock_s"] = round(cuda_checkpoint.unlock(pid), 4)


def _worker_pid(unshare: subprocess.Popen, timeout_s: float = 10.0) -> int:
    """The host pid of unshare's forked child (the worker, pid 1 of its namespace)."""
    deadline = time.monotonic() + timeout_s
    children = Path(f"/proc/{unshare.pid}/task/{unshare.pid}/children")
    while time.monotonic() < deadline:
        try:
            found = children.read_text().split()
        except OSError:
            found = []
        if found:
            return int(found[0])
        if unshare.poll() is not None:
            raise RestoreFailed(f"unshare --pid exited {unshare.returncode} before its child ran")
        time.sleep(0.002)
    unshare.kill()
    raise RestoreFailed("unshare --pid started no child within 10 s")


@functools.cache
def pid_namespace_works(mount: bool = False, extra: tuple[str, ...] | None = None) -> bool:
    """Whether `unshare --pid --fork [--mount-proc] [EXTRA]` runs here (root, and the kernel
    allows it)."""
    if shutil.which("unshare") is None:
        return False
    flags = extra if extra is not None else (["--mount-proc"] if mount else [])
    argv = ["unshare", "--pid", "--fork", *flags, "true"]
    try:
        done = subprocess.run(argv, capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


# what `unshare --pid --fork` adds per mode: "mount", a mount namespace with a /proc of its own
# (what CUDA needs inside a pid namespace); "isolated", a network namespace too (abstract unix
# sockets, such as the one a CUDA worker holds, are per network namespace: two copies of one
# image collide on it in a shared one). An isolated worker has only a loopback device.
NAMESPACE_FLAGS = {
    "on": (),
    "auto": (),
    "mount": ("--mount-proc",),
    "isolated": ("--mount-proc", "--net"),
}


def _use_pid_namespace(mode: str) -> bool:
    flags = NAMESPACE_FLAGS.get(mode, ())
    if mode in ("on", "mount", "isolated") and not pid_namespace_works(extra=flags):
        raise RestoreFailed(
            f"SNAPFN_PROCESS_PID_NAMESPACE={mode} but `unshare --pid --fork"
            f"{''.join(' ' + f for f in flags)}` fails here"
        )
    return mode in ("on", "mount", "isolated") or (mode == "auto" and pid_namespace_works())


def _own_namespace(pid: int, kind: str) -> bool:
    """Whether `pid` runs in another `kind` ("net", "mnt") namespace than ours."""
    try:
        return os.readlink(f"/proc/{pid}/ns/{kind}") != os.readlink(f"/proc/self/ns/{kind}")
    except OSError:
        return False


def _forward(fd: int, log: Log | None) -> None:
    """Copy the worker's output lines to `log` until it closes them."""
    with contextlib.suppress(OSError), os.fdopen(fd, "rb", buffering=0) as pipe:
        pending = b""
        while chunk := pipe.read(1 << 16):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if log is not None:
                    log("worker: " + line.decode(errors="replace"))


def _json(args: Mapping[str, Any]) -> str:
    import json

    return json.dumps(dict(args))
