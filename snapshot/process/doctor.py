"""`snapfn doctor`: what this machine can do, and why not, as a list of findings.

Contract: `diagnose()` returns one `Finding(name, ok, detail)` per question — Python and torch
versions, CUDA (driver and devices), criu and `criu check`, lazy pages (userfaultfd), the CUDA
driver checkpoint API, page-cache drop, disk free — ending with a verdict on process snapshots
(tier 1). `ok=False` means something here stops a feature from working; facts that stop
nothing (no GPU on a CPU machine) are `ok=True` with the fact in `detail`. Nothing is imported
or initialised that a plain look can avoid: torch's version comes from package metadata,
CUDA is initialised only with `cuda=True` (`--cuda`), `cuCheckpointProcessLock` is only
looked up, never called, and a keeper is only connected to (its directory and peer checked as
a restore checks them), never asked anything. `run(args)` prints `format_findings` and exits 0 when every finding
is ok, else 1.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from snapfn.snapshot.process.criu import CheckResult, CriuConfig, check

_NVIDIA_VERSION = Path("/proc/driver/nvidia/version")
_DROP_CACHES = Path("/proc/sys/vm/drop_caches")
_GIB = 1 << 30


@dataclass(frozen=True)
class Finding:
    """One answer: `ok` is False when it stops a feature from working here."""

    name: str
    ok: bool
    detail: str


def diagnose(
    *,
    criu_config: CriuConfig,
    snapshot_dir: str | os.PathLike = ".",
    min_free_gib: float = 20.0,
    cuda: bool = False,
) -> list[Finding]:
    """Every finding, in the order `format_findings` prints them."""
    criu = check(criu_config)
    driver = nvidia_driver_version()
    findings = [
        Finding("python", True, f"{platform.python_version()} ({sys.executable})"),
        _torch_finding(),
        _cuda_finding(driver, cuda),
        Finding("criu", criu.ok, criu.reason),
        privileges_finding(criu.binary),
        clone3_finding(),
        _lazy_pages_finding(criu, criu_config),
        _checkpoint_api_finding(driver),
        _page_cache_drop_finding(),
        _disk_free_finding(Path(snapshot_dir), min_free_gib),
        _keeper_finding(driver, os.environ),
    ]
    return findings + [_tier1_finding(findings, driver)]


def format_findings(findings: list[Finding]) -> str:
    """One aligned line per finding: `ok  ` or `FAIL`, the name, the detail."""
    width = max((len(f.name) for f in findings), default=0)
    return "\n".join(
        f"{'ok  ' if f.ok else 'FAIL'}  {f.name:<{width}}  {f.detail}" for f in findings
    )


def _torch_finding() -> Finding:
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return Finding("torch", False, "not installed")
    return Finding("torch", True, version)


def nvidia_driver_version() -> str | None:
    """The loaded NVIDIA kernel driver's version, read from /proc (no CUDA call)."""
    try:
        text = _NVIDIA_VERSION.read_text()
    except OSError:
        return None
    for word in text.split():
        if word.count(".") >= 1 and word.replace(".", "").isdigit():
            return word
    return "unknown"


def _cuda_finding(driver: str | None, initialise: bool) -> Finding:
    if driver is None:
        return Finding("cuda", True, "no NVIDIA driver loaded: CPU only")
    if not initialise:
        return Finding(
            "cuda", True, f"driver {driver} (devices not probed: --cuda initialises CUDA)"
        )
    import torch  # NOTE: only here, and only when asked: torch.cuda initialises the driver

    if not torch.cuda.is_available():
        return Finding("cuda", False, f"driver {driver}, but torch {torch.__version__} sees no GPU")
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return Finding("cuda", True, f"driver {driver}, CUDA {torch.version.cuda}: {', '.join(names)}")


def _lazy_pages_finding(criu: CheckResult, config: CriuConfig) -> Finding:
    """Whether `criu restore --lazy-pages` can work: userfaultfd with non-cooperative events."""
    if not criu.ok or criu.binary is None:
        return Finding("criu lazy pages", False, "needs a working criu (see above)")
    argv = [str(criu.binary), "check", "--feature", "uffd-noncoop"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=config.check_timeout_s)
    except subprocess.TimeoutExpired:
        return Finding("criu lazy pages", False, "criu check --feature uffd-noncoop timed out")
    lines = (done.stdout + done.stderr).strip().splitlines()
    detail = lines[-1] if lines else f"exit status {done.returncode}"
    return Finding("criu lazy pages", done.returncode == 0, detail)


