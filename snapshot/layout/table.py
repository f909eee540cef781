"""The restore layout: one raw, aligned weight file per rank and the JSON table describing it.

Wire format (no pickle anywhere). A restore-layout file is the concatenation of each tensor's
raw bytes — contiguous, in its final dtype and shape, little-endian as the host writes them —
each starting at an offset that is a multiple of `align` (a power of two, default 2 MiB), with
zero bytes between tensors. The file ends where the last tensor ends; an empty tensor takes no
bytes. The file is cut into `chunk_bytes` chunks (default 64 MiB; chunk i covers file bytes
[i·chunk_bytes, min((i+1)·chunk_bytes, file_bytes)), padding included) and each chunk has its
own sha256 and its own sum64 (defined in checksum.py), so a streamer verifies chunks
independently and in parallel. The table travels as JSON (in the snapshot manifest or beside
the file):

    {
      "format": "snapfn-restore-layout",
      "version": 1,
      "file_bytes": 16060522496,
      "align": 2097152,
      "chunk_bytes": 67108864,
      "file_sha256": "<64 hex>",
      "chunk_sha256": ["<64 hex>", ...],          # ceil(file_bytes / chunk_bytes) entries
      "chunk_sum64": [-8121963740515360251, ...], # optional, as many entries: signed int64s
      "tensors": {                                # in file order
        "model.embed_tokens.weight":
          {"dtype": "bfloat16", "shape": [128256, 4096], "offset": 0, "nbytes": 1050673152},
        ...
      }
    }

`dtype` is the torch dtype's name without "torch." (see `DTYPE_ITEMSIZE`); `nbytes` is always
prod(shape)·itemsize. `chunk_sum64` is absent from tables written before it existed; such a
table streams with sha256 verification. Its values are exact JSON integers in [-2^63, 2^63):
parse them as int64, not as doubles. A reader calls `RestoreLayout.validate(file_size)` before
trusting a table.

This module is the table only: `RestoreLayout.to_json` / `from_json` (BadSnapshot on anything
that is not a table: parsed with the manifest's bounds on size and depth, every number an exact
JSON integer) and `validate` (BadSnapshot, one line, on a table that does not describe the file:
`align` a power of two, both it and `chunk_bytes` at most `MAX_CHUNK_BYTES`, since a streamer
pins a ring of chunks; tensors inside the file, aligned, not overlapping, `nbytes` their shape's; one
digest and sum per chunk). writer.py writes a file and its table; streamer.py reads the file
back.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from snapfn.snapshot.errors import BadSnapshot, one_line
from snapfn.snapshot.portable.format import MAX_MANIFEST_BYTES, load_json

LAYOUT_FORMAT = "snapfn-restore-layout"
LAYOUT_VERSION = 1

# dtype name in the table → bytes per element (float4_e2m1fn_x2 packs two values in one byte)
DTYPE_ITEMSIZE: Mapping[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
}
# a streamer pins `ring_slots` chunks of host memory: tables of larger chunks are refused (the
# writer's default is 64 MiB, a function's memory image 2 MiB)
MAX_CHUNK_BYTES = 256 << 20
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def dtype_name(dtype: torch.dtype) -> str:
    """The table's name for a torch dtype: "bfloat16", "float8_e4m3fn", …"""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes lie in the file."""

    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class RestoreLayout:
    """The table of one restore-layout file: tensors, geometry and digests.

    `chunk_sum64` is None for tables written before it existed ("device" verification is then
    unavailable).
    """

    tensors: dict[str, TensorEntry]
    file_bytes: int
    align: int
    chunk_bytes: int
    chunk_sha256: list[str]
    file_sha256: str
    chunk_sum64: list[int] | None = None

    @property
    def num_chunks(self) -> int:
        return -(-self.file_bytes // self.chunk_bytes) if self.chunk_bytes > 0 else 0

    def to_json(self) -> str:
        tensors = {
            name: {"dtype": e.dtype, "shape": list(e.shape), "offset": e.offset, "nbytes": e.nbytes}
            for name, e in self.tensors.items()
        }
        doc = {
            "format": LAYOUT_FORMAT,
            "version": LAYOUT_VERSION,
            "file_bytes": self.file_bytes,
            "align": self.align,
            "chunk_bytes": self.chunk_bytes,
            "file_sha256": self.file_sha256,
            "chunk_sha256": list(self.chunk_sha256),
            "tensors": tensors,
        }
        if self.chunk_sum64 is not None:
            doc["chunk_sum64"] = list(self.chunk_sum64)
        return json.dumps(doc)

    @classmethod
    def from_json(cls, text: str | bytes) -> RestoreLayout:
        """Parse a table; BadSnapshot if it is not one (structure only: see `validate`)."""
        if len(text) > MAX_MANIFEST_BYTES:
            raise BadSnapshot(f"restore layout table is {len(text)} bytes, more than allowed")
        try:
            doc = load_json(text)
        except ValueError as e:
            raise BadSnapshot(f"restore layout table is {e}") from None
        if not isinstance(doc, dict):
            raise BadSnapshot("restore layout table is not a JSON object")
        try:
            if doc.get("format") != LAYOUT_FORMAT or doc.get("version") != LAYOUT_VERSION:
                raise BadSnapshot(
                    f"restore layout: format {doc.get('format')!r} version "
                    f"{doc.get('version')!r}, expected {LAYOUT_FORMAT!r} {LAYOUT_VERSION}"
                )
            return cls(
                tensors={str(k): _parse_entry(v) for k, v in doc["tensors"].items()},
                file_bytes=_as_int(doc["file_bytes"]),
                align=_as_int(doc["align"]),
                chunk_bytes=_as_int(doc["chunk_bytes"]),
                chunk_sha256=[_as_str(d) for d in _as_list(doc["chunk_sha256"])],
                file_sha256=_as_str(doc["file_sha256"]),
                chunk_sum64=_parse_sums(doc.get("chunk_sum64")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise BadSnapshot(one_line(f"restore layout table is malformed: {e!r}")) from None

    def validate(self, file_size: int) -> None:
        """Refuse (BadSnapshot, one line) a table that does not describe a `file_size` file."""
        if self.align <= 0 or self.align & (self.align - 1) or self.align > MAX_CHUNK_BYTES:
            raise BadSnapshot(
                f"restore layout: align {self.align} is not a power of two of at most "
                f"{MAX_CHUNK_BYTES} bytes"
            )
        if not 0 < self.chunk_bytes <= MAX_CHUNK_BYTES:
            raise BadSnapshot(
                f"restore layout: chunk_bytes {self.chunk_bytes} is not in [1, {MAX_CHUNK_BYTES}]"
            )
        if file_size != self.file_bytes:
            raise BadSnapshot(
                f"restore layout: the file is {file_size} bytes but its table says "
                f"{self.file_bytes} (truncated or replaced)"
            )
        for name, entry in self.tensors.items():
            self._check_entry(name, entry)
        self._check_overlaps()
        self._check_digests()
        self._check_sums()

    def _check_entry(self, name: str, e: TensorEntry) -> None:
        itemsize = DTYPE_ITEMSIZE.get(e.dtype)
        if itemsize is None:
            raise BadSnapshot(f"restore layout: tensor {name!r} has unknown dtype {e.dtype!r}")
        if any(d < 0 for d in e.shape):
            raise BadSnapshot(f"restore layout: tensor {name!r} has shape {e.shape}")
        expected = math.prod(e.shape) * itemsize
        if e.nbytes != expected:
            raise BadSnapshot(
                f"restore layout: tensor {name!r} has nbytes {e.nbytes}, but {e.dtype} "
                f"{list(e.shape)} takes {expected}"
            )
        if e.offset < 0 or e.offset % self.align:
            raise BadSnapshot(
                f"restore layout: tensor {name!r} offset {e.offset} is not {self.align}-aligned"
            )
        if e.offset + e.nbytes > self.file_bytes:
            raise BadSnapshot(
                f"restore layout: tensor {name!r} bytes [{e.offset}, {e.offset + e.nbytes}) "
                f"lie outside the {self.file_bytes}-byte file"
            )

    def _check_overlaps(self) -> None:
        prev_name, prev_end = "", 0
        for name, e in sorted(self.tensors.items(), key=lambda kv: kv[1].offset):
            if e.nbytes == 0:
                continue
            if e.offset < prev_end:
                raise BadSnapshot(
                    f"restore layout: tensor {name!r} at byte {e.offset} overlaps tensor "
                    f"{prev_name!r}, which ends at byte {prev_end}"
                )
            prev_name, prev_end = name, e.offset + e.nbytes

    def _check_digests(self) -> None:
        if len(self.chunk_sha256) != self.num_chunks:
            raise BadSnapshot(
                f"restore layout: {len(self.chunk_sha256)} chunk digests do not cover the "
                f"{self.file_bytes}-byte file in {self.chunk_bytes}-byte chunks "
                f"({self.num_chunks} needed)"
            )
        for index, digest in enumerate([*self.chunk_sha256, self.file_sha256]):
            if not _SHA256_HEX.fullmatch(digest):
                what = f"chunk {index}" if index < self.num_chunks else "the file"
                raise BadSnapshot(f"restore layout: digest of {what} is not sha256 hex")

    def _check_sums(self) -> None:
        if self.chunk_sum64 is None:
            return
        if len(self.chunk_sum64) != self.num_chunks:
            raise BadSnapshot(
                f"restore layout: {len(self.chunk_sum64)} chunk sum64s do not cover the "
                f"{self.file_bytes}-byte file in {self.chunk_bytes}-byte chunks "
                f"({self.num_chunks} needed)"
            )
        for index, value in enumerate(self.chunk_sum64):
            if not _INT64_MIN <= value <= _INT64_MAX:
                raise BadSnapshot(f"restore layout: sum64 of chunk {index} is not an int64")


def _as_int(value: object) -> int:
    if type(value) is not int:
        raise TypeError(f"expected an integer, got {value!r}")
    return value


def _as_str(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {value!r}")
    return value


def _parse_sums(values: list | None) -> list[int] | None:
    return None if values is None else [_as_int(v) for v in _as_list(values)]


def _as_list(value: object) -> list:
    if not isinstance(value, list):
        raise TypeError(f"expected a list, got {value!r}")
    return value


def _parse_entry(doc: dict) -> TensorEntry:
    if not isinstance(doc["shape"], list):
        raise TypeError(f"expected a shape list, got {doc['shape']!r}")
    shape = tuple(_as_int(d) for d in doc["shape"])
    return TensorEntry(_as_str(doc["dtype"]), shape, _as_int(doc["offset"]), _as_int(doc["nbytes"]))
