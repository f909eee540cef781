"""The weight streamer: bitwise round trips in every verify mode, refusals (flipped bytes name
their chunk, truncated files, wrong destinations), the CUDA path emulated on CPU, and CUDA."""

from __future__ import annotations

import contextlib
import json
import os

import pytest
import torch

from snapfn.snapshot.errors import BadSnapshot
from snapfn.snapshot.layout.read_plan import device_bytes
from snapfn.snapshot.layout.streamer import WeightStreamer, load_layout_tensors
from snapfn.snapshot.layout.table import RestoreLayout
from snapfn.snapshot.layout.writer import write_restore_layout
from snapfn.snapshot.portable.bandwidth import measure_h2d_gbps

from layout_files import (
    ALIGN,
    CHUNK,
    assert_bitwise_equal,
    empty_like_table,
    flip_byte,
    mixed_tensors,
    needs_cuda,
    raw,
    write_mixed,
)


@pytest.fixture
def written(tmp_path):
    return write_mixed(tmp_path)


# --- round trips -----------------------------------------------------------------------------


@pytest.mark.parametrize("num_threads,slot_bytes", [(1, CHUNK), (4, CHUNK), (4, 3 * CHUNK)])
def test_round_trip_is_bitwise(written, num_threads, slot_bytes):
    path, layout, tensors = written
    got = load_layout_tensors(path, layout, "cpu", num_threads=num_threads, slot_bytes=slot_bytes)
    assert_bitwise_equal(tensors, got)


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


# --- streaming: refusals ---------------------------------------------------------------------


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


def test_stream_report(written):
    path, layout, _ = written
    with WeightStreamer(path, layout, device="cpu", num_threads=2) as streamer:
        report = streamer.stream_into(empty_like_table(layout))
    assert (report.num_bytes, report.num_chunks) == (layout.file_bytes, layout.num_chunks)
    assert report.verify_mode == "sha256"  # "auto" on CPU
    assert report.elapsed_s > 0 and report.gbps > 0 and report.verify_s > 0


# --- the CUDA path, emulated on CPU tensors --------------------------------------------------


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
        streamer._stream_cuda(fd, device_bytes(dest), sums)
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


class FakeDriver:
    """The driver's host registration calls, answering `err` and recording each call."""

    def __init__(self, err: int) -> None:
        self.err, self.registered, self.unregistered, self.devices = err, [], [], []

    def cuMemHostRegister(self, ptr: int, num_bytes: int, flags: int) -> int:  # noqa: N802
        self.registered.append((ptr, num_bytes))
        return self.err

    def cuMemHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.unregistered.append(ptr)
        return 0

    def set_device(self, index: int) -> None:  # torch.cuda.set_device: an index, not "cuda"
        assert isinstance(index, int), f"set_device({index!r})"
        self.devices.append(index)


@pytest.mark.parametrize("err", [0, 1])
def test_the_ring_is_one_registered_block_or_torch_pinned_where_refused(monkeypatch, tmp_path, err):
    """ "register": the slots are views of one block of touched anonymous memory, registered
    in one call and unregistered at close; a refusal leaves `ring_pinning` "alloc" (prepare
    then pins with torch, which needs CUDA: not run here)."""
    from snapfn.snapshot.cuda import host_registered

    cu = FakeDriver(err)
    monkeypatch.setattr(host_registered, "driver", lambda: cu)
    monkeypatch.setattr(torch.cuda, "set_device", cu.set_device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    layout = write_restore_layout(tmp_path / "w", mixed_tensors(), align=ALIGN, chunk_bytes=CHUNK)
    streamer = WeightStreamer(tmp_path / "w", layout, device="cpu", num_threads=3)
    slots = streamer._registered_slots(CHUNK, 4)  # white box: what prepare() asks on CUDA
    if err:
        assert slots is None and streamer.ring_pinning == "alloc" and cu.unregistered == []
        return
    assert [s.numel() for s in slots] == [CHUNK] * 4 and streamer.ring_pinning == "register"
    assert cu.registered == [(slots[0].data_ptr(), 4 * CHUNK)] and cu.devices == [0]
    assert all(s.data_ptr() == slots[0].data_ptr() + k * CHUNK for k, s in enumerate(slots))
    assert all(int(s.sum()) == 0 for s in slots)  # touched: every page written
    streamer.close()
    assert cu.unregistered == [slots[0].data_ptr()]


def test_a_registered_ring_nobody_closed_is_unregistered_when_collected(monkeypatch, tmp_path):
    """Registered pages must be unregistered before they are unmapped: else the next block
    mapped at that address is refused by the driver ("already mapped")."""
    import gc

    from snapfn.snapshot.cuda import host_registered

    cu = FakeDriver(0)
    monkeypatch.setattr(host_registered, "driver", lambda: cu)
    monkeypatch.setattr(torch.cuda, "set_device", cu.set_device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    layout = write_restore_layout(tmp_path / "w", mixed_tensors(), align=ALIGN, chunk_bytes=CHUNK)
    streamer = WeightStreamer(tmp_path / "w", layout, device="cpu")
    address = streamer._registered_slots(CHUNK, 2)[0].data_ptr()
    del streamer
    gc.collect()
    assert cu.unregistered == [address]


def test_an_unknown_ring_pinning_is_refused(tmp_path):
    layout = write_restore_layout(tmp_path / "w", mixed_tensors(), align=ALIGN, chunk_bytes=CHUNK)
    with pytest.raises(ValueError, match="ring_pinning 'mlock'"):
        WeightStreamer(tmp_path / "w", layout, device="cpu", ring_pinning="mlock")


# --- CUDA ------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("verify", ["device", "sha256"])
@pytest.mark.parametrize("ring_slots,slot_bytes", [(2, CHUNK), (16, 3 * CHUNK)])
@pytest.mark.parametrize("pinning", ["register", "alloc"])
def test_cuda_round_trip(tmp_path, ring_slots, slot_bytes, verify, pinning):
    tensors = mixed_tensors("cuda")  # device tensors: the writer copies them out piecewise
    path = tmp_path / "w"
    layout = write_restore_layout(path, tensors, align=ALIGN, chunk_bytes=CHUNK)
    kwargs = {"ring_slots": ring_slots, "slot_bytes": slot_bytes, "verify": verify}
    dest = empty_like_table(layout, "cuda")
    with WeightStreamer(path, layout, device="cuda", ring_pinning=pinning, **kwargs) as streamer:
        report = streamer.stream_into(dest)
        assert report.verify_mode == verify and report.ring_pinning == pinning
        assert all(slot.is_pinned() for slot, _ in streamer._ring)
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