def _checkpoint_api_finding(driver: str | None) -> Finding:
    """Whether cuda-bindings exposes the CUDA driver checkpoint API; it is never called here."""
    name = "cuda checkpoint api"
    if (
        importlib.util.find_spec("cuda") is None
        or importlib.util.find_spec("cuda.bindings") is None
    ):
        if driver is None:
            return Finding(name, True, "not needed: no NVIDIA driver (cuda-bindings absent)")
        return Finding(name, False, "cuda-bindings not installed (pip install cuda-bindings)")
    try:
        from cuda.bindings import driver as cuda_driver
    except ImportError as exc:
        return Finding(name, False, f"cuda.bindings.driver does not import: {exc}")
    version = importlib.metadata.version("cuda-bindings")
    if not hasattr(cuda_driver, "cuCheckpointProcessLock"):
        return Finding(name, False, f"cuda-bindings {version} has no cuCheckpointProcessLock")
    where = f"driver {driver}" if driver else "no NVIDIA driver loaded"
    return Finding(name, True, f"cuda-bindings {version} has cuCheckpointProcessLock ({where})")


def _page_cache_drop_finding() -> Finding:
    """Whether cold-cache measurements can empty the host's page cache (root, writable /proc/sys)."""
    name = "page cache drop"
    if os.geteuid() != 0:
        return Finding(name, False, "not root: only per-file POSIX_FADV_DONTNEED is available")
    if not os.access(_DROP_CACHES, os.W_OK):
        return Finding(name, False, f"{_DROP_CACHES} is not writable (read-only /proc/sys?)")
    return Finding(name, True, f"{_DROP_CACHES} writable (not written by doctor)")


def _disk_free_finding(path: Path, min_free_gib: float) -> Finding:
    probe = path if path.exists() else next((p for p in path.parents if p.exists()), Path("/"))
    probe = probe.resolve()
    usage = shutil.disk_usage(probe)
    detail = f"{usage.free / _GIB:.1f} GiB free of {usage.total / _GIB:.1f} GiB at {probe}"
    if usage.free < min_free_gib * _GIB:
        return Finding("disk free", False, f"{detail}: want >= {min_free_gib:g} GiB for snapshots")
    return Finding("disk free", True, detail)


def _keeper_finding(driver: str | None, environ) -> Finding:
    """Whether a `snapfn keeper` answers where this machine's tier-1 restores look (a fact:
    without one they still work, slower)."""
    from snapfn.snapshot.keeper import client as keeper
    from snapfn.snapshot.keeper.pinned_cache import default_socket

    if driver is None:
        return Finding("keeper", True, "not needed: no NVIDIA driver here")
    address = environ.get("SNAPFN_PINNED_SOCKET", default_socket(environ))
    if not address:
        return Finding("keeper", True, "off (SNAPFN_PINNED_SOCKET is empty)")
    try:
        keeper.probe(address)
    except keeper.KeeperNotTrusted as exc:  # someone else's socket where restores look
        return Finding("keeper", False, f"{exc}; tier-1 restores refuse it")
    except keeper.KeeperUnavailable:
        pass
    else:
        return Finding("keeper", True, f"answering at {address}")
    return Finding(
        "keeper",
        True,
        f"none at {address}: tier-1 restores start their own CUDA driver (~0.2-0.4 s more on"
        " the H200); `snapfn keeper --snapshot DIR` or `snapfn serve … --keeper on`",
    )


# what an unprivileged criu carries and needs (capability numbers: linux/capability.h). Every one:
# the kernel refuses to exec a binary whose file capabilities the bounding set would cut.
CRIU_CAPABILITIES = {"CAP_SYS_ADMIN": 21, "CAP_SYS_PTRACE": 19, "CAP_SETPCAP": 8}
_STATUS = Path("/proc/self/status")


