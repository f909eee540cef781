"""Snapshot directory format: publish, validate, refuse every corruption in one line, atomicity."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from snapfn.snapshot import format as fmt
from snapfn.snapshot.errors import BadSnapshot, IncompatibleSnapshot
from snapfn.snapshot.format import (
    FORMAT_VERSION,
    MANIFEST,
    SnapshotWriter,
    check_chunk,
    check_compat,
    chunk_digests,
    compat_key,
    read_manifest,
    remove_stale_temp_dirs,
    validate_snapshot,
)

CHUNK = 1024
COMPAT = {"format_version": FORMAT_VERSION, "device_type": "cpu", "machine": "x86_64"}
BIG = bytes(range(256)) * 20  # 5120 bytes: 5 chunks of CHUNK


def write_snapshot(dest: Path, marker: str = "one", **fields) -> Path:
    with SnapshotWriter(dest, chunk_bytes=CHUNK) as w:
        (w.root / "tokenizer.json").write_text(json.dumps({"marker": marker}))
        (w.root / "weights").mkdir()
        (w.root / "weights" / "table.json").write_text("{}")
        (w.root / "weights" / "big.bin").write_bytes(BIG)
        return w.publish({"compat": COMPAT, "marker": marker, **fields})


def refusal(exc_type: type[Exception], snapshot: Path, **kwargs) -> str:
    with pytest.raises(exc_type) as info:
        validate_snapshot(snapshot, **kwargs)
    message = str(info.value)
    assert "\n" not in message and "\r" not in message, message
    return message


def flip_bit(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def edit_manifest(snapshot: Path, edit) -> None:
    manifest = json.loads((snapshot / MANIFEST).read_text())
    edit(manifest)
    (snapshot / MANIFEST).write_text(json.dumps(manifest))


def siblings(dest: Path) -> list[str]:
    return sorted(os.listdir(dest.parent))


@pytest.fixture
def snap(tmp_path: Path) -> Path:
    return write_snapshot(tmp_path / "snap")


# ---------------------------------------------------------------- publish and validate


def test_publish_then_validate(snap: Path) -> None:
    manifest = validate_snapshot(snap, COMPAT, verify="full")
    assert manifest["format_version"] == FORMAT_VERSION
    assert manifest["marker"] == "one" and manifest["compat"] == COMPAT
    assert manifest["created_at"].endswith("+00:00")
    files = manifest["files"]
    assert list(files) == ["tokenizer.json", "weights/big.bin", "weights/table.json"]
    assert files["weights/table.json"] == {"size": 2, "sha256": hashlib.sha256(b"{}").hexdigest()}
    big = files["weights/big.bin"]
    assert big["size"] == len(BIG) and big["chunk_bytes"] == CHUNK and big["sha256"] is None
    assert big["chunks"] == [
        hashlib.sha256(BIG[i : i + CHUNK]).hexdigest() for i in range(0, len(BIG), CHUNK)
    ]
    assert siblings(snap) == ["snap"]  # no temp dir left behind
    assert validate_snapshot(snap) == read_manifest(snap)


def test_registered_digests_are_trusted_and_checked_in_full_mode(tmp_path: Path) -> None:
    data = os.urandom(3 * 1000 + 7)
    chunks = [hashlib.sha256(data[i : i + 1000]).hexdigest() for i in range(0, len(data), 1000)]
    with SnapshotWriter(tmp_path / "snap") as w:
        (w.root / "rank0.bin").write_bytes(data)
        w.register_chunked("rank0.bin", 1000, chunks, hashlib.sha256(data).hexdigest())
        dest = w.publish({"compat": COMPAT})
    manifest = validate_snapshot(dest, verify="full")
    assert chunk_digests(manifest, "rank0.bin") == (1000, chunks)
    flip_bit(dest / "rank0.bin", 2500)
    assert "'rank0.bin' chunk 2 (bytes 2000..2999) sha256 mismatch" in refusal(
        BadSnapshot, dest, verify="full"
    )


def test_registered_digest_count_must_fit_the_size(tmp_path: Path) -> None:
    expected = "cannot publish 'rank0.bin': 2 chunk digests for 3007 bytes in chunks of 1000"
    with pytest.raises(BadSnapshot, match=expected), SnapshotWriter(tmp_path / "snap") as w:
        (w.root / "rank0.bin").write_bytes(bytes(3007))
        w.register_chunked("rank0.bin", 1000, ["0" * 64] * 2, None)
        w.publish({"compat": COMPAT})
    assert siblings(tmp_path / "snap") == []


def test_publish_refuses_misuse(tmp_path: Path) -> None:
    with SnapshotWriter(tmp_path / "snap") as w:
        with pytest.raises(ValueError, match="set by publish"):
            w.publish({"compat": COMPAT, "files": {}})
        with pytest.raises(ValueError, match="compat"):
            w.publish({"memory_plan": {}})
        with pytest.raises(ValueError, match="escapes"):
            w.register_chunked("../x.bin", 1000, [], None)
        (w.root / MANIFEST).write_text("{}")
        with pytest.raises(ValueError, match="publish\\(\\) writes it"):
            w.publish({"compat": COMPAT})
    assert siblings(tmp_path / "snap") == []


# ---------------------------------------------------------------- refusals


def test_bit_flip_in_small_file_is_caught_in_sizes_mode(snap: Path) -> None:
    flip_bit(snap / "weights" / "table.json", 0)
    message = refusal(BadSnapshot, snap)
    assert "'weights/table.json' sha256 mismatch" in message


def test_bit_flip_in_chunked_file_is_named_by_chunk(snap: Path) -> None:
    flip_bit(snap / "weights" / "big.bin", 2 * CHUNK + 5)
    manifest = validate_snapshot(snap)  # sizes mode leaves chunks to the streamer...
    chunk_bytes, digests = chunk_digests(manifest, "weights/big.bin")
    data = (snap / "weights" / "big.bin").read_bytes()
    check_chunk("weights/big.bin", 1, data[chunk_bytes : 2 * chunk_bytes], digests[1])
    with pytest.raises(BadSnapshot, match="'weights/big.bin' chunk 2 sha256 mismatch"):
        check_chunk("weights/big.bin", 2, data[2 * chunk_bytes : 3 * chunk_bytes], digests[2])
    message = refusal(BadSnapshot, snap, verify="full")  # ...and full mode names it
    assert "'weights/big.bin' chunk 2 (bytes 2048..3071) sha256 mismatch" in message


def test_truncation(snap: Path) -> None:
    os.truncate(snap / "weights" / "big.bin", len(BIG) - 1)
    assert "'weights/big.bin' has 5119 bytes, manifest.json says 5120" in refusal(BadSnapshot, snap)


def test_missing_file(snap: Path) -> None:
    (snap / "tokenizer.json").unlink()
    assert "'tokenizer.json' is listed in manifest.json but missing" in refusal(BadSnapshot, snap)


def test_extra_unlisted_file(snap: Path) -> None:
    (snap / "weights" / "stray.bin").write_bytes(b"x")
    assert "'weights/stray.bin' is not listed in manifest.json" in refusal(BadSnapshot, snap)


def test_symlink_is_refused(snap: Path, tmp_path: Path) -> None:
    (tmp_path / "outside").write_text("x")
    (snap / "weights" / "link").symlink_to(tmp_path / "outside")
    assert "'weights/link' is a symlink" in refusal(BadSnapshot, snap)


def test_messages_stay_on_one_line_with_hostile_names(snap: Path) -> None:
    (snap / "evil\nname").write_text("x")
    assert "'evil\\nname' is not listed" in refusal(BadSnapshot, snap)


def test_missing_directory_and_manifest(tmp_path: Path, snap: Path) -> None:
    assert "no snapshot directory" in refusal(BadSnapshot, tmp_path / "nowhere")
    (snap / MANIFEST).unlink()
    assert "manifest.json is missing" in refusal(BadSnapshot, snap)


def test_manifest_not_json(snap: Path) -> None:
    (snap / MANIFEST).write_text('{"format_version": 1,\n "files": ')
    assert "manifest.json is not valid JSON" in refusal(BadSnapshot, snap)
    (snap / MANIFEST).write_text("[1, 2]")
    assert "manifest.json is not a JSON object" in refusal(BadSnapshot, snap)


@pytest.mark.parametrize("key", ["format_version", "created_at", "compat", "files"])
def test_manifest_missing_key(snap: Path, key: str) -> None:
    edit_manifest(snap, lambda m: m.pop(key))
    assert f"manifest.json lacks required key '{key}'" in refusal(BadSnapshot, snap)


def test_wrong_format_version(snap: Path) -> None:
    edit_manifest(snap, lambda m: m.update(format_version=FORMAT_VERSION + 1))
    message = refusal(IncompatibleSnapshot, snap)
    assert f"format_version is {FORMAT_VERSION + 1}, this build reads {FORMAT_VERSION}" in message


def test_wrong_compat_key(snap: Path) -> None:
    message = refusal(IncompatibleSnapshot, snap, current_compat={**COMPAT, "machine": "aarch64"})
    assert "snapshot was made for machine='x86_64', this machine has 'aarch64'" in message


@pytest.mark.parametrize(
    "relpath, problem",
    [
        ("../outside.bin", "path escapes the snapshot directory (..)"),
        ("weights/../../outside.bin", "path escapes the snapshot directory (..)"),
        ("/etc/passwd", "absolute path"),
        ("weights/./big.bin", "path is not in canonical form"),
        ("weights//big.bin", "path is not in canonical form"),
        (MANIFEST, "reserved name"),
    ],
)
def test_unsafe_path_in_manifest(snap: Path, relpath: str, problem: str) -> None:
    def add_entry(manifest: dict) -> None:
        manifest["files"][relpath] = {"size": 0, "sha256": hashlib.sha256(b"").hexdigest()}

    edit_manifest(snap, add_entry)
    message = refusal(BadSnapshot, snap)
    assert f"manifest.json lists {relpath!r}: " in message and message.endswith(problem)


def test_malformed_entries(snap: Path) -> None:
    edit_manifest(snap, lambda m: m["files"]["weights/big.bin"]["chunks"].pop())
    assert "4 chunk digests for 5120 bytes in chunks of 1024" in refusal(BadSnapshot, snap)
    edit_manifest(snap, lambda m: m["files"]["tokenizer.json"].update(sha256="ABC"))
    assert "sha256 'ABC' is not 64 lowercase hex digits" in refusal(BadSnapshot, snap)


# ---------------------------------------------------------------- compat key


def test_check_compat_names_the_first_mismatch() -> None:
    recorded = {"device_type": "cuda", "gpu_name": "NVIDIA H100", "world_size": 2}
    current = {"device_type": "cuda", "gpu_name": "NVIDIA H200", "world_size": 1}
    with pytest.raises(IncompatibleSnapshot) as info:
        check_compat(recorded, current)
    assert (
        str(info.value)
        == "snapshot was made for gpu_name='NVIDIA H100', this machine has 'NVIDIA H200'"
    )
    check_compat(
        recorded, {**current, "gpu_name": "NVIDIA H100"}, fields=["device_type", "gpu_name"]
    )
    with pytest.raises(IncompatibleSnapshot, match="triton=<missing>, this machine has '3.5.0'"):
        check_compat(recorded, {**recorded, "triton": "3.5.0"})


def test_compat_key_on_cpu_survives_json() -> None:
    key = compat_key("cpu", world_size=4)
    assert key["device_type"] == "cpu" and key["world_size"] == 4
    assert key["format_version"] == FORMAT_VERSION and key["machine"]
    assert "gpu_name" not in key and "python" in key and "torch" in key
    check_compat(json.loads(json.dumps(key)), key)


@pytest.mark.gpu
def test_compat_key_on_cuda() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    key = compat_key("cuda", world_size=1)
    assert key["gpu_name"] == torch.cuda.get_device_name(0)
    assert key["compute_capability"].count(".") == 1 and key["cuda_driver_version"] > 0
    check_compat(json.loads(json.dumps(key)), key)


# ---------------------------------------------------------------- atomicity


def test_exception_inside_with_leaves_nothing(tmp_path: Path) -> None:
    dest = tmp_path / "snap"
    with pytest.raises(RuntimeError, match="boom"), SnapshotWriter(dest) as w:
        (w.root / "a.bin").write_bytes(b"a")
        raise RuntimeError("boom")
    assert siblings(dest) == []


def test_exception_inside_with_keeps_the_old_snapshot(snap: Path) -> None:
    with pytest.raises(RuntimeError, match="boom"), SnapshotWriter(snap) as w:
        (w.root / "a.bin").write_bytes(b"a")
        raise RuntimeError("boom")
    assert validate_snapshot(snap)["marker"] == "one" and siblings(snap) == ["snap"]


def test_leaving_without_publish_leaves_nothing(tmp_path: Path) -> None:
    with SnapshotWriter(tmp_path / "snap") as w:
        (w.root / "a.bin").write_bytes(b"a")
    assert siblings(tmp_path / "snap") == []


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2-exchange", "rename-aside"])
def test_replace_is_never_half_visible(
    snap: Path, monkeypatch: pytest.MonkeyPatch, exchange: bool
) -> None:
    """At every rename publish makes, `snap` is the old snapshot, the new one, or (fallback only)
    absent; never a directory that fails validation."""
    seen: list[str] = []

    def observe() -> None:
        if not os.path.lexists(snap):
            seen.append("absent")
            return
        seen.append(validate_snapshot(snap, verify="full")["marker"])

    real_exchange, real_rename = fmt._exchange, os.rename

    def spying_exchange(first: Path, second: Path) -> bool:
        observe()
        swapped = real_exchange(first, second) if exchange else False
        observe()
        return swapped

    def spying_rename(src, dst) -> None:
        observe()
        real_rename(src, dst)
        observe()

    monkeypatch.setattr(fmt, "_exchange", spying_exchange)
    monkeypatch.setattr(fmt.os, "rename", spying_rename)
    write_snapshot(snap, marker="two")
    monkeypatch.undo()
    assert validate_snapshot(snap, verify="full")["marker"] == "two"
    assert siblings(snap) == ["snap"]
    if exchange:
        assert seen == ["one", "two"]
    else:
        assert seen == ["one", "one", "one", "absent", "absent", "two"]


def test_concurrent_reader_always_finds_a_snapshot(snap: Path) -> None:
    if not fmt._exchange(snap, snap):  # swapping a path with itself probes for support
        pytest.skip("filesystem without renameat2(RENAME_EXCHANGE)")
    stop, failures = threading.Event(), []

    def read_forever() -> None:
        while not stop.is_set():
            try:
                read_manifest(snap)
            except BadSnapshot as e:
                failures.append(str(e))
            time.sleep(0)  # let the writer thread have the GIL between reads

    reader = threading.Thread(target=read_forever)
    reader.start()
    try:
        for i in range(20):
            write_snapshot(snap, marker=f"v{i}")
    finally:
        stop.set()
        reader.join()
    assert failures == []
    assert validate_snapshot(snap)["marker"] == "v19"


def test_refuses_to_replace_a_directory_that_is_not_a_snapshot(tmp_path: Path) -> None:
    dest = tmp_path / "home"
    dest.mkdir()
    (dest / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a snapshot"):
        write_snapshot(dest)
    assert os.listdir(dest) == ["precious.txt"] and siblings(dest) == ["home"]


# ---------------------------------------------------------------- crashed writers

CRASHING_WRITER = """
import sys, time
from pathlib import Path
from snapfn.snapshot import format as fmt

