"""Restore-layout weight files: one raw, aligned file per rank, and the streamer that reads it.

Wire format (no pickle anywhere). A restore-layout file is the concatenation of each tensor's
raw bytes — contiguous, in its final dtype and shape, little-endian as the host writes them —
each starting at an offset that is a multiple of `align` (a power of two, default 2 MiB), with
zero bytes between tensors. The file ends where the last tensor ends; an empty tensor takes no
bytes. The file is cut into `chunk_bytes` chunks (default 64 MiB; chunk i covers file bytes
[i·chunk_bytes, min((i+1)·chunk_bytes, file_bytes)), padding included) and each chunk has its
own sha256 and its own sum64 (below), so a streamer verifies chunks independently and in
parallel. The table travels as JSON (in the snapshot manifest or beside the file):

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

sum64, the device-side chunk checksum. A chunk's bytes, zero-padded to a multiple of 8, are read
as little-endian int64 words w[0..n) and

    sum64 = Σ_i w[i]·(2i+1)  mod 2^64, stored as the two's-complement int64.

Integer arithmetic mod 2^64 is exact and associative, so the value does not depend on reduction
order: torch's wrapping int64 multiply and sum give bitwise the same result on CPU and CUDA.
Every weight 2i+1 is odd, hence invertible mod 2^64, so a change δ ≢ 0 to one word changes the
sum by δ·(2i+1) ≢ 0: any change confined to one word is caught — every single-bit flip, every
changed byte or bytes within one word. Swapping words a (at i) and b (at j) changes the sum by
2·(b−a)·(i−j), which is caught unless a and b agree in their lowest 63 − v2(j−i) bits (v2: the
power of two in j−i); for 64 MiB chunks (j−i < 2^23) any two words that differ in bits 0..40 are
caught, and a plain sum (all weights 1) would catch none. Changes to several words can cancel
(two flips of bit 63 always do): sum64 is an integrity check against torn, misplaced or
corrupted copies, not a cryptographic one. The chunk sha256 digests stay in the table for
verification at rest and in transfer.

`WeightStreamer` fills preallocated tensors from such a file: reader threads `preadv` chunks into
a small ring of pinned host slots (CUDA) or straight into the tensors' memory (CPU), the host →
device copies run on their own CUDA stream, and the chunks are verified while reading goes on
(`verify`): "sha256" hashes them on a thread pool (about 1 core-second per GB); "device" (the
default on CUDA when the table has `chunk_sum64`) copies each ring slot to a device staging
slot, computes each chunk's sum64 there on the copy stream and scatters the bytes to the tensors,
so what is checked is what landed in device memory, with one host sync at the end; "none"
checks nothing. A mismatch raises `BadSnapshot` naming the chunk; the destination tensors then
hold unverified bytes and must be discarded.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from snapfn.snapshot import pagecache
from snapfn.snapshot.errors import BadSnapshot

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
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
VERIFY_MODES = ("auto", "sha256", "device", "none")  # WeightStreamer(verify=...)


def dtype_name(dtype: torch.dtype) -> str:
    """The table's name for a torch dtype: "bfloat16", "float8_e4m3fn", …"""
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------------------
# the table


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
        try:
            doc = json.loads(text)
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
                chunk_sha256=[_as_str(d) for d in doc["chunk_sha256"]],
                file_sha256=_as_str(doc["file_sha256"]),
                chunk_sum64=_parse_sums(doc.get("chunk_sum64")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise BadSnapshot(f"restore layout table is malformed: {e!r}") from None

    def validate(self, file_size: int) -> None:
        """Refuse (BadSnapshot, one line) a table that does not describe a `file_size` file."""
        if self.align <= 0 or self.align & (self.align - 1):
            raise BadSnapshot(f"restore layout: align {self.align} is not a power of two")
        if self.chunk_bytes <= 0:
            raise BadSnapshot(f"restore layout: chunk_bytes {self.chunk_bytes} is not positive")
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
    return None if values is None else [_as_int(v) for v in values]


def _parse_entry(doc: dict) -> TensorEntry:
    shape = tuple(_as_int(d) for d in doc["shape"])
    return TensorEntry(_as_str(doc["dtype"]), shape, _as_int(doc["offset"]), _as_int(doc["nbytes"]))


# ---------------------------------------------------------------------------------------------
# sum64 (see the module docstring), the same torch code on CPU and CUDA


def odd_weights(num_words: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """[num_words] int64 1, 3, 5, …: the weight 2i+1 of word i in `sum64`. Make once, reuse."""
    return torch.arange(num_words, dtype=torch.int64, device=device).mul_(2).add_(1)


def sum64(
    words: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    scratch: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Σ words[i]·(2i+1) mod 2^64 of [n] int64 `words`: a 0-d wrapping int64 on their device.

    `weights`: `odd_weights(m)`, m >= n, on the same device (made here when None). `scratch`:
    [>= n] int64 room for the products (else allocated). `out`: a 0-d int64 to write into.
    No host sync: on CUDA the result stays on the device.
    """
    n = words.numel()
    weights = odd_weights(n, words.device) if weights is None else weights[:n]
    products = torch.mul(words, weights, out=None if scratch is None else scratch[:n])  # [n]
    return products.sum() if out is None else torch.sum(products, 0, out=out)


def sum64_bytes(
    data: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    scratch: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`sum64` of [n] uint8 `data` read as little-endian int64 words, zero-padded to 8 bytes."""
    if data.data_ptr() % 8 or data.storage_offset() % 8:
        data = data.clone()  # NOTE: viewing bytes as int64 needs an 8-byte-aligned start
    body = data.numel() // 8 * 8
    total = sum64(data[:body].view(torch.int64), weights, scratch=scratch, out=out)
    if body < data.numel():
        last = torch.zeros(8, dtype=torch.uint8, device=data.device)  # the zero-padded word
        last[: data.numel() - body] = data[body:]
        total.add_(last.view(torch.int64)[0] * (2 * (body // 8) + 1))
    return total


def _signed64(value: int) -> int:
    value %= 1 << 64
    return value - (1 << 64) if value > _INT64_MAX else value


class _Sum64Chunk:
    """sum64 of one chunk fed as consecutive host byte pieces of any length and alignment."""

    def __init__(self, weights: torch.Tensor, scratch: torch.Tensor | None = None) -> None:
        self._weights, self._scratch = weights, scratch  # [>= chunk words] int64, on the CPU
        self._total, self._num_words, self._partial = 0, 0, b""

    def update(self, data: memoryview) -> None:
        if self._partial:  # a word begun by the previous piece
            take = 8 - len(self._partial)
            self._partial += bytes(data[:take])
            data = data[take:]
            if len(self._partial) < 8:
                return
            self._add_word(self._partial)
        body = len(data) // 8 * 8
        if body:
            if data.readonly:
                data = memoryview(bytearray(data))  # torch.frombuffer wants writable memory
            words = torch.frombuffer(data[:body], dtype=torch.uint8)
            s = sum64_bytes(words, self._weights[self._num_words :], scratch=self._scratch)
            self._total += int(s)
            self._num_words += body // 8
        self._partial = bytes(data[body:])

    def finish(self) -> int:
        """The chunk's sum64 as a signed int; starts the next chunk."""
        if self._partial:
            self._add_word(self._partial.ljust(8, b"\0"))
        total = _signed64(self._total)
        self._total, self._num_words = 0, 0
        return total

    def _add_word(self, word: bytes) -> None:
        self._total += int.from_bytes(word, "little") * (2 * self._num_words + 1)
        self._num_words, self._partial = self._num_words + 1, b""


class _Sha256Chunk:
    """sha256 of one chunk fed in pieces, as hex."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()

    def update(self, data: memoryview) -> None:
        self._hash.update(data)

    def finish(self) -> str:
        digest, self._hash = self._hash.hexdigest(), hashlib.sha256()
        return digest


class _PerChunk:
    """Feeds a byte stream to `digest` cut at chunk boundaries; one result per chunk."""

    def __init__(self, chunk_bytes: int, digest: _Sha256Chunk | _Sum64Chunk) -> None:
        self._chunk_bytes, self._digest, self._filled = chunk_bytes, digest, 0
        self.results: list = []

    def update(self, data: memoryview) -> None:
        while len(data):
            take = min(len(data), self._chunk_bytes - self._filled)
            self._digest.update(data[:take])
            self._filled += take
            data = data[take:]
            if self._filled == self._chunk_bytes:
                self._close_chunk()

    def finish(self) -> list:
        if self._filled:
            self._close_chunk()
        return self.results

    def _close_chunk(self) -> None:
        self.results.append(self._digest.finish())
        self._filled = 0


def _sum64_of(views: list[memoryview], weights: torch.Tensor) -> int:
    digest = _Sum64Chunk(weights)
    for view in views:
        digest.update(view)
    return digest.finish()


# ---------------------------------------------------------------------------------------------
# writing


class _DigestWriter:
    """Appends to a file while three helper threads digest the same bytes: the whole file's
    sha256, each chunk's sha256 and each chunk's sum64."""

    def __init__(self, f, chunk_bytes: int, pool: ThreadPoolExecutor) -> None:
        self._f, self._pool = f, pool
        chunk_words = -(-chunk_bytes // 8)
        sums = _Sum64Chunk(odd_weights(chunk_words), torch.empty(chunk_words, dtype=torch.int64))
        self._file_hash = hashlib.sha256()
        self._chunk_sha256 = _PerChunk(chunk_bytes, _Sha256Chunk())
        self._chunk_sum64 = _PerChunk(chunk_bytes, sums)
        self._pending: list[Future] = []
        self.pos = 0

    def write(self, data: memoryview) -> None:
        self._wait()  # NOTE: one piece in flight keeps digest order and bounds host memory
        digests = (self._file_hash.update, self._chunk_sha256.update, self._chunk_sum64.update)
        self._pending = [self._pool.submit(update, data) for update in digests]
        self._f.write(data)
        self.pos += len(data)

    def finish(self) -> tuple[list[str], list[int], str]:
        """(chunk sha256 hex digests, chunk sum64s, file sha256 hex digest)."""
        self._wait()
        return self._chunk_sha256.finish(), self._chunk_sum64.finish(), self._file_hash.hexdigest()

    def _wait(self) -> None:
        for fut in self._pending:
            fut.result()


def _host_pieces(tensor: torch.Tensor, piece_bytes: int) -> Iterator[memoryview]:
    """The tensor's bytes as host memory, at most `piece_bytes` at a time (device → host)."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)  # [nbytes]
    for lo in range(0, flat.numel(), piece_bytes):
        yield memoryview(flat[lo : lo + piece_bytes].cpu().numpy())


def _write_tensors(
    writer: _DigestWriter, tensors: Iterable[tuple[str, torch.Tensor]], align: int, piece: int
) -> dict[str, TensorEntry]:
    table: dict[str, TensorEntry] = {}
    zeros = memoryview(bytearray(align))
    for name, tensor in tensors:
        dtype = dtype_name(tensor.dtype)
        if name in table or dtype not in DTYPE_ITEMSIZE:
            raise ValueError(f"tensor {name!r}: duplicate name or unsupported dtype {dtype}")
        if pad := -writer.pos % align:
            writer.write(zeros[:pad])
        offset = writer.pos
        for data in _host_pieces(tensor, piece):
            writer.write(data)
        table[name] = TensorEntry(dtype, tuple(tensor.shape), offset, writer.pos - offset)
    return table


def write_restore_layout(
    path: str | os.PathLike,
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    align: int = 2 << 20,
    chunk_bytes: int = 64 << 20,
) -> RestoreLayout:
    """Write `tensors` (host or device, in order) as one restore-layout file, atomically.

    Device tensors come to the host `chunk_bytes` at a time, never the whole model at once.
    The file appears at `path` only once complete and fsynced (temp name + rename).
    """
    if align <= 0 or align & (align - 1) or chunk_bytes <= 0:
        raise ValueError(f"align {align} must be a power of two, chunk_bytes {chunk_bytes} > 0")
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f, ThreadPoolExecutor(3, thread_name_prefix="digest") as pool:
            writer = _DigestWriter(f, chunk_bytes, pool)
            table = _write_tensors(writer, tensors, align, chunk_bytes)
            chunk_digests, chunk_sums, file_digest = writer.finish()
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return RestoreLayout(
        table, writer.pos, align, chunk_bytes, chunk_digests, file_digest, chunk_sums
    )


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# the read plan: the file cut into chunks (digest units) grouped into units (one read each)


@dataclass(frozen=True)
class _Piece:
    """File bytes [file_lo, file_hi) that land at byte `tensor_lo` of `name` (None: padding)."""

    file_lo: int
    file_hi: int
    name: str | None
    tensor_lo: int


@dataclass(frozen=True)
class _Chunk:
    index: int
    file_lo: int
    file_hi: int
    pieces: tuple[_Piece, ...]


@dataclass(frozen=True)
class _Unit:
    """Consecutive chunks read by one `preadv` (CUDA: into one ring slot)."""

    file_lo: int
    file_hi: int
    chunks: tuple[_Chunk, ...]
    copies: tuple[_Piece, ...]  # tensor pieces, merged across the unit's chunk boundaries


def _file_spans(layout: RestoreLayout) -> list[_Piece]:
    """Tensor and padding pieces covering the whole file, in order."""
    spans, pos = [], 0
    for name, e in sorted(layout.tensors.items(), key=lambda kv: kv[1].offset):
        if e.nbytes == 0:
            continue
        if e.offset > pos:
            spans.append(_Piece(pos, e.offset, None, 0))
        spans.append(_Piece(e.offset, e.offset + e.nbytes, name, 0))
        pos = e.offset + e.nbytes
    if pos < layout.file_bytes:
        spans.append(_Piece(pos, layout.file_bytes, None, 0))
    return spans


def _cut(span: _Piece, lo: int, hi: int) -> _Piece:
    a, b = max(span.file_lo, lo), min(span.file_hi, hi)
    return _Piece(a, b, span.name, span.tensor_lo + a - span.file_lo)


def _plan_chunks(layout: RestoreLayout) -> list[_Chunk]:
    spans, k, chunks = _file_spans(layout), 0, []
    for index in range(layout.num_chunks):
        lo = index * layout.chunk_bytes
        hi = min(lo + layout.chunk_bytes, layout.file_bytes)
        pieces = []
        while k < len(spans) and spans[k].file_lo < hi:
            pieces.append(_cut(spans[k], lo, hi))
            if spans[k].file_hi > hi:
                break
            k += 1
        chunks.append(_Chunk(index, lo, hi, tuple(pieces)))
    return chunks


def _merge_copies(chunks: tuple[_Chunk, ...]) -> tuple[_Piece, ...]:
    """The chunks' tensor pieces, a tensor's consecutive pieces joined into one copy."""
    copies: list[_Piece] = []
    for p in (p for c in chunks for p in c.pieces if p.name is not None):
        prev = copies[-1] if copies else None
        if prev and prev.name == p.name and prev.file_hi == p.file_lo:
            copies[-1] = _Piece(prev.file_lo, p.file_hi, p.name, prev.tensor_lo)
        else:
            copies.append(p)
    return tuple(copies)


def _plan_units(layout: RestoreLayout, unit_bytes: int) -> list[_Unit]:
    per_unit = max(1, unit_bytes // layout.chunk_bytes)
    chunks = _plan_chunks(layout)
    groups = [tuple(chunks[i : i + per_unit]) for i in range(0, len(chunks), per_unit)]
    return [_Unit(g[0].file_lo, g[-1].file_hi, g, _merge_copies(g)) for g in groups]


def _preadv_exact(fd: int, views: list[memoryview], offset: int, iov_max: int) -> None:
    """Fill `views` in order from the file bytes at `offset`, through short reads and IOV_MAX."""
    views, i = list(views), 0
    while i < len(views):
        got = os.preadv(fd, views[i : i + iov_max], offset)
        if got == 0:
            raise BadSnapshot(f"restore layout: the file ends at byte {offset}, before its table")
        offset += got
        while got:
            if got >= len(views[i]):
                got -= len(views[i])
                i += 1
            else:
                views[i], got = views[i][got:], 0


@contextmanager
def _pools(num_threads: int) -> Iterator[tuple[ThreadPoolExecutor, ThreadPoolExecutor]]:
    """A reader pool and a digest pool; on the way out, pending work is cancelled."""
    reads = ThreadPoolExecutor(num_threads, thread_name_prefix="weights-read")
    hashes = ThreadPoolExecutor(num_threads, thread_name_prefix="weights-verify")
    try:
        yield reads, hashes
    finally:
        # NOTE: readers first: a reader may be waiting on a digest that must still finish
        reads.shutdown(cancel_futures=True)
        hashes.shutdown(cancel_futures=True)


# ---------------------------------------------------------------------------------------------
# streaming


@dataclass(frozen=True)
class StreamReport:
    """One `stream_into`: file bytes moved, wall time, and how the chunks were verified."""

    num_bytes: int
    elapsed_s: float  # first read → last copy finished and last chunk checked
    gbps: float
    verify_s: float  # host seconds verifying, summed over threads (0 for "device" on CUDA)
    num_chunks: int
    verify_mode: str  # "sha256", "device" or "none"
    ring_alloc_s: float = 0.0  # pinning the host ring in this call (see prepare), not in elapsed_s


def _verify_mode(verify: str | bool, device: torch.device, layout: RestoreLayout) -> str:
    """The mode a streamer runs: "sha256", "device" or "none" (see `WeightStreamer`)."""
    if isinstance(verify, bool):
        verify = "auto" if verify else "none"
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify {verify!r} is not one of {VERIFY_MODES} (or a bool)")
    has_sums = layout.chunk_sum64 is not None
    if verify == "auto":
        return "device" if device.type == "cuda" and has_sums else "sha256"
    if verify == "device" and not has_sums:
        raise ValueError(
            "verify='device' needs chunk_sum64 in the restore layout, which this (older) table "
            "lacks; use 'auto' or 'sha256'"
        )
    return verify


def _host_bytes(dest: Mapping[str, torch.Tensor]) -> dict[str, memoryview]:
    """Writable byte views of CPU tensors' memory (zero-copy)."""
    flat = {n: t.detach().reshape(-1).view(torch.uint8) for n, t in dest.items() if t.numel()}
    return {n: memoryview(t.numpy()) for n, t in flat.items()}


def _device_bytes(dest: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.detach().reshape(-1).view(torch.uint8) for n, t in dest.items() if t.numel()}


def _piece_view(piece: _Piece, dest: dict[str, memoryview]) -> memoryview:
    n = piece.file_hi - piece.file_lo
    if piece.name is None:
        return memoryview(bytearray(n))  # padding: read only to be hashed
    return dest[piece.name][piece.tensor_lo : piece.tensor_lo + n]


def _slot_views(unit: _Unit, slot: memoryview) -> list[list[memoryview]]:
    return [[slot[c.file_lo - unit.file_lo : c.file_hi - unit.file_lo]] for c in unit.chunks]


def _sha256_of(views: list[memoryview]) -> str:
    digest = hashlib.sha256()
    for view in views:
        digest.update(view)
    return digest.hexdigest()


# (unit, ring slot index, pinned slot, its bytes) → (event after which the pinned slot may be
# refilled, host checks that must pass first)
_Ship = Callable[[_Unit, int, torch.Tensor, memoryview], tuple[torch.cuda.Event, list[Future]]]


class WeightStreamer:
    """Fills preallocated tensors on `device` from a restore-layout file, chunks verified.

    CUDA: `num_threads` readers `preadv` units of whole chunks (up to `slot_bytes`) into a ring
    of `ring_slots` pinned host slots, allocated once per streamer; each slot is copied to the
    device on a dedicated stream and reused only after its copy event (and, with "sha256", its
    digests) are done. With "device" verification a slot is copied whole into a device staging
    slot (a ring as large as the pinned one, held during `stream_into`), each chunk's sum64 is
    computed there into a device vector, and the bytes are then copied on to the tensors; the
    vector is compared with the table's once, at the end. CPU: readers `preadv` straight into the
    destination tensors' memory; "device" then computes sum64 over those bytes on the host.

    `verify`: "auto" (or True) is "device" on CUDA when the table has `chunk_sum64`, else
    "sha256"; "none" (or False) checks nothing.

    NOTE: when `stream_into` raises BadSnapshot, the destination tensors hold partial or
    unverified bytes and must be discarded; never use them.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        layout: RestoreLayout,
        *,
        device: str | torch.device,
        num_threads: int = 16,
        ring_slots: int = 16,
        slot_bytes: int = 64 << 20,
        verify: str | bool = "auto",
    ) -> None:
        self.path, self.layout, self.device = Path(path), layout, torch.device(device)
        self.num_threads, self.ring_slots = max(1, num_threads), ring_slots
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"WeightStreamer streams to cpu or cuda, not {self.device}")
        if self.device.type == "cuda" and (slot_bytes < layout.chunk_bytes or ring_slots < 1):
            raise ValueError(
                f"ring_slots {ring_slots} must be >= 1 and slot_bytes {slot_bytes} must hold a "
                f"{layout.chunk_bytes}-byte chunk"
            )
        self.verify = _verify_mode(verify, self.device, layout)
        layout.validate(os.stat(self.path).st_size)
        self._units = _plan_units(layout, slot_bytes)
        self._ring: list[tuple[torch.Tensor, memoryview]] | None = None
        self._ring_lock = threading.Lock()  # prepare() may run on a side thread
        self._weights: torch.Tensor | None = None  # odd_weights of a chunk, on the device
        self._iov_max = os.sysconf("SC_IOV_MAX")

    def __enter__(self) -> WeightStreamer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the pinned ring (to torch's host allocator cache) and the sum64 weights."""
        self._ring = self._weights = None

    def prepare(self) -> float:
        """Pin the host ring now (CUDA; nothing on CPU); returns the seconds it took.

        Pinning costs about 0.5 s per GiB on an H200 host, so a restore can call this on a
        side thread while other stages run; `stream_into` calls it when nobody did.
        """
        with self._ring_lock:
            if self._ring is not None or self.device.type != "cuda":
                return 0.0
            start = time.perf_counter()
            slot_bytes = max((u.file_hi - u.file_lo for u in self._units), default=0)
            num_slots = min(self.ring_slots, len(self._units))
            slots = [
                torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=True)
                for _ in range(num_slots)
            ]
            self._ring = [(t, memoryview(t.numpy())) for t in slots]
            return time.perf_counter() - start

    def stream_into(self, dest: Mapping[str, torch.Tensor]) -> StreamReport:
        """Fill `dest` (exactly the table's names, shapes and dtypes) from the file."""
        self._check_dest(dest)
        ring_alloc_s = self.prepare()
        weights = self._chunk_weights() if self.verify == "device" else None
        fd = os.open(self.path, os.O_RDONLY)
        try:
            self.layout.validate(os.fstat(fd).st_size)  # the file may have changed since init
            start = time.perf_counter()
            if self.device.type == "cuda":
                verify_s = self._stream_cuda(fd, _device_bytes(dest), weights)
            else:
                verify_s = self._stream_cpu(fd, _host_bytes(dest), weights)
            elapsed_s = time.perf_counter() - start
        finally:
            os.close(fd)
        num_bytes, n = self.layout.file_bytes, self.layout.num_chunks
        gbps = num_bytes / elapsed_s / 1e9 if elapsed_s > 0 else 0.0
        return StreamReport(num_bytes, elapsed_s, gbps, sum(verify_s), n, self.verify, ring_alloc_s)

    def _chunk_weights(self) -> torch.Tensor:
        """The odd weights of one chunk's words on the device, made on first use only."""
        if self._weights is None:
            self._weights = odd_weights(-(-self.layout.chunk_bytes // 8), self.device)
        return self._weights

    def _check_dest(self, dest: Mapping[str, torch.Tensor]) -> None:
        for name in self.layout.tensors:
            if name not in dest:
                raise BadSnapshot(
                    f"tensor {name!r} is in the restore layout but has no destination"
                )
        for name, t in dest.items():
            entry = self.layout.tensors.get(name)
            if entry is None:
                raise BadSnapshot(f"destination {name!r} is not in the restore layout")
            if dtype_name(t.dtype) != entry.dtype or tuple(t.shape) != entry.shape:
                raise BadSnapshot(
                    f"tensor {name!r}: destination is {dtype_name(t.dtype)} {list(t.shape)}, "
                    f"the restore layout has {entry.dtype} {list(entry.shape)}"
                )
            if not t.is_contiguous() or not _on_device(t, self.device):
                raise ValueError(f"destination {name!r} must be contiguous on {self.device}")

    def _chunk_failed(self, index: int) -> BadSnapshot:
        lo = index * self.layout.chunk_bytes
        hi = min(lo + self.layout.chunk_bytes, self.layout.file_bytes)
        check = "sum64" if self.verify == "device" else "sha256"
        return BadSnapshot(
            f"{self.path}: chunk {index} (file bytes {lo}..{hi}) failed its {check} check; "
            "the restored tensors must not be used"
        )

    def _verify_chunk(
        self, chunk: _Chunk, views: list[memoryview], weights: torch.Tensor | None
    ) -> float:
        """Check one chunk on the host: sha256, or sum64 when `weights` are given."""
        start = time.perf_counter()
        if weights is None:
            ok = _sha256_of(views) == self.layout.chunk_sha256[chunk.index]
        else:
            ok = _sum64_of(views, weights) == (self.layout.chunk_sum64 or [])[chunk.index]
        if not ok:
            raise self._chunk_failed(chunk.index)
        return time.perf_counter() - start

    def _submit_checks(
        self,
        pool: ThreadPoolExecutor,
        chunks: tuple[_Chunk, ...],
        views: list[list[memoryview]],
        weights: torch.Tensor | None,
    ) -> list[Future]:
        if self.verify == "none":
            return []
        return [
            pool.submit(self._verify_chunk, c, v, weights)
            for c, v in zip(chunks, views, strict=True)
        ]

    def _stream_cpu(
        self, fd: int, dest: dict[str, memoryview], weights: torch.Tensor | None
    ) -> list[float]:
        with _pools(self.num_threads) as (reads, hashes):
            reading = [reads.submit(self._read_into_tensors, fd, u, dest) for u in self._units]
            checks: list[Future] = []
            for unit, done in zip(self._units, reading, strict=True):
                checks += self._submit_checks(hashes, unit.chunks, done.result(), weights)
            return [c.result() for c in checks]

    def _read_into_tensors(
        self, fd: int, unit: _Unit, dest: dict[str, memoryview]
    ) -> list[list[memoryview]]:
        views = [[_piece_view(p, dest) for p in c.pieces] for c in unit.chunks]
        _preadv_exact(fd, [v for vs in views for v in vs], unit.file_lo, self._iov_max)
        return views

    def _stream_cuda(
        self, fd: int, dest: dict[str, torch.Tensor], weights: torch.Tensor | None
    ) -> list[float]:
        stream = torch.cuda.Stream(self.device)
        # NOTE: staging is allocated on the current stream before the copy stream waits on it,
        # and freed only after the copy stream is synchronized below
        ring = self._ring or []
        staged = (
            None if weights is None else _StagedCopies(self.layout, ring, weights, dest, stream)
        )
        # NOTE: copies must not overtake work already queued on the destinations
        stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with _pools(self.num_threads) as (reads, hashes):
                if staged is None:
                    ship = self._ship_direct(dest, stream, hashes)
                    return [c.result() for c in self._pump_ring(fd, ship, reads)]
                self._pump_ring(fd, staged.ship, reads)
                if (bad := staged.first_mismatch()) is not None:
                    raise self._chunk_failed(bad)
                return []
        finally:
            stream.synchronize()  # NOTE: every copy has landed before stream_into returns

    def _ship_direct(
        self, dest: dict[str, torch.Tensor], stream: torch.cuda.Stream, hashes: ThreadPoolExecutor
    ) -> _Ship:
        """Pinned slot → tensors; "sha256" hashes the slot on the host meanwhile."""

        def ship(unit: _Unit, k: int, slot: torch.Tensor, view: memoryview):
            checks = self._submit_checks(hashes, unit.chunks, _slot_views(unit, view), None)
            return _enqueue_copies(unit, slot, dest, stream), checks

        return ship

    def _pump_ring(self, fd: int, ship: _Ship, reads: ThreadPoolExecutor) -> list[Future]:
        """Read → ship through the ring; a slot is refilled once its copy and checks are done."""
        ring, units = self._ring or [], self._units
        reading = {
            u: reads.submit(self._read_into_slot, fd, units[u], ring[u][1])
            for u in range(len(ring))
        }
        checks: list[Future] = []
        for u, unit in enumerate(units):
            reading.pop(u).result()
            slot, view = ring[u % len(ring)]
            copied, unit_checks = ship(unit, u % len(ring), slot, view)
            checks += unit_checks
            if (nxt := u + len(ring)) < len(units):
                reading[nxt] = reads.submit(self._refill, fd, units[nxt], view, copied, unit_checks)
        return checks

    def _read_into_slot(self, fd: int, unit: _Unit, slot: memoryview) -> None:
        _preadv_exact(fd, [slot[: unit.file_hi - unit.file_lo]], unit.file_lo, self._iov_max)

    def _refill(
        self, fd: int, unit: _Unit, slot: memoryview, copied: torch.cuda.Event, checks: list[Future]
    ) -> None:
        copied.synchronize()  # NOTE: the slot's last bytes are on their way to the GPU until here
        for check in checks:  # ... and being hashed until these finish (raises on a mismatch)
            check.result()
        self._read_into_slot(fd, unit, slot)


class _StagedCopies:
    """The "device" check on CUDA, queued on one copy stream with no host sync per chunk.

    Per ring slot: pinned slot → staging slot (H2D), each chunk's sum64 → `sums[chunk]`,
    staging → tensors (D2D, padding skipped). `first_mismatch` then compares `sums` with the
    table's once, at the end.
    """

    def __init__(
        self,
        layout: RestoreLayout,
        ring: list[tuple[torch.Tensor, memoryview]],
        weights: torch.Tensor,
        dest: dict[str, torch.Tensor],
        stream: torch.cuda.Stream,
    ) -> None:
        device = weights.device
        self._weights, self._dest, self._stream = weights, dest, stream
        self._staging = [  # the device twin of the pinned ring
            torch.empty(slot.numel(), dtype=torch.uint8, device=device) for slot, _ in ring
        ]
        self._scratch = torch.empty_like(weights)  # [chunk words] products
        self._sums = torch.zeros(layout.num_chunks, dtype=torch.int64, device=device)
        self._expected = torch.tensor(layout.chunk_sum64, dtype=torch.int64, device=device)

    def ship(
        self, unit: _Unit, k: int, pinned: torch.Tensor, view: memoryview
    ) -> tuple[torch.cuda.Event, list[Future]]:
        num_bytes, staging = unit.file_hi - unit.file_lo, self._staging[k]
        # NOTE: one stream runs everything in order: staging slot k's previous sums and D2D
        # copies were queued before this H2D copy overwrites it, so it needs no event of its own
        with torch.cuda.stream(self._stream):
            staging[:num_bytes].copy_(pinned[:num_bytes], non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self._stream)  # the pinned slot may be refilled once this has passed
            for c in unit.chunks:
                chunk = staging[c.file_lo - unit.file_lo : c.file_hi - unit.file_lo]
                sum64_bytes(chunk, self._weights, scratch=self._scratch, out=self._sums[c.index])
            _copy_pieces(unit, staging, self._dest)
        return copied, []

    def first_mismatch(self) -> int | None:
        """The first chunk whose sum64 is not the table's; the one host sync of the stream."""
        with torch.cuda.stream(self._stream):
            mismatch = (self._sums != self._expected).tolist()  # waits for all queued work
        return mismatch.index(True) if True in mismatch else None


def _copy_pieces(unit: _Unit, src: torch.Tensor, dest: dict[str, torch.Tensor]) -> None:
    """Queue copies of the unit's tensor pieces from `src` (the unit's bytes); padding skipped."""
    for p in unit.copies:
        piece = src[p.file_lo - unit.file_lo : p.file_hi - unit.file_lo]
        dest[p.name][p.tensor_lo : p.tensor_lo + piece.numel()].copy_(piece, non_blocking=True)


def _enqueue_copies(
    unit: _Unit, slot: torch.Tensor, dest: dict[str, torch.Tensor], stream: torch.cuda.Stream
) -> torch.cuda.Event:
    """Queue host slot → device copies of the unit's tensor pieces; padding is skipped."""
    with torch.cuda.stream(stream):
        _copy_pieces(unit, slot, dest)
        copied = torch.cuda.Event()
        copied.record(stream)
    return copied


def _on_device(t: torch.Tensor, device: torch.device) -> bool:
    if device.index is None:
        return t.device.type == device.type
    return t.device == device


def load_layout_tensors(
    path: str | os.PathLike, layout: RestoreLayout, device: str | torch.device, **kwargs
) -> dict[str, torch.Tensor]:
    """Allocate the table's tensors on `device` and stream the file into them.

    `kwargs` go to `WeightStreamer` (num_threads, ring_slots, slot_bytes, verify).
    """
    dest = {
        name: torch.empty(e.shape, dtype=getattr(torch, e.dtype), device=device)
        for name, e in layout.tensors.items()
    }
    with WeightStreamer(path, layout, device=device, **kwargs) as streamer:
        streamer.stream_into(dest)
    return dest


# ---------------------------------------------------------------------------------------------
# floors for the benchmark


def measure_h2d_gbps(device: str | torch.device, nbytes: int = 1 << 30, repeats: int = 3) -> float:
    """Pinned host → device copy bandwidth, GB/s: the ceiling a CUDA stream can reach."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"measure_h2d_gbps needs a CUDA device, not {device}")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev.copy_(host, non_blocking=True)  # warm-up
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    return repeats * nbytes / (time.perf_counter() - start) / 1e9


def measure_disk_read_gbps(path: str | os.PathLike, num_threads: int = 16) -> float:
    """Read bandwidth of `path` after asking the kernel to drop it from the page cache, GB/s.

    Cold-ish: where the kernel ignores POSIX_FADV_DONTNEED (tmpfs), this is a page-cache read.
    """
    pagecache.drop([path])
    return pagecache.prewarm([path], num_threads=num_threads).gbps