def privileges_finding(
    criu_binary: Path | None, status_text: str | None = None, euid: int | None = None
) -> Finding:
    """Who runs criu here and with what: root, or a user whose criu carries the capabilities
    (`install-criu.sh --capabilities`) that this process's bounding set still allows and that
    no_new_privs (Kubernetes' `allowPrivilegeEscalation: false`) does not cancel. The reason
    names the setting to change; `criu check` above has the last word."""
    name = "privileges"
    euid = os.geteuid() if euid is None else euid
    status = _status_fields(status_text if status_text is not None else _read(_STATUS))
    if euid == 0:
        return Finding(name, True, "root: criu runs with this process's capabilities")
    bounding = int(status.get("CapBnd", "0") or "0", 16)
    missing = [cap for cap, bit in CRIU_CAPABILITIES.items() if not bounding >> bit & 1]
    if missing:
        return Finding(
            name,
            False,
            f"uid {euid}, and the bounding set lacks {', '.join(missing)}: grant them to the"
            " container (docs/deploy.md, 'Tier 1 in a container'); the kernel refuses to run"
            " criu with its file capabilities cut",
        )
    if status.get("NoNewPrivs") == "1":
        return Finding(
            name,
            False,
            f"uid {euid} with no_new_privs set (Kubernetes allowPrivilegeEscalation: false,"
            " docker --security-opt no-new-privileges): criu's file capabilities do not apply",
        )
    carried = _file_capabilities(criu_binary) if criu_binary is not None else None
    if not carried:
        return Finding(
            name,
            False,
            f"uid {euid}, and criu ({criu_binary or 'not found'}) carries no file capabilities:"
            " infra/install-criu.sh --capabilities (as root) gives it them",
        )
    return Finding(
        name, True, f"uid {euid}: criu --unprivileged with its file capabilities ({carried})"
    )


def clone3_finding(call=None) -> Finding:
    """Whether the seccomp filter lets clone3 through: criu restores a process under its pid
    with clone3's set_tid. Docker's and containerd's default profiles answer ENOSYS to clone3
    for a container without CAP_SYS_ADMIN. Probed with a NULL argument of size 0, which the
    kernel refuses (EINVAL) before doing anything; `call` stands in for the syscall in tests."""
    import ctypes
    import errno

    name = "clone3 (seccomp)"
    if platform.machine() not in ("x86_64", "aarch64"):
        return Finding(name, True, f"not probed on {platform.machine()}")
    if call is None:
        libc = ctypes.CDLL(None, use_errno=True)

        def call() -> int:
            libc.syscall(435, None, 0)  # SYS_clone3 on x86_64 and aarch64
            return ctypes.get_errno()

    err = call()
    if err in (errno.EINVAL, errno.EFAULT, 0):
        return Finding(name, True, "allowed: criu restores pids with clone3")
    why = errno.errorcode.get(err, str(err))
    return Finding(
        name,
        False,
        f"clone3 answers {why}: a seccomp profile filters it (the runtime's default does for a"
        " container without CAP_SYS_ADMIN); criu cannot restore a pid: use the profile in"
        " docs/deploy.md ('Tier 1 in a container')",
    )


def _status_fields(text: str) -> dict[str, str]:
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _file_capabilities(binary: Path) -> str | None:
    """The capabilities `binary`'s security.capability attribute grants (permitted set), by
    name, or None when it has none."""
    try:
        raw = os.getxattr(binary, "security.capability")
    except OSError:
        return None
    if len(raw) < 12:
        return None
    words = [int.from_bytes(raw[i : i + 4], "little") for i in range(4, len(raw), 4)]
    permitted = words[0] | (words[2] << 32 if len(words) > 2 else 0)  # v2/v3: lo, inh, hi, inh
    names = [cap for cap, bit in CRIU_CAPABILITIES.items() if permitted >> bit & 1]
    return ", ".join(names) if names else f"{permitted:#x}"


def _tier1_finding(findings: list[Finding], driver: str | None) -> Finding:
    by_name = {f.name: f for f in findings}
    if not by_name["criu"].ok:
        return Finding("tier 1 (process)", False, "not possible: criu does not work here")
    lazy = "lazy pages" if by_name["criu lazy pages"].ok else "eager only (no lazy pages)"
    if driver is None:
        return Finding("tier 1 (process)", True, f"possible for CPU functions, {lazy}")
    if not by_name["cuda checkpoint api"].ok:
        return Finding("tier 1 (process)", False, "CPU only: no CUDA driver checkpoint API")
    return Finding(
        "tier 1 (process)",
        True,
        f"possible with GPU state (GPU workers restore with eager pages, under their own pid);"
        f" CPU functions: {lazy}",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cuda", action="store_true", help="initialise CUDA to list the devices torch sees"
    )
    parser.add_argument(
        "--snapshot-dir", type=Path, default=Path("."), help="where snapshots go (disk free)"
    )
    parser.add_argument("--min-free-gib", type=float, default=20.0, help="disk free wanted")
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")


def run(args: argparse.Namespace) -> int:
    findings = diagnose(
        criu_config=CriuConfig.from_env(os.environ),
        snapshot_dir=args.snapshot_dir,
        min_free_gib=args.min_free_gib,
        cuda=args.cuda,
    )
    if args.json:
        print(json.dumps([asdict(f) for f in findings], indent=2))
    else:
        print(format_findings(findings))
    return 0 if all(f.ok for f in findings) else 1
