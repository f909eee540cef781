"""Process snapshots (tier 1) on CPU: a real criu checkpoint of a warmed worker, restored.

Needs root and criu 4.x (`infra/install-criu.sh`; CI runs it); without them every test that
dumps skips with criu's reason. The host (tests/process_hosts.py) keeps a counter and a random
draw in memory and its "weights" in a releasable region that is streamed back after restore.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import pytest

from snapfn.snapshot.portable.format import read_manifest
from snapfn.snapshot.process import worker_process as process
from snapfn.snapshot.process.criu import CriuConfig, is_running
from snapfn.snapshot.process.snapshot import (
    ProcessRestoreFailed,
    init_process_snapshot,
    restore_process_snapshot,
)

HOST = "process_hosts:make"


pytestmark = pytest.mark.usefixtures("tests_on_pythonpath")


@pytest.fixture(scope="module")
def config(criu_config):
    return process.ProcessConfig(criu=criu_config, restore_timeout_s=60)


def make_snapshot(tmp_path: Path, config, **args) -> tuple[Path, dict]:
    dest = tmp_path / "snap"
    args = {"weights_file": str(tmp_path / "weights.bin"), "start": 5, **args}
    startup, manifest = init_process_snapshot(HOST, args, dest, config, log=None)
    return dest, manifest | {"startup_obj": startup}


def restore(dest: Path, config, **resume):
    return restore_process_snapshot(dest, resume, device="cpu", config=config, log=None)


def ask(worker, op: str = "state", **fields) -> dict:
    worker.channel.send({"op": op, "id": 7, **fields})
    return worker.channel.recv(timeout_s=30)


@pytest.fixture(scope="module")
def snapshot(config, tmp_path_factory):
    return make_snapshot(tmp_path_factory.mktemp("tier1"), config)


def test_restored_worker_keeps_its_state_and_gets_its_weights_back(snapshot, config):
    dest, manifest = snapshot
    assert manifest["tier"] == "process" and manifest["process"]["hooks"] == ["release_weights"]
    worker, startup, _ = restore(dest, config)
    try:
        names = [s.name for s in startup.stages]
        # validate runs beside criu restore; the worker resumes after both (the gate)
        assert "validate" in names, names
        assert [n for n in names if n != "validate"][:3] == ["criu_restore", "gate", "resume"]
        assert "worker.stream_weights" in names and startup.ok
        stream = startup.stage("worker.stream_weights").figures
        assert stream["zero_after_restore"] == 0.0  # the weights were not in the image
        state = ask(worker, "add", n=3)
        assert state["counter"] == 8  # 5 from init + 3: the heap came back
        elems = state["resident_bytes"] // 4
        assert state["weights_sum"] == elems * (elems - 1) / 2  # streamed back in full
    finally:
        worker.kill()


def test_one_image_restores_twice_at_once_and_each_copy_is_unique(snapshot, config):
    if not process.pid_namespace_works():
        pytest.skip("unshare --pid does not work here: a restored worker keeps its pid")
    dest, manifest = snapshot
    assert manifest["process"]["host_pid"] is None  # no pid to wait for at restore
    first, s1, _ = restore(dest, config)
    second, s2, _ = restore(dest, config)
    try:
        assert s1.stage("criu_restore").figures["namespaces"] == ["pid"]
        assert "pid_free" not in [s.name for s in s1.stages]
        assert first.pid != second.pid and is_running(first.pid) and is_running(second.pid)
        a, b = ask(first, "add", n=1), ask(second, "add", n=10)
        assert (a["counter"], b["counter"]) == (6, 15)  # independent processes
        assert a["init_draw"] == b["init_draw"]  # the same image …
        assert a["draw"] != b["draw"]  # … re-seeded apart after restore
        assert a["request_prefix"] != b["request_prefix"] != "req"
        assert s1.info["identity"]["reseeded"][:1] == ["random"]
    finally:
        first.kill()
        second.kill()


def test_a_worker_with_its_own_mount_namespace_restores_twice_at_once(criu_config, tmp_path):
    # NOTE: the mode meant for CUDA workers (CUDA needs a /proc of its pid namespace)
    if not process.pid_namespace_works(mount=True):
        pytest.skip("unshare --pid --fork --mount-proc does not work here")
    config = process.ProcessConfig(criu=criu_config, restore_timeout_s=60, pid_namespace="mount")
    dest, manifest = make_snapshot(tmp_path, config)
    assert manifest["tier"] == "process" and manifest["process"]["mount_namespace"] is True
    first, _, _ = restore(dest, config)
    second, _, _ = restore(dest, config)
    try:
        a, b = ask(first, "add", n=1), ask(second, "add", n=10)
        assert (a["counter"], b["counter"]) == (6, 15)
        ours = os.readlink("/proc/self/ns/mnt")
        theirs = {os.readlink(f"/proc/{w.pid}/ns/mnt") for w in (first, second)}
        assert len(theirs) == 2 and ours not in theirs  # a mount namespace each, not ours
        for worker in (first, second):  # pid 1 of its own namespace, which its /proc shows
            status = Path(f"/proc/{worker.pid}/status").read_text()
            assert status.split("NSpid:")[1].split()[1] == "1"
            its_proc = os.listdir(f"/proc/{worker.pid}/root/proc")
            assert "1" in its_proc and str(os.getpid()) not in its_proc
    finally:
        first.kill()
        second.kill()


def dumped_bytes(manifest: dict) -> int:
    """What the dump held: criu's images plus the memory moved out of them to memory.bin."""
    moved = manifest["process"]["memory"]
    return manifest["process"]["image_bytes"] + (moved["moved_bytes"] if moved else 0)


