"""The restore-layout table: JSON round trip, malformed tables refused, `validate` refusing
tables that do not describe their file (each with a one-line reason)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from snapfn.snapshot.errors import BadSnapshot
from snapfn.snapshot.layout.table import RestoreLayout

from layout_files import ALIGN, write_mixed


@pytest.fixture
def written(tmp_path):
    return write_mixed(tmp_path)


def test_json_round_trip(written):
    _, layout, _ = written
    text = layout.to_json()
    doc = json.loads(text)
    assert doc["format"] == "snapfn-restore-layout" and doc["version"] == 1
    assert doc["tensors"]["bf16"] == {**dataclasses.asdict(layout.tensors["bf16"]), "shape": [3000]}
    assert doc["chunk_sum64"] == layout.chunk_sum64 and len(layout.chunk_sum64) == layout.num_chunks
    assert RestoreLayout.from_json(text) == layout


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
