"""snapfn doctor: what it reports about tier 1 on this machine."""

from __future__ import annotations

from snapfn.snapshot.process.criu import CriuConfig

from criu_fakes import fake_criu
from test_unix_socket import NOBODY, foreign_listener, needs_root


def test_doctor_without_criu_says_tier1_is_impossible(tmp_path):
    from snapfn.snapshot.process.doctor import diagnose, format_findings

    config = CriuConfig(prefix=str(tmp_path / "none"), search_path=str(tmp_path))
    findings = {f.name: f for f in diagnose(criu_config=config, snapshot_dir=tmp_path)}
    assert not findings["criu"].ok and "install-criu.sh" in findings["criu"].detail
    assert not findings["criu lazy pages"].ok
    assert not findings["tier 1 (process)"].ok
    lines = format_findings(list(findings.values())).splitlines()
    assert lines[0].startswith("ok    python") and len(lines) == len(findings)
    assert any(line.startswith("FAIL  criu ") for line in lines)


def test_doctor_on_a_gpu_host_without_cuda_bindings_is_cpu_only(tmp_path, monkeypatch):
    from snapfn.snapshot.process import doctor

    version_file = tmp_path / "version"
    version_file.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04  Sun\n")
    monkeypatch.setattr(doctor, "_NVIDIA_VERSION", version_file)
    monkeypatch.setattr(doctor.importlib.util, "find_spec", lambda name: None)
    config = CriuConfig(binary=str(fake_criu(tmp_path, "echo Looks good.; exit 0\n")))
    findings = {f.name: f for f in doctor.diagnose(criu_config=config, snapshot_dir=tmp_path)}
    assert findings["cuda"].ok and "580.159.04" in findings["cuda"].detail
    assert not findings["cuda checkpoint api"].ok
    assert "pip install cuda-bindings" in findings["cuda checkpoint api"].detail
    assert findings["tier 1 (process)"] == doctor.Finding(
        "tier 1 (process)", False, "CPU only: no CUDA driver checkpoint API"
    )


def test_doctor_run_exits_1_when_something_fails(tmp_path, monkeypatch, capsys):
    import argparse

    from snapfn.snapshot.process import doctor

    parser = argparse.ArgumentParser()
    doctor.add_arguments(parser)
    monkeypatch.setenv("SNAPFN_CRIU", str(tmp_path / "missing"))
    args = parser.parse_args(["--json", "--snapshot-dir", str(tmp_path), "--min-free-gib", "0"])
    assert doctor.run(args) == 1
    assert '"name": "criu"' in capsys.readouterr().out


def test_doctor_says_whether_a_keeper_answers(tmp_path, monkeypatch):
    import threading

    from snapfn.snapshot.keeper.daemon import Keeper
    from snapfn.snapshot.keeper.pinned_cache import PinnedCache
    from snapfn.snapshot.process import doctor

    assert doctor._keeper_finding(None, {}).detail == "not needed: no NVIDIA driver here"
    address = str(tmp_path / "keeper.sock")
    environ = {"SNAPFN_PINNED_SOCKET": address}
    found = doctor._keeper_finding("580.159.04", environ)
    assert found.ok and found.detail.startswith(f"none at {address}")  # a fact, not a failure
    stop = threading.Event()
    serving = threading.Thread(
        target=Keeper(PinnedCache("memfd"), cuda=False).serve, args=(address, stop), daemon=True
    )
    serving.start()
    try:
        deadline = threading.Event()
        for _ in range(500):
            if doctor._keeper_finding("580.159.04", environ).detail == f"answering at {address}":
                break
            deadline.wait(0.01)
        assert doctor._keeper_finding("580.159.04", environ).detail == f"answering at {address}"
    finally:
        stop.set()
        serving.join(5)
    assert doctor._keeper_finding("580", {"SNAPFN_PINNED_SOCKET": ""}).detail.startswith("off")


@needs_root
def test_doctor_flags_a_keeper_socket_of_another_user(tmp_path):
    from snapfn.snapshot.process import doctor

    address = str(tmp_path / "keeper.sock")
    with foreign_listener(address, {"ok": True}):
        found = doctor._keeper_finding("580.159.04", {"SNAPFN_PINNED_SOCKET": address})
    assert not found.ok
    assert found.detail.startswith(f"keeper at {address} not trusted: its peer (pid ")
    assert f"runs as uid {NOBODY}" in found.detail and found.detail.endswith("restores refuse it")


def _status(bounding: int, no_new_privs: int = 0) -> str:
    return f"Name:\tpython\nNoNewPrivs:\t{no_new_privs}\nCapBnd:\t{bounding:016x}\n"


def _capability_xattr(bits: list[int]) -> bytes:
    """security.capability, version 2 (VFS_CAP_REVISION_2), effective, permitted `bits`."""
    permitted = sum(1 << b for b in bits)
    words = [0x02000001, permitted & 0xFFFFFFFF, 0, permitted >> 32, 0]
    return b"".join(w.to_bytes(4, "little") for w in words)


@needs_root
def test_doctor_names_what_keeps_an_unprivileged_criu_from_working(tmp_path):
    import os

    from snapfn.snapshot.process.doctor import CRIU_CAPABILITIES, privileges_finding

    binary = tmp_path / "criu"
    binary.write_bytes(b"\x7fELF")
    full = (1 << 41) - 1
    assert privileges_finding(binary, _status(full), euid=0).ok
    plain = privileges_finding(binary, _status(full), euid=10001)
    assert not plain.ok and "carries no file capabilities" in plain.detail
    os.setxattr(binary, "security.capability", _capability_xattr(list(CRIU_CAPABILITIES.values())))
    good = privileges_finding(binary, _status(full), euid=10001)
    assert good.ok and "CAP_SYS_ADMIN, CAP_SYS_PTRACE, CAP_SETPCAP" in good.detail
    nnp = privileges_finding(binary, _status(full, no_new_privs=1), euid=10001)
    assert not nnp.ok and "allowPrivilegeEscalation: false" in nnp.detail
    dropped = privileges_finding(binary, _status(full & ~(1 << 21)), euid=10001)
    assert not dropped.ok and "lacks CAP_SYS_ADMIN" in dropped.detail
    no_ptrace = privileges_finding(binary, _status(full & ~(1 << 19)), euid=10001)
    assert not no_ptrace.ok and "lacks CAP_SYS_PTRACE" in no_ptrace.detail


def test_doctor_probes_whether_seccomp_lets_clone3_through():
    import errno

    from snapfn.snapshot.process.doctor import clone3_finding

    here = clone3_finding()  # this machine, whichever way its filter answers
    assert here.detail.startswith(("allowed", "clone3 answers", "not probed"))
    filtered = clone3_finding(call=lambda: errno.ENOSYS)
    assert not filtered.ok and "ENOSYS" in filtered.detail and "seccomp" in filtered.detail
    assert clone3_finding(call=lambda: errno.EINVAL).ok