def test_released_weights_stay_out_of_the_image(config, tmp_path):
    _, released = make_snapshot(tmp_path / "a", config, weight_mb=64)
    _, kept = make_snapshot(tmp_path / "b", config, weight_mb=64, keep_weights=True)
    grown = dumped_bytes(kept) - dumped_bytes(released)
    assert grown > 60 << 20, grown


def test_large_memory_restores_from_the_memory_file_intact_and_private_to_each_copy(
    config, tmp_path
):
    dest, manifest = make_snapshot(tmp_path, config, heap_mb=48)
    moved = manifest["process"]["memory"]
    assert moved["moved_bytes"] > 48 << 20 and moved["pieces"] >= 1
    assert manifest["process"]["image_bytes"] < moved["moved_bytes"]  # criu copies the rest
    assert (dest / "process" / "memory.bin").stat().st_size == moved["file_bytes"]
    copies = [restore(dest, config)[0] for _ in range(2 if process.pid_namespace_works() else 1)]
    try:
        first = ask(copies[0], "heap", value=7)
        maps = Path(f"/proc/{copies[0].pid}/maps").read_text().splitlines()
        mapped = [line for line in maps if line.endswith("/memory.bin")]
        assert first["unchanged"] and first["first"] == 7
        assert any(_holds(line, first["address"]) for line in mapped), mapped
        for other in copies[1:]:  # the first copy's writes stay its own
            assert ask(other, "heap", value=9)["unchanged"]
        assert ask(copies[0], "heap", value=8)["unchanged"] is False  # it sees its own writes
        copies.append(restore(dest, config)[0])
        assert ask(copies[-1], "heap", value=1)["unchanged"]  # the file is as it was
    finally:
        for worker in copies:
            worker.kill()


def _holds(maps_line: str, address: int) -> bool:
    start, end = (int(x, 16) for x in maps_line.split()[0].split("-"))
    return start <= address < end


def test_memory_image_setting_keeps_every_page_in_criu_s_image(config, tmp_path):
    import dataclasses

    dest, manifest = make_snapshot(
        tmp_path, dataclasses.replace(config, memory="image"), heap_mb=16
    )
    assert manifest["process"]["memory"] is None and not (dest / "process" / "memory.bin").exists()
    assert manifest["process"]["image_bytes"] > 16 << 20
    worker, _, _ = restore(dest, config)
    try:
        assert ask(worker, "heap", value=3)["unchanged"]
    finally:
        worker.kill()