dest, stage = Path(sys.argv[1]), sys.argv[2]
if stage == "before-install":
    fmt._install = lambda staged, dest: time.sleep(600)
with fmt.SnapshotWriter(dest) as w:
    (w.root / "first.bin").write_bytes(b"x" * 1000)
    if stage == "between-files":
        print(w.root, flush=True)
        time.sleep(600)
    (w.root / "second.bin").write_bytes(b"y" * 1000)
    print(w.root, flush=True)
    w.publish({"compat": {"device_type": "cpu"}, "marker": "crashed"})
"""


def kill_writer_mid_way(dest: Path, stage: str) -> Path:
    """Run a writer in a child, SIGKILL it at `stage`, reap it; return its temp dir."""
    child = subprocess.Popen(
        [sys.executable, "-c", CRASHING_WRITER, str(dest), stage], stdout=subprocess.PIPE, text=True
    )
    try:
        temp = Path(child.stdout.readline().strip())
        deadline = time.monotonic() + 30
        while stage == "before-install" and not (temp / MANIFEST).exists():
            assert time.monotonic() < deadline and child.poll() is None, "writer never got there"
            time.sleep(0.01)  # publish is hashing; then it writes the manifest and blocks
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
    assert temp.name.startswith(f".{dest.name}.tmp-{child.pid}-") and temp.is_dir()
    return temp


def test_crash_between_files_never_publishes(tmp_path: Path) -> None:
    dest = tmp_path / "snap"
    temp = kill_writer_mid_way(dest, "between-files")
    assert "no snapshot directory" in refusal(BadSnapshot, dest)
    write_snapshot(dest)
    assert not temp.exists() and siblings(dest) == ["snap"]


def test_crash_before_install_keeps_the_old_snapshot(snap: Path) -> None:
    temp = kill_writer_mid_way(snap, "before-install")
    assert validate_snapshot(snap, verify="full")["marker"] == "one"
    assert remove_stale_temp_dirs(snap) == [temp]
    assert siblings(snap) == ["snap"]


def test_live_or_locked_temp_dirs_are_left_alone(tmp_path: Path) -> None:
    dest = tmp_path / "snap"
    dead = subprocess.Popen(["true"])
    dead.wait()
    live = tmp_path / f".snap.tmp-{os.getpid()}-{'a' * 16}"
    locked = tmp_path / f".snap.tmp-{dead.pid}-{'b' * 16}"
    stale = tmp_path / f".snap.tmp-{dead.pid}-{'c' * 16}"
    unrelated = tmp_path / f".snap.tmp-x.tmp-{dead.pid}-{'d' * 16}"
    for path in (live, locked, stale, unrelated):
        path.mkdir()
    fd = os.open(locked, os.O_RDONLY)
    try:
        fmt.fcntl.flock(fd, fmt.fcntl.LOCK_EX)
        assert remove_stale_temp_dirs(dest) == [stale]
    finally:
        os.close(fd)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in (live, locked, unrelated)
    )
