"""criu's image files, read and written without criu: just what the memory move needs.

An image file (criu's images/*.proto, protobuf 2) is: one or two little-endian u32 magics, then
entries, each a u32 length and a protobuf message. `pages-*.img` is raw pages without a header.

A message is kept as its list of fields in wire order, unknown fields included, so that an
entry read and written back is the same bytes, and an edit touches only the fields it names:

    magics, entries = read_image(path)
    vma = Message.decode(entries[0]).get(1)       # a varint field's value
    write_image(path, magics, [m.encode() for m in messages])

Field numbers are criu's (4.x): mm_entry, vma_entry, pagemap_head/entry, file_entry,
reg_file_entry, fown_entry.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

VARINT, FIXED64, BYTES, FIXED32 = 0, 1, 2, 5

# mm_entry
MM_VMAS = 14
# vma_entry
VMA_START, VMA_END, VMA_PGOFF, VMA_SHMID, VMA_PROT, VMA_FLAGS, VMA_STATUS = 1, 2, 3, 4, 5, 6, 7
VMA_FD, VMA_MADV, VMA_FDFLAGS = 8, 9, 10
# vma_entry.status bits (criu/include/image.h)
VMA_AREA_REGULAR, VMA_AREA_STACK, VMA_AREA_HEAP = 1 << 0, 1 << 1, 1 << 5
VMA_FILE_PRIVATE, VMA_FILE_SHARED, VMA_ANON_SHARED, VMA_ANON_PRIVATE = (
    1 << 6,
    1 << 7,
    1 << 8,
    1 << 9,
)
# pagemap_head / pagemap_entry
PAGEMAP_PAGES_ID = 1
PE_VADDR, PE_COMPAT_NR_PAGES, PE_IN_PARENT, PE_FLAGS, PE_NR_PAGES = 1, 2, 3, 4, 5
PE_PARENT, PE_LAZY, PE_PRESENT = 1 << 0, 1 << 1, 1 << 2
# file_entry, reg_file_entry, fown_entry
FE_TYPE, FE_ID, FE_REG = 1, 2, 3
FD_TYPE_REG = 1
RFE_ID, RFE_FLAGS, RFE_POS, RFE_FOWN, RFE_NAME, RFE_SIZE = 1, 2, 3, 5, 6, 8

IMG_COMMON_MAGIC, IMG_SERVICE_MAGIC = 0x54564319, 0x55105940
MAGICS = {"mm": 0x57492820, "pagemap": 0x56084025, "files": 0x56303138}


class ImageError(ValueError):
    """An image file that is not what criu 4.x writes."""


@dataclass
class Message:
    """A protobuf message as its fields, in order: (number, wire type, int or bytes)."""

    fields: list[tuple[int, int, int | bytes]] = field(default_factory=list)

    @classmethod
    def decode(cls, data: bytes) -> Message:
        fields, pos = [], 0
        while pos < len(data):
            key, pos = _read_varint(data, pos)
            number, wire = key >> 3, key & 7
            if wire == VARINT:
                value, pos = _read_varint(data, pos)
            elif wire == BYTES:
                size, pos = _read_varint(data, pos)
                value, pos = data[pos : pos + size], pos + size
            elif wire in (FIXED64, FIXED32):
                width = 8 if wire == FIXED64 else 4
                value, pos = int.from_bytes(data[pos : pos + width], "little"), pos + width
            else:
                raise ImageError(f"unsupported protobuf wire type {wire} (field {number})")
            if pos > len(data):
                raise ImageError("a protobuf message ends inside a field")
            fields.append((number, wire, value))
        return cls(fields)

    def encode(self) -> bytes:
        out = bytearray()
        for number, wire, value in self.fields:
            out += _varint(number << 3 | wire)
            if wire == VARINT:
                out += _varint(value)
            elif wire == BYTES:
                out += _varint(len(value)) + value
            else:
                out += value.to_bytes(8 if wire == FIXED64 else 4, "little")
        return bytes(out)

    def get(self, number: int, default: int | bytes | None = None) -> int | bytes | None:
        """The last value of field `number` (protobuf's rule for a repeated scalar)."""
        found = [value for n, _, value in self.fields if n == number]
        return found[-1] if found else default

    def values(self, number: int) -> list[int | bytes]:
        return [value for n, _, value in self.fields if n == number]

    def set(self, number: int, value: int | bytes) -> Message:
        """Replace field `number` in place (appended when absent); returns self."""
        wire = BYTES if isinstance(value, bytes) else VARINT
        for i, (n, _, _) in enumerate(self.fields):
            if n == number:
                self.fields[i] = (number, wire, value)
                return self
        self.fields.append((number, wire, value))
        return self

    def copy(self) -> Message:
        return Message(list(self.fields))


def read_image(path: Path) -> tuple[bytes, list[bytes]]:
    """(the header magics as raw bytes, each entry's message bytes)."""
    data = Path(path).read_bytes()
    if len(data) < 4:
        raise ImageError(f"{path}: shorter than its magic")
    head = 8 if struct.unpack_from("<I", data, 0)[0] in (IMG_COMMON_MAGIC, IMG_SERVICE_MAGIC) else 4
    entries, pos = [], head
    while pos < len(data):
        if pos + 4 > len(data):
            raise ImageError(f"{path}: truncated entry length at byte {pos}")
        (size,) = struct.unpack_from("<I", data, pos)
        if pos + 4 + size > len(data):
            raise ImageError(f"{path}: entry at byte {pos} runs past the end")
        entries.append(data[pos + 4 : pos + 4 + size])
        pos += 4 + size
    return data[:head], entries


def check_magic(magics: bytes, kind: str, path: Path) -> None:
    if struct.unpack_from("<I", magics, len(magics) - 4)[0] != MAGICS[kind]:
        raise ImageError(f"{path}: not a criu {kind} image (magic {magics.hex()})")


def write_image(path: Path, magics: bytes, entries: list[bytes]) -> None:
    """Write an image file whole: to `path`.tmp, flushed, then renamed over `path`."""
    tmp = Path(f"{path}.tmp")
    with open(tmp, "wb") as out:
        out.write(magics)
        for entry in entries:
            out.write(struct.pack("<I", len(entry)) + entry)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)


def _varint(value: int) -> bytes:
    if value < 0:
        value &= (1 << 64) - 1  # int64 / uint64 negatives take ten bytes
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ImageError("a protobuf varint runs past its message")
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if not byte & 0x80:
            return value, pos