@pytest.mark.parametrize(
    ("setup", "reason"),
    [
        ({"criu_binary": "/nonexistent/criu"}, "not an executable"),
        ({"fail_at": "before_snapshot"}, "injected failure at before_snapshot"),
        ({"claim_cuda": True}, "cu"),  # no CUDA checkpoint API on a CPU machine
    ],
)
def test_a_failed_checkpoint_publishes_the_portable_tier_with_the_reason(
    config, tmp_path, setup, reason
):
    if "criu_binary" in setup:
        config = process.ProcessConfig(criu=CriuConfig(binary=setup.pop("criu_binary")))
    dest, manifest = make_snapshot(tmp_path, config, **setup)
    assert manifest["tier"] == "portable" and "process" not in manifest
    (fallback,) = manifest["startup"]["fallbacks"]
    assert (fallback["from"], fallback["to"], fallback["step"]) == (
        "process",
        "portable",
        "checkpoint",
    )
    assert reason in fallback["reason"]
    assert not (dest / "process").exists()
    read_manifest(dest)  # published and readable


def test_a_failed_init_publishes_nothing(config, tmp_path):
    with pytest.raises(Exception, match="injected failure at init"):
        make_snapshot(tmp_path, config, fail_at="init")
    assert not (tmp_path / "snap").exists()


def test_failing_after_restore_kills_the_worker_and_names_the_step(config, tmp_path):
    dest, _ = make_snapshot(tmp_path, config, fail_at="after_restore")
    with pytest.raises(ProcessRestoreFailed, match="injected failure at after_restore") as info:
        restore(dest, config)
    assert info.value.step == "resume"
    pid = info.value.startup.stage("criu_restore").figures["pid"]
    assert _gone(pid)


def test_a_restore_that_takes_too_long_is_killed(snapshot, config):
    dest, _ = snapshot
    slow = process.ProcessConfig(criu=config.criu, restore_timeout_s=1)
    with pytest.raises(ProcessRestoreFailed, match="within 1 s") as info:
        restore(dest, slow, sleep_s=30)
    assert _gone(info.value.startup.stage("criu_restore").figures["pid"])


@pytest.mark.parametrize(
    ("lazy", "damaged"), [("auto", "pages-*.img"), ("off", "pages-*.img"), ("off", "memory.bin")]
)  # CPU: auto means lazy pages
def test_a_truncated_image_is_refused_before_criu_runs(config, tmp_path, lazy, damaged):
    import dataclasses

    config = dataclasses.replace(config, lazy=lazy)
    dest, _ = make_snapshot(tmp_path, config, heap_mb=8)
    pages = next((dest / "process").glob(damaged))
    with open(pages, "r+b") as f:
        f.truncate(pages.stat().st_size // 2)
    with pytest.raises(ProcessRestoreFailed, match="validate") as info:
        restore(dest, config)
    assert info.value.step == "validate"
    # NOTE: criu given a truncated image hangs until killed (lazily or eagerly)
    assert not criu_processes_on(dest), "criu left running on the truncated image"


def criu_processes_on(dest) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            args = cmdline.read_bytes().split(b"\0")
            if any(str(dest).encode() in a for a in args) and any(b"criu" in a for a in args):
                found.append(cmdline.parent.name)
    return found


def test_a_damaged_image_that_criu_rejects_fails_at_criu_restore(config, tmp_path):
    dest, _ = make_snapshot(tmp_path, config)
    core = dest / "process" / "pstree.img"
    data = bytearray(core.read_bytes())
    data[8:] = b"\xff" * (len(data) - 8)  # same size: only criu can tell
    core.write_bytes(bytes(data))
    manifest = read_manifest(dest)
    manifest_path = dest / "manifest.json"
    # NOTE: re-record the digests (the image files' are chunk digests, hashed by validation)
    # so that validation passes and criu itself meets the damage
    import hashlib
    import json

    entry = manifest["files"]["process/pstree.img"]
    digest = hashlib.sha256(data).hexdigest()
    assert len(data) <= entry.get("chunk_bytes", len(data))  # one chunk
    entry.update(sha256=digest, **({"chunks": [digest]} if "chunks" in entry else {}))
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ProcessRestoreFailed) as info:
        restore(dest, config)
    assert info.value.step == "criu_restore", info.value


def _gone(pid: int, wait_s: float = 5.0) -> bool:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if not is_running(pid):
            return True
        time.sleep(0.02)
    return False


