"""Snapshot directory format: validate, and refuse every corruption in one line."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from snapfn.snapshot.errors import BadSnapshot, IncompatibleSnapshot
from snapfn.snapshot.portable.compat import FORMAT_VERSION
from snapfn.snapshot.portable.format import (
    MANIFEST,
    MAX_FILE_BYTES,
    PROCESS_IMAGES,
    check_chunk,
    chunk_digests,
    validate_snapshot,
)

from snapshot_samples import BIG, CHUNK, COMPAT, flip_bit, refusal, write_snapshot


def edit_manifest(snapshot: Path, edit) -> None:
    manifest = json.loads((snapshot / MANIFEST).read_text())
    edit(manifest)
    (snapshot / MANIFEST).write_text(json.dumps(manifest))


@pytest.fixture
def snap(tmp_path: Path) -> Path:
    return write_snapshot(tmp_path / "snap")


# ---------------------------------------------------------------- refusals


def test_bit_flip_in_small_file_is_caught_in_sizes_mode(snap: Path) -> None:
    flip_bit(snap / "weights" / "table.json", 0)
    message = refusal(BadSnapshot, snap)
    assert "'weights/table.json' sha256 mismatch" in message


def test_bit_flip_in_chunked_file_is_named_by_chunk(snap: Path) -> None:
    """A chunked file a restore reads as it is (a big tokenizer or compile cache) is hashed in
    sizes mode too, naming the chunk."""
    flip_bit(snap / "weights" / "big.bin", 2 * CHUNK + 5)
    for verify in ("sizes", "full"):
        message = refusal(BadSnapshot, snap, verify=verify)
        assert "'weights/big.bin' chunk 2 (bytes 2048..3071) sha256 mismatch" in message


def test_sizes_mode_leaves_the_streamed_files_to_their_reader(tmp_path: Path) -> None:
    """The weights (and a function's device memory) are checked chunk by chunk as they stream,
    so sizes mode leaves them to the streamer; `unread` files are left alone too."""
    from snapfn.snapshot.portable.publish import SnapshotWriter

    with SnapshotWriter(tmp_path / "snap", chunk_bytes=CHUNK) as w:
        for rel in ("weights/rank0.bin", "process/cuda0.bin", "process/pages-1.img"):
            (w.root / rel).parent.mkdir(exist_ok=True)
            (w.root / rel).write_bytes(BIG)
        snap = w.publish({"compat": COMPAT})
    for rel in ("weights/rank0.bin", "process/cuda0.bin", "process/pages-1.img"):
        flip_bit(snap / rel, 2 * CHUNK + 5)
    message = refusal(BadSnapshot, snap)  # the image: read as it is
    assert "'process/pages-1.img' chunk 2" in message
    manifest = validate_snapshot(snap, unread=lambda p: p.startswith(PROCESS_IMAGES))
    chunk_bytes, digests = chunk_digests(manifest, "weights/rank0.bin")
    data = (snap / "weights" / "rank0.bin").read_bytes()
    check_chunk("weights/rank0.bin", 1, data[chunk_bytes : 2 * chunk_bytes], digests[1])
    with pytest.raises(BadSnapshot, match="'weights/rank0.bin' chunk 2 sha256 mismatch"):
        check_chunk("weights/rank0.bin", 2, data[2 * chunk_bytes : 3 * chunk_bytes], digests[2])
    message = refusal(BadSnapshot, snap, verify="full")  # full mode hashes every file
    assert "chunk 2 (bytes 2048..3071) sha256 mismatch" in message


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


@pytest.mark.parametrize(
    "relpath, key, value",
    [
        ("tokenizer.json", "size", 10**30),
        ("tokenizer.json", "size", MAX_FILE_BYTES + 1),
        ("weights/big.bin", "chunk_bytes", 2**64),
    ],
)
def test_sizes_past_the_largest_file_are_refused(snap: Path, relpath, key, value) -> None:
    edit_manifest(snap, lambda m: m["files"][relpath].update({key: value}))
    message = refusal(BadSnapshot, snap)
    assert f"manifest.json lists {relpath!r}: {key} {value} is more than the" in message


def test_the_largest_size_passes_the_format_check(snap: Path) -> None:
    edit_manifest(snap, lambda m: m["files"]["tokenizer.json"].update(size=MAX_FILE_BYTES))
    message = refusal(BadSnapshot, snap)
    assert f"'tokenizer.json' has 17 bytes, manifest.json says {MAX_FILE_BYTES} (trunc" in message


@pytest.mark.parametrize(
    "size, offset, length",
    [(0, 0, None), (1, 0, None), (1000, 0, None), ((8 << 20) + 3, 0, None), (5000, 4000, 1000)],
)
def test_sha256_range_reads_whole_files_and_ranges_of_any_size(tmp_path, size, offset, length):
    from snapfn.snapshot.portable.digests import DigestRange, sha256_range

    data = os.urandom(size)
    (tmp_path / "f.bin").write_bytes(data)
    part = data[offset:] if length is None else data[offset : offset + length]
    where = DigestRange("f.bin", length is None, 0, offset, length, "")
    assert sha256_range(tmp_path, where) == hashlib.sha256(part).hexdigest()
