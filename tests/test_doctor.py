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