def test_a_snapshot_for_another_machine_is_refused_before_the_worker_resumes(config, tmp_path):
    import json

    dest, _ = make_snapshot(tmp_path, config)
    manifest_path = dest / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["compat"]["torch"] = "0.0.0"  # made with another torch
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ProcessRestoreFailed, match="torch='0.0.0'") as info:
        restore(dest, config)
    assert info.value.step == "gate"
    assert _gone(info.value.startup.stage("criu_restore").figures["pid"])


def test_a_failed_criu_dump_publishes_the_portable_tier_with_criu_reason(tmp_path):
    from criu_fakes import fake_criu

    body = (
        '[ "$1" = check ] && exit 0\n'
        "for a; do case $prev in --log-file) log=$a;; esac; prev=$a; done\n"
        'echo "(00.01) Error (criu/cr-dump.c:1): injected dump failure" > "$log"\nexit 1\n'
    )
    criu = CriuConfig(binary=str(fake_criu(tmp_path, body)))
    _, manifest = make_snapshot(tmp_path, process.ProcessConfig(criu=criu))
    assert manifest["tier"] == "portable"
    (fallback,) = manifest["startup"]["fallbacks"]
    assert fallback["step"] == "checkpoint" and "injected dump failure" in fallback["reason"]


def test_process_settings_come_from_the_environment_and_bad_ones_are_refused():
    environ = {"SNAPFN_PROCESS_MEMORY": "image", "SNAPFN_PROCESS_PREFETCH_THREADS": "16"}
    config = process.ProcessConfig.from_env(environ | {"SNAPFN_PROCESS_PREFETCH_READ": "register"})
    assert (config.memory, config.prefetch_threads, config.prefetch_read) == (
        "image",
        16,
        "register",
    )
    assert process.ProcessConfig.from_env({}).memory == "file"
    for name, value in [("MEMORY", "disk"), ("PREFETCH_READ", "mmap"), ("PREFETCH_THREADS", "0")]:
        with pytest.raises(ValueError, match=name.lower()):
            process.ProcessConfig.from_env({f"SNAPFN_PROCESS_{name}": value})


def test_a_restore_waits_for_its_pid_to_be_freed_and_names_what_holds_it():
    import subprocess
    import sys
    import threading

    from snapfn.snapshot.errors import RestoreFailed
    from snapfn.snapshot.process.worker_process import wait_for_pid

    exiting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    threading.Thread(target=exiting.wait, daemon=True).start()  # reaped as soon as it exits
    figures: dict = {}
    wait_for_pid(exiting.pid, 10.0, figures)
    assert 0.1 < figures["waited_s"] < 10.0
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(RestoreFailed, match=rf"pid {holder.pid}, which .* is taken by 'python"):
            wait_for_pid(holder.pid, 0.2, {})
    finally:
        holder.kill()
        holder.wait()


MOUNTS_SCRIPT = """
set -e
mkdir -p "$ROOT/t" "$ROOT/bound"
mount -t tmpfs tmpfs "$ROOT/t"
mkdir "$ROOT/t/sub"
mount --bind "$ROOT/t/sub" "$ROOT/bound"
umount -l "$ROOT/t"   # the bind's source is now out of reach, as a container's driver mount is
exec "$PYTHON" -c "$CODE"
"""
MOUNTS_CODE = """
import os, sys
from pathlib import Path
sys.path.insert(0, os.environ["TESTS"])
from snapfn.snapshot.process import worker_process as process
from snapfn.snapshot.process.criu import CriuConfig
from test_worker_process import ask, make_snapshot, restore
config = process.ProcessConfig(
    criu=CriuConfig.from_env(os.environ), restore_timeout_s=60, pid_namespace="mount"
)
dest, manifest = make_snapshot(Path(os.environ["ROOT"]), config)
assert manifest["tier"] == "process", manifest["startup_obj"].fallbacks
first, _, _ = restore(dest, config)
second, _, _ = restore(dest, config)
print("counters", ask(first, "add", n=1)["counter"], ask(second, "add", n=10)["counter"])
first.kill(); second.kill()
"""


