"""Restore-layout files: writer, table checks, and the streamer (CPU here; CUDA when present)."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import random

import pytest
import torch

from snapfn.snapshot import weights
from snapfn.snapshot.errors import BadSnapshot
from snapfn.snapshot.weights import (
    RestoreLayout,
    WeightStreamer,
    load_layout_tensors,
    measure_disk_read_gbps,
    measure_h2d_gbps,
    odd_weights,
    sum64,
    sum64_bytes,
    write_restore_layout,
)

ALIGN, CHUNK = 512, 4096  # small, so tensors span chunks and chunks hold several tensors

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (none here)"
)


def mixed_tensors(device: str = "cpu") -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    tensors = [
        ("fp32", torch.randn(33, 17, generator=g)),  # 2244 bytes
        ("bf16", torch.randn(3000, generator=g).bfloat16()),  # 6000 bytes: spans 2+ chunks
        ("fp8", torch.randn(64, 9, generator=g).to(torch.float8_e4m3fn)),
        ("int64", torch.randint(-(2**40), 2**40, (700,), generator=g)),
        ("scalar", torch.tensor(2.5, dtype=torch.float64)),  # 0-d
        ("empty", torch.empty(0, 7)),
        ("flags", torch.rand(13, generator=g) > 0.5),
        ("fp16_tail", torch.randn(5, generator=g).half()),
    ]
    return [(name, t.to(device)) for name, t in tensors]


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().reshape(-1).view(torch.uint8)


def assert_bitwise_equal(expected: list[tuple[str, torch.Tensor]], got: dict) -> None:
    assert sorted(got) == sorted(name for name, _ in expected)
    for name, t in expected:
        assert (got[name].dtype, got[name].shape) == (t.dtype, t.shape), name
        assert torch.equal(raw(got[name]), raw(t)), name


def empty_like_table(layout: RestoreLayout, device: str = "cpu") -> dict[str, torch.Tensor]:
    return {
        name: torch.empty(e.shape, dtype=getattr(torch, e.dtype), device=device)
        for name, e in layout.tensors.items()
    }


def flip_byte(path, pos: int) -> None:
    with open(path, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)
        f.seek(pos)
        f.write(bytes([byte[0] ^ 0xFF]))


def reference_sum64(data: bytes) -> int:
    """sum64 with Python ints: Σ w[i]·(2i+1) mod 2^64 over zero-padded little-endian words."""
    data = data + bytes(-len(data) % 8)
    words = [int.from_bytes(data[i : i + 8], "little", signed=True) for i in range(0, len(data), 8)]
    total = sum(w * (2 * i + 1) for i, w in enumerate(words)) % 2**64
    return total - 2**64 if total >= 2**63 else total


def random_words(n: int, seed: int) -> list[int]:
    """int64 values, half of them at or near the extremes so that products and sums overflow."""
    rng = random.Random(seed)
    extremes = [2**63 - 1, -(2**63), -1, 2**62 + 12345, -(2**62) - 3]
    return [
        rng.choice(extremes) if rng.random() < 0.5 else rng.randrange(-(2**63), 2**63)
        for _ in range(n)
    ]


@pytest.fixture
def written(tmp_path):
    tensors = mixed_tensors()
    path = tmp_path / "rank0.weights"
    layout = write_restore_layout(path, tensors, align=ALIGN, chunk_bytes=CHUNK)
    return path, layout, tensors


# --- sum64 -------------------------------------------------------------------------------------


def test_int64_sum_and_product_wrap_on_cpu():
    big = torch.tensor([2**63 - 1, 1], dtype=torch.int64)
    assert big.sum().dtype == torch.int64 and int(big.sum()) == -(2**63)  # wraps, no saturation
    assert int((big * 2)[0]) == -2  # (2^63 - 1)·2 mod 2^64


@pytest.mark.parametrize("n", [1, 7, 1000, 100_003])
def test_sum64_matches_python_reference(n):
    values = random_words(n, seed=n)
    words = torch.tensor(values, dtype=torch.int64)
    expected = reference_sum64(words.numpy().tobytes())
    assert int(sum64(words)) == expected
    weights, scratch = odd_weights(n + 5), torch.empty(n + 5, dtype=torch.int64)
    out = torch.full((3,), 7, dtype=torch.int64)
    assert int(sum64(words, weights, scratch=scratch, out=out[1])) == expected
    assert out.tolist() == [7, expected, 7]  # written in place, neighbours untouched


@pytest.mark.parametrize("start,length", [(0, 64), (3, 61), (8, 5), (5, 0), (1, 4099)])
def test_sum64_bytes_pads_and_realigns(start, length):
    buffer = torch.tensor(random_words(600, seed=length), dtype=torch.int64).view(torch.uint8)
    data = buffer[start : start + length]  # start 3 or 5: not 8-byte aligned
    assert int(sum64_bytes(data)) == reference_sum64(data.numpy().tobytes())


def test_sum64_catches_every_single_bit_flip_and_swaps():
    words = torch.tensor(random_words(32, seed=1), dtype=torch.int64)
    good = int(sum64(words))
    flipped = words.clone()
    for i in range(32):
        for bit in range(64):
            flipped[i] = words[i] ^ (1 << bit if bit < 63 else -(2**63))
            assert int(sum64(flipped)) != good, (i, bit)
        flipped[i] = words[i]
    swap = [1, 0, *range(2, 32)]
    words[1] = words[0] ^ 1  # differ in bit 0 only: the sum changes by 2·(b−a)·(i−j) = ±2
    assert int(sum64(words[swap])) != int(sum64(words))
    assert int(words.sum()) == int(words[swap].sum())  # which an unweighted sum would miss
    words[1] = words[0] ^ -(2**63)  # differ in bit 63 only: 2·2^63 ≡ 0, the documented blind spot
    assert int(sum64(words[swap])) == int(sum64(words))


# --- writing and the table ---------------------------------------------------------------------


@pytest.mark.parametrize("num_threads,slot_bytes", [(1, CHUNK), (4, CHUNK), (4, 3 * CHUNK)])
def test_round_trip_is_bitwise(written, num_threads, slot_bytes):
    path, layout, tensors = written
    got = load_layout_tensors(path, layout, "cpu", num_threads=num_threads, slot_bytes=slot_bytes)
    assert_bitwise_equal(tensors, got)


def test_offsets_aligned_and_gaps_zero(written):
    path, layout, tensors = written
    data = path.read_bytes()
    assert len(data) == layout.file_bytes
    covered = bytearray(len(data))
    for name, t in tensors:
        e = layout.tensors[name]
        assert e.offset % ALIGN == 0, name
        assert data[e.offset : e.offset + e.nbytes] == raw(t).numpy().tobytes(), name
        covered[e.offset : e.offset + e.nbytes] = b"\1" * e.nbytes
    assert all(b == 0 for b, c in zip(data, covered, strict=True) if not c)


def test_digests_cover_the_file(written):
    path, layout, _ = written
    data = path.read_bytes()
    chunks = [data[i : i + CHUNK] for i in range(0, len(data), CHUNK)]
    assert layout.chunk_sha256 == [hashlib.sha256(c).hexdigest() for c in chunks]
    assert layout.file_sha256 == hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("align,chunk_bytes", [(ALIGN, CHUNK), (1, 4099), (2, 1000)])
def test_chunk_sums_cover_the_file(tmp_path, align, chunk_bytes):
    # align 1 and 2 put tensors at odd offsets, so words straddle the writer's pieces
    path = tmp_path / "w"
    layout = write_restore_layout(path, mixed_tensors(), align=align, chunk_bytes=chunk_bytes)
    data = path.read_bytes()
    chunks = [data[i : i + chunk_bytes] for i in range(0, len(data), chunk_bytes)]
    assert layout.chunk_sum64 == [reference_sum64(c) for c in chunks]
    assert len(chunks) == layout.num_chunks > 1


def test_test_data_spans_and_shares_chunks(written):
    _, layout, _ = written
    spans = [
        (e.offset // CHUNK, (e.offset + e.nbytes - 1) // CHUNK)
        for e in layout.tensors.values()
        if e.nbytes
    ]
    assert any(first != last for first, last in spans)  # a tensor across chunk boundaries
    firsts = [first for first, _ in spans]
    assert len(set(firsts)) < len(firsts)  # a chunk holding several tensors


def test_json_round_trip(written):
    _, layout, _ = written
    text = layout.to_json()
    doc = json.loads(text)
    assert doc["format"] == "snapfn-restore-layout" and doc["version"] == 1
    assert doc["tensors"]["bf16"] == {**dataclasses.asdict(layout.tensors["bf16"]), "shape": [3000]}
    assert doc["chunk_sum64"] == layout.chunk_sum64 and len(layout.chunk_sum64) == layout.num_chunks
    assert RestoreLayout.from_json(text) == layout


def older_layout(layout: RestoreLayout) -> RestoreLayout:
    """The table as a writer from before chunk_sum64 would have written it."""
    doc = json.loads(layout.to_json())
    del doc["chunk_sum64"]
    return RestoreLayout.from_json(json.dumps(doc))


def test_older_table_without_sums_streams_with_sha256(written):
    path, layout, tensors = written
    older = older_layout(layout)
    assert older.chunk_sum64 is None and "chunk_sum64" not in older.to_json()
    older.validate(path.stat().st_size)
    for device in ("cpu", "cuda"):  # "auto" falls back to sha256 on either
        assert WeightStreamer(path, older, device=device).verify == "sha256"
    with WeightStreamer(path, older, device="cpu", verify=True) as streamer:
        dest = empty_like_table(older)
        assert streamer.stream_into(dest).verify_mode == "sha256"
    assert_bitwise_equal(tensors, dest)
    with pytest.raises(ValueError, match="chunk_sum64"):
        WeightStreamer(path, older, device="cpu", verify="device")


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: d.update(format="other"),
        lambda d: d.update(version=2),
        lambda d: d.pop("tensors"),
        lambda d: d["tensors"]["fp32"].update(shape="33x17"),
        lambda d: d["tensors"]["fp32"].update(offset=0.0),
        lambda d: d.update(chunk_sha256=None),
        lambda d: d.update(chunk_sum64=["1"] * len(d["chunk_sha256"])),
        lambda d: d.update(chunk_sum64=5),
    ],
)
def test_from_json_refuses_malformed(written, edit):
    doc = json.loads(written[1].to_json())
    edit(doc)
    with pytest.raises(BadSnapshot):
        RestoreLayout.from_json(json.dumps(doc))


def test_from_json_refuses_non_json():
    with pytest.raises(BadSnapshot):
        RestoreLayout.from_json(b"\x80\x04pickle")


def with_entry(layout: RestoreLayout, name: str, **changes) -> RestoreLayout:
    tensors = {**layout.tensors, name: dataclasses.replace(layout.tensors[name], **changes)}
    return dataclasses.replace(layout, tensors=tensors)


@pytest.mark.parametrize(
    "edit,match",
    [
        (
            lambda lay: with_entry(lay, "fp32", offset=-(-lay.file_bytes // ALIGN) * ALIGN),
            "'fp32'.*outside",
        ),
        (
            lambda lay: with_entry(lay, "int64", offset=lay.tensors["bf16"].offset),
            "'int64'.*overlaps.*'bf16'",
        ),
        (lambda lay: with_entry(lay, "fp8", nbytes=lay.tensors["fp8"].nbytes + 1), "'fp8'.*nbytes"),
        (lambda lay: with_entry(lay, "fp32", offset=8), "'fp32'.*aligned"),
        (lambda lay: with_entry(lay, "flags", dtype="complex32"), "'flags'.*unknown dtype"),
        (lambda lay: with_entry(lay, "fp32", shape=(-33, -17)), "'fp32'.*shape"),
        (lambda lay: dataclasses.replace(lay, chunk_sha256=lay.chunk_sha256[:-1]), "chunk digests"),
        (
            lambda lay: dataclasses.replace(lay, chunk_sha256=["x", *lay.chunk_sha256[1:]]),
            "chunk 0",
        ),
        (lambda lay: dataclasses.replace(lay, align=3), "power of two"),
        (
            lambda lay: dataclasses.replace(lay, chunk_sum64=[*lay.chunk_sum64, 0]),
            "chunk sum64s do not cover",
        ),
        (lambda lay: dataclasses.replace(lay, chunk_sum64=lay.chunk_sum64[1:]), "sum64s"),
        (
            lambda lay: dataclasses.replace(lay, chunk_sum64=[2**63, *lay.chunk_sum64[1:]]),
            "sum64 of chunk 0",
        ),
    ],
)
def test_validate_refuses_bad_tables(written, edit, match):
    path, layout, _ = written
    layout.validate(path.stat().st_size)  # the real table passes
    with pytest.raises(BadSnapshot, match=match) as info:
        edit(layout).validate(path.stat().st_size)
    assert "\n" not in str(info.value)


def test_write_refuses_duplicates_and_leaves_nothing(tmp_path):
    with pytest.raises(ValueError, match="'a'"):
        write_restore_layout(tmp_path / "w", [("a", torch.ones(2)), ("a", torch.ones(2))])
    with pytest.raises(ValueError, match="complex64"):
        write_restore_layout(tmp_path / "w", [("c", torch.ones(2, dtype=torch.complex64))])
    assert list(tmp_path.iterdir()) == []


def test_empty_layout(tmp_path):
    layout = write_restore_layout(tmp_path / "w", [])
    assert (layout.file_bytes, layout.chunk_sha256, layout.chunk_sum64) == (0, [], [])
    assert load_layout_tensors(tmp_path / "w", layout, "cpu") == {}
    assert load_layout_tensors(tmp_path / "w", layout, "cpu", verify="device") == {}


@pytest.mark.parametrize(
    "verify,mode",
    [("auto", "sha256"), (True, "sha256"), ("sha256", "sha256"), ("device", "device")]
    + [("none", "none"), (False, "none")],
)
@pytest.mark.parametrize("slot_bytes", [CHUNK, 3 * CHUNK])
def test_round_trip_in_each_mode(written, verify, mode, slot_bytes):
    path, layout, tensors = written
    dest = empty_like_table(layout)
    with WeightStreamer(
        path, layout, device="cpu", num_threads=3, slot_bytes=slot_bytes, verify=verify
    ) as streamer:
        report = streamer.stream_into(dest)
    assert report.verify_mode == streamer.verify == mode
    assert_bitwise_equal(tensors, dest)
    assert (report.verify_s > 0) == (mode != "none")


def test_verify_mode_refused(written):
    path, layout, _ = written
    with pytest.raises(ValueError, match="'sum64'"):
        WeightStreamer(path, layout, device="cpu", verify="sum64")
    assert WeightStreamer(path, layout, device="cuda").verify == "device"  # auto, with sums


# --- streaming: refusals -------------------------------------------------------------------------


def flipped_position(layout: RestoreLayout, where: str) -> int:
    bf16, fp32 = layout.tensors["bf16"], layout.tensors["fp32"]
    return bf16.offset + 4321 if where == "bf16" else fp32.offset + fp32.nbytes + 7


@pytest.mark.parametrize("verify", ["sha256", "device"])
@pytest.mark.parametrize("where", ["bf16", "padding"])
def test_flipped_byte_names_its_chunk(written, where, verify):
    path, layout, _ = written
    pos = flipped_position(layout, where)
    flip_byte(path, pos)
    check = "sum64" if verify == "device" else "sha256"
    lo = pos // CHUNK * CHUNK
    with pytest.raises(BadSnapshot, match=rf"chunk {pos // CHUNK} \(file bytes {lo}\.\..*{check}"):
        load_layout_tensors(path, layout, "cpu", num_threads=4, verify=verify)


def test_verify_off_loads_the_flipped_byte(written):
    path, layout, tensors = written
    flip_byte(path, layout.tensors["bf16"].offset)
    got = load_layout_tensors(path, layout, "cpu", verify=False)
    assert raw(got["bf16"])[0] == raw(dict(tensors)["bf16"])[0] ^ 0xFF


def test_truncated_file_refused(written):
    path, layout, _ = written
    streamer = WeightStreamer(path, layout, device="cpu")
    os.truncate(path, layout.file_bytes - 1)
    with pytest.raises(BadSnapshot, match="truncated"):
        streamer.stream_into(empty_like_table(layout))
    with pytest.raises(BadSnapshot, match="truncated"):
        WeightStreamer(path, layout, device="cpu")


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda d: d.pop("fp8"), "'fp8'.*no destination"),
        (lambda d: d.update(bogus=torch.empty(1)), "'bogus'.*not in the restore layout"),
        (lambda d: d.update(fp32=torch.empty(17, 33)), "'fp32'.*\\[17, 33\\]"),
        (lambda d: d.update(bf16=torch.empty(3000, dtype=torch.float16)), "'bf16'.*float16"),
    ],
)
def test_destination_mismatch_refused(written, edit, match):
    path, layout, _ = written
    dest = empty_like_table(layout)
    edit(dest)
    with pytest.raises(BadSnapshot, match=match):
        WeightStreamer(path, layout, device="cpu").stream_into(dest)


def test_destination_on_other_device_refused(written):
    path, layout, _ = written
    dest = {**empty_like_table(layout), "fp32": torch.empty(33, 17, device="meta")}
    with pytest.raises(ValueError, match="'fp32'"):
        WeightStreamer(path, layout, device="cpu").stream_into(dest)


def test_streamer_arguments_refused(written):
    path, layout, _ = written
    with pytest.raises(ValueError, match="hold a 4096-byte chunk"):
        WeightStreamer(path, layout, device="cuda", slot_bytes=CHUNK // 2)
    with pytest.raises(ValueError, match="cpu or cuda"):
        WeightStreamer(path, layout, device="meta")
    assert WeightStreamer(path, layout, device="cpu").prepare() == 0.0  # no ring on CPU


def test_more_pieces_than_iov_max(tmp_path):
    tensors = [(f"t{i}", torch.full((3,), float(i))) for i in range(1500)]  # + 1500 paddings
    layout = write_restore_layout(tmp_path / "w", tensors, align=16, chunk_bytes=64 << 10)
    assert layout.num_chunks == 1
    assert_bitwise_equal(tensors, load_layout_tensors(tmp_path / "w", layout, "cpu"))


def test_report_and_disk_figure(written):
    path, layout, _ = written
    with WeightStreamer(path, layout, device="cpu", num_threads=2) as streamer:
        report = streamer.stream_into(empty_like_table(layout))
    assert (report.num_bytes, report.num_chunks) == (layout.file_bytes, layout.num_chunks)
    assert report.verify_mode == "sha256"  # "auto" on CPU
    assert report.elapsed_s > 0 and report.gbps > 0 and report.verify_s > 0
    assert measure_disk_read_gbps(path) > 0
    with pytest.raises(ValueError):
        measure_h2d_gbps("cpu")


# --- the CUDA path, emulated on CPU tensors ------------------------------------------------------


class FakeStream:
    def __init__(self, device=None) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass

    def synchronize(self) -> None:
        pass


class FakeEvent:
    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass


@pytest.fixture
def emulated_cuda(monkeypatch):
    """torch.cuda streams and events as no-ops: the CUDA path's ring, staging and sums
    bookkeeping then runs on CPU tensors, in order (it cannot show races, only wrong offsets)."""
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())


def stream_cuda_path_on_cpu(path, layout, verify: str, ring_slots: int, slot_bytes: int) -> dict:
    streamer = WeightStreamer(
        path, layout, device="cpu", ring_slots=ring_slots, slot_bytes=slot_bytes, verify=verify
    )
    units = streamer._units  # white box: an unpinned ring in place of prepare()'s pinned one
    slot_bytes = max(u.file_hi - u.file_lo for u in units)
    ring = [torch.empty(slot_bytes, dtype=torch.uint8) for _ in range(min(ring_slots, len(units)))]
    streamer._ring = [(t, memoryview(t.numpy())) for t in ring]
    dest = empty_like_table(layout)
    sums = streamer._chunk_weights() if streamer.verify == "device" else None
    fd = os.open(path, os.O_RDONLY)
    try:
        streamer._stream_cuda(fd, weights._device_bytes(dest), sums)
    finally:
        os.close(fd)
    return dest


@pytest.mark.parametrize("verify", ["device", "sha256"])
@pytest.mark.parametrize(
    "align,chunk_bytes,ring_slots,units_of",
    [(ALIGN, CHUNK, 2, 1), (ALIGN, CHUNK, 2, 3), (1, 4099, 2, 2), (ALIGN, CHUNK, 16, 3)],
)
def test_cuda_path_emulated(
    emulated_cuda, tmp_path, verify, align, chunk_bytes, ring_slots, units_of
):
    tensors, path = mixed_tensors(), tmp_path / "w"
    layout = write_restore_layout(path, tensors, align=align, chunk_bytes=chunk_bytes)
    slot_bytes = units_of * chunk_bytes
    got = stream_cuda_path_on_cpu(path, layout, verify, ring_slots, slot_bytes)
    assert_bitwise_equal(tensors, got)
    for where in ("bf16", "padding"):
        pos = flipped_position(layout, where)
        flip_byte(path, pos)
        with pytest.raises(BadSnapshot, match=rf"chunk {pos // chunk_bytes}\b"):
            stream_cuda_path_on_cpu(path, layout, verify, ring_slots, slot_bytes)
        flip_byte(path, pos)  # restored


# --- CUDA ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
def test_cuda_sum64_matches_cpu():
    n = 1 << 20
    words = torch.tensor(random_words(n, seed=7), dtype=torch.int64)
    data = words.view(torch.uint8)[3 : 3 + 8 * n - 8]  # unaligned start, a 5-byte tail
    assert int(sum64(words.cuda())) == int(sum64(words)) == reference_sum64(words.numpy().tobytes())
    assert int(sum64_bytes(data.cuda())) == int(sum64_bytes(data))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("verify", ["device", "sha256"])
@pytest.mark.parametrize("ring_slots,slot_bytes", [(2, CHUNK), (16, 3 * CHUNK)])
def test_cuda_round_trip(tmp_path, ring_slots, slot_bytes, verify):
    tensors = mixed_tensors("cuda")  # device tensors: the writer copies them out piecewise
    path = tmp_path / "w"
    layout = write_restore_layout(path, tensors, align=ALIGN, chunk_bytes=CHUNK)
    kwargs = {"ring_slots": ring_slots, "slot_bytes": slot_bytes, "verify": verify}
    dest = empty_like_table(layout, "cuda")
    with WeightStreamer(path, layout, device="cuda", **kwargs) as streamer:
        assert streamer.stream_into(dest).verify_mode == verify
    assert_bitwise_equal(tensors, dest)
    for where in ("bf16", "padding"):
        pos = flipped_position(layout, where)
        flip_byte(path, pos)
        with pytest.raises(BadSnapshot, match=rf"chunk {pos // CHUNK}\b"):
            load_layout_tensors(path, layout, "cuda", **kwargs)
        flip_byte(path, pos)


@pytest.mark.gpu
@needs_cuda
def test_cuda_bandwidth_figures(tmp_path):
    h2d_gbps = measure_h2d_gbps("cuda", 256 << 20)
    g = torch.Generator(device="cuda").manual_seed(0)
    tensors = [
        (f"w{i}", torch.randn(4096, 8192, generator=g, device="cuda").bfloat16()) for i in range(8)
    ]
    path = tmp_path / "w"
    layout = write_restore_layout(path, tensors)  # 512 MiB, default 2 MiB align, 64 MiB chunks
    dest = empty_like_table(layout, "cuda")
    with WeightStreamer(path, layout, device="cuda") as streamer:
        report = streamer.stream_into(dest)
        hashed = WeightStreamer(path, layout, device="cuda", verify="sha256").stream_into(dest)
        unverified = WeightStreamer(path, layout, device="cuda", verify=False).stream_into(dest)
    print(f"h2d {h2d_gbps:.1f} GB/s, {report}, {hashed}, {unverified}")
    assert all(torch.equal(dest[name], t) for name, t in tensors)
    assert report.num_chunks == 8 and report.ring_alloc_s > 0 and report.verify_mode == "device"
    assert h2d_gbps > 1 and report.gbps > 1 and hashed.gbps > 1 and unverified.gbps > 1
