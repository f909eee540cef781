"""snapshot/layout/image.py on CPU: a span's live blocks written as a restore layout, the span
released, then mapped and streamed back (verified) or checked after a restorer filled it."""

from __future__ import annotations

import json

import pytest
import torch

from snapfn.snapshot.cuda.regions import ALIGN
from snapfn.snapshot.cuda.span import Span
from snapfn.snapshot.errors import BadSnapshot
from snapfn.snapshot.layout.image import CHUNK_BYTES, PoolImage, check_image, load_image, save_image


@pytest.fixture
def span():
    """Three pieces; the first two touch (one run), the third follows a hole left by a piece
    given back."""
    span = Span.reserve("cpu", 64 * ALIGN)
    a = span.map_segment(ALIGN)
    b = span.map_segment(2 * ALIGN)
    hole = span.map_segment(ALIGN)
    c = span.map_segment(ALIGN)
    span.unmap_segment(hole)
    g = torch.Generator().manual_seed(0)
    for address, nbytes in span.segments():
        span.view(address, nbytes).copy_(
            torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
        )
    span.blocks = {"a": (a, 4096), "b": (b + 100, ALIGN), "c": (c, ALIGN)}
    return span


def _snapshot(span, blocks):
    return {k: span.view(a, n).clone() for k, (a, n) in blocks.items()}


def test_live_blocks_come_back_byte_for_byte_and_the_rest_as_zeros(span, tmp_path):
    live = sorted(span.blocks.values())
    before = _snapshot(span, span.blocks)
    zeroed = [(span.blocks["c"][0] + 512, 1024)]  # a workspace marked "need not be saved"
    image = save_image(span, live, zeroed, tmp_path / "cuda0.bin")
    assert [r.nbytes for r in image.runs] == [3 * ALIGN, ALIGN]
    assert image.layout.file_bytes == 4 * ALIGN and image.layout.chunk_bytes == CHUNK_BYTES
    span.release()
    assert span.resident_bytes() == 0
    report = load_image(span, image, tmp_path / "cuda0.bin")
    assert report.num_bytes == 4 * ALIGN and report.verify_mode != "none"
    after = _snapshot(span, span.blocks)
    assert torch.equal(after["a"], before["a"]) and torch.equal(after["b"], before["b"])
    c = after["c"]
    assert int(c[512:1536].sum()) == 0  # marked: zeros
    assert torch.equal(c[:512], before["c"][:512]) and torch.equal(c[1536:], before["c"][1536:])
    a, _ = span.blocks["a"]
    assert int(span.view(a + 4096, ALIGN - 4096).sum()) == 0  # free bytes: zeros
    assert check_image(span, image) is None


def test_a_changed_byte_in_the_file_is_refused(span, tmp_path):
    path = tmp_path / "cuda0.bin"
    image = save_image(span, sorted(span.blocks.values()), [], path)
    span.release()
    data = bytearray(path.read_bytes())
    data[3 * ALIGN + 5] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(BadSnapshot, match="chunk 3 "):
        load_image(span, image, path)


def test_check_image_names_the_chunk_a_restorer_got_wrong(span, tmp_path):
    image = save_image(span, sorted(span.blocks.values()), [], tmp_path / "cuda0.bin")
    span.release()
    load_image(span, image, tmp_path / "cuda0.bin")
    b, _ = span.blocks["b"]
    span.view(b + ALIGN + 7, 1).add_(1)  # file chunk 2 of the first run
    assert check_image(span, image) == 2


def test_the_image_travels_as_json_and_a_run_that_is_not_in_the_table_is_refused(span, tmp_path):
    image = save_image(span, sorted(span.blocks.values()), [], tmp_path / "cuda0.bin")
    doc = json.loads(json.dumps(image.to_json()))
    assert PoolImage.from_json(doc) == image
    doc["runs"][1][0] += ALIGN
    with pytest.raises(BadSnapshot, match="not in the memory image's table"):
        PoolImage.from_json(doc)
    with pytest.raises(BadSnapshot, match="unreadable"):
        PoolImage.from_json({"runs": [["x", 1]]})


def test_each_run_is_a_region_filled_from_its_own_range_of_the_file(span, tmp_path):
    image = save_image(span, sorted(span.blocks.values()), [], tmp_path / "cuda0.bin")
    specs = image.region_specs("memory/cuda0.bin", 0)
    assert [(s["address"], s["nbytes"], s.get("offset", 0)) for s in specs] == [
        (image.runs[0].address, 3 * ALIGN, 0),
        (image.runs[1].address, ALIGN, 3 * ALIGN),
    ]
    assert {s["fill"] for s in specs} == {"file"}