def test_a_mount_namespace_with_an_unreachable_bind_mount_dumps_it_as_external(
    criu_config, tmp_path
):
    """What a container's bind mounts look like from a worker's own mount namespace: criu
    dumps them as external mounts and binds them again at restore, twice at once."""
    import shutil
    import subprocess
    import sys

    if not process.pid_namespace_works(mount=True) or shutil.which("unshare") is None:
        pytest.skip("unshare --pid --fork --mount-proc does not work here")
    env = {**os.environ, "ROOT": str(tmp_path), "PYTHON": sys.executable, "CODE": MOUNTS_CODE}
    env["TESTS"] = str(Path(__file__).parent)
    unshare = ["unshare", "--mount", "--propagation", "private", "sh", "-c"]
    probe = subprocess.run(  # the mounts alone, in a folder of their own
        [*unshare, MOUNTS_SCRIPT.replace('exec "$PYTHON" -c "$CODE"', "true")],
        capture_output=True,
        text=True,
        env={**env, "ROOT": str(tmp_path / "probe")},
        timeout=60,
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot make the mounts here: {probe.stderr.strip()[-200:]}")
    done = subprocess.run(
        [*unshare, MOUNTS_SCRIPT], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "counters 6 15" in done.stdout


def test_an_abstract_socket_needs_a_network_namespace_per_copy(criu_config, tmp_path):
    """A worker holding an abstract unix socket (a CUDA worker does): two copies restored in one
    network namespace collide on its name; with a network namespace each (`isolated`) both
    restore at once."""
    from snapfn.snapshot.process.snapshot import ProcessRestoreFailed

    if not process.pid_namespace_works(extra=process.NAMESPACE_FLAGS["isolated"]):
        pytest.skip("unshare --pid --fork --mount-proc --net does not work here")
    name = f"snapfn-test-{os.getpid()}"
    shared = process.ProcessConfig(criu=criu_config, restore_timeout_s=60, pid_namespace="mount")
    dest, manifest = make_snapshot(tmp_path / "shared", shared, abstract_socket=name)
    assert manifest["process"]["host_pid"] is None
    first, _, _ = restore(dest, shared)
    try:
        with pytest.raises(ProcessRestoreFailed, match="Address already in use"):
            restore(dest, shared)
    finally:
        first.kill()
    own = process.ProcessConfig(criu=criu_config, restore_timeout_s=60, pid_namespace="isolated")
    dest, manifest = make_snapshot(tmp_path / "own", own, abstract_socket=name)
    if manifest["tier"] != "process":  # e.g. a criu that cannot dump a network namespace here
        pytest.skip(
            f"criu cannot dump a network namespace here: {manifest['startup_obj'].fallbacks}"
        )
    assert manifest["process"]["net_namespace"] is True
    assert manifest["process"]["host_pid"] is None  # its own pid namespace: restores into any
    first, startup, _ = restore(dest, own)
    second, _, _ = restore(dest, own)
    try:
        assert startup.stage("criu_restore").figures["namespaces"] == ["pid", "mnt", "net"]
        assert (ask(first, "add", n=1)["counter"], ask(second, "add", n=10)["counter"]) == (6, 15)
        theirs = {os.readlink(f"/proc/{w.pid}/ns/net") for w in (first, second)}
        assert len(theirs) == 2 and os.readlink("/proc/self/ns/net") not in theirs
    finally:
        first.kill()
        second.kill()


def test_a_cuda_worker_gets_its_own_namespaces_by_default_where_unshare_can_make_them():
    """`auto` for a CUDA worker: `isolated` (a pid, mount and network namespace, so copies of one
    image restore at once) where `unshare` makes them, else the host's pid; a CPU worker keeps
    `auto`, and a value set by hand is kept on either device."""
    auto = process.ProcessConfig()
    works = process.pid_namespace_works(extra=process.NAMESPACE_FLAGS["isolated"])
    assert auto.for_device("cuda:0").pid_namespace == ("isolated" if works else "off")
    assert auto.for_device("cpu").pid_namespace == "auto"
    for mode in ("off", "mount", "on"):
        chosen = process.ProcessConfig(pid_namespace=mode)
        assert chosen.for_device("cuda").pid_namespace == mode
