"""Restore-layout weight files: one raw, aligned file per rank, and the streamer that reads it.

Wire format (no pickle anywhere). A restore-layout file is the concatenation of each tensor's
raw bytes — contiguous, in its final dtype and shape, little-endian as the host writes them —
each starting at an offset that is a multiple of `align` (a power of two, default 2 MiB), with
zero bytes between tensors. The file ends where the last tensor ends; an empty tensor takes no
bytes. The file is cut into `chunk_bytes` chunks (default 64 MiB; chunk i covers file bytes
[i·chunk_bytes, min((i+1)·chunk_bytes, file_bytes)), padding included) and each chunk has its
own sha256, so a streamer verifies chunks independently and in parallel. The table travels as
JSON (in the snapshot manifest or beside the file):

    {
      "format": "snapfn-restore-layout",
      "version": 1,
      "file_bytes": 16060522496,
      "align": 2097152,
      "chunk_bytes": 67108864,
      "file_sha256": "<64 hex>",
      "chunk_sha256": ["<64 hex>", ...],          # ceil(file_bytes / chunk_bytes) entries
      "tensors": {                                # in file order
        "model.embed_tokens.weight":
          {"dtype": "bfloat16", "shape": [128256, 4096], "offset": 0, "nbytes": 1050673152},
        ...
      }
    }

`dtype` is the torch dtype's name without "torch." (see `DTYPE_ITEMSIZE`); `nbytes` is always
prod(shape)·itemsize. A reader calls `RestoreLayout.validate(file_size)` before trusting a table.

`WeightStreamer` fills preallocated tensors from such a file: reader threads `preadv` chunks into
a small ring of pinned host slots (CUDA) or straight into the tensors' memory (CPU), the host →
device copies run on their own CUDA stream, and the chunk digests are checked on a second thread
pool while reading goes on. A digest mismatch raises `BadSnapshot`; the destination tensors then
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
from collections.abc import Iterable, Iterator, Mapping
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
    """The table of one restore-layout file: tensors, geometry and digests."""

    tensors: dict[str, TensorEntry]
    file_bytes: int
    align: int
    chunk_bytes: int
    chunk_sha256: list[str]
    file_sha256: str

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


def _as_int(value: object) -> int:
    if type(value) is not int:
        raise TypeError(f"expected an integer, got {value!r}")
    return value


def _as_str(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {value!r}")
    return value


def _parse_entry(doc: dict) -> TensorEntry:
    shape = tuple(_as_int(d) for d in doc["shape"])
    return TensorEntry(_as_str(doc["dtype"]), shape, _as_int(doc["offset"]), _as_int(doc["nbytes"]))


# ---------------------------------------------------------------------------------------------
# writing


class _DigestWriter:
    """Appends to a file while two helper threads hash the same bytes: whole file, per chunk."""

    def __init__(self, f, chunk_bytes: int, pool: ThreadPoolExecutor) -> None:
        self._f, self._chunk_bytes, self._pool = f, chunk_bytes, pool
        self._file_hash = hashlib.sha256()
        self._chunk_hash = hashlib.sha256()
        self._chunk_filled = 0
        self._pending: list[Future] = []
        self.chunk_digests: list[str] = []
        self.pos = 0

    def write(self, data: memoryview) -> None:
        self._wait()  # NOTE: one piece in flight keeps hash order and bounds host memory
        self._pending = [
            self._pool.submit(self._file_hash.update, data),
            self._pool.submit(self._hash_chunks, data),
        ]
        self._f.write(data)
        self.pos += len(data)

    def finish(self) -> tuple[list[str], str]:
        self._wait()
        if self._chunk_filled:
            self._close_chunk()
        return self.chunk_digests, self._file_hash.hexdigest()

    def _wait(self) -> None:
        for fut in self._pending:
            fut.result()

    def _hash_chunks(self, data: memoryview) -> None:
        while len(data):
            take = min(len(data), self._chunk_bytes - self._chunk_filled)
            self._chunk_hash.update(data[:take])
            self._chunk_filled += take
            data = data[take:]
            if self._chunk_filled == self._chunk_bytes:
                self._close_chunk()

    def _close_chunk(self) -> None:
        self.chunk_digests.append(self._chunk_hash.hexdigest())
        self._chunk_hash, self._chunk_filled = hashlib.sha256(), 0


def _host_pieces(tensor: torch.Tensor, piece_bytes: int) -> Iterator[memoryview]:
    """The tensor's bytes as host memory, at most `piece_bytes` at a time (device → host)."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)  # [nbytes]
    for lo in range(0, flat.numel(), piece_bytes):
        yield memoryview(flat[lo : lo + piece_bytes].cpu().numpy())


def _write_tensors(
    writer: _DigestWriter, tensors: Iterable[tuple[str, torch.Tensor]], align: int, piece: int
) -> dict[str, TensorEntry]:
    table: dict[str, TensorEntry] = {}
    zeros = memoryview(bytes(align))
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
        with open(tmp, "wb") as f, ThreadPoolExecutor(2, thread_name_prefix="digest") as pool:
            writer = _DigestWriter(f, chunk_bytes, pool)
            table = _write_tensors(writer, tensors, align, chunk_bytes)
            chunk_digests, file_digest = writer.finish()
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return RestoreLayout(table, writer.pos, align, chunk_bytes, chunk_digests, file_digest)


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
    """One `stream_into`: file bytes moved, wall time, and time spent hashing (summed)."""

    num_bytes: int
    elapsed_s: float  # first read → last copy finished and last digest checked
    gbps: float
    verify_s: float  # summed over digest threads; it overlaps the reads
    num_chunks: int
    ring_alloc_s: float = 0.0  # pinning the host ring in this call (see prepare), not in elapsed_s


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


class WeightStreamer:
    """Fills preallocated tensors on `device` from a restore-layout file, chunk digests checked.

    CUDA: `num_threads` readers `preadv` units of whole chunks (up to `slot_bytes`) into a ring
    of `ring_slots` pinned host slots, allocated once per streamer; each slot is copied to the
    destinations on a dedicated stream and reused only after its copy event and its digests are
    done. CPU: readers `preadv` straight into the destination tensors' memory.

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
        verify: bool = True,
    ) -> None:
        self.path, self.layout, self.device = Path(path), layout, torch.device(device)
        self.num_threads, self.ring_slots, self.verify = max(1, num_threads), ring_slots, verify
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"WeightStreamer streams to cpu or cuda, not {self.device}")
        if self.device.type == "cuda" and (slot_bytes < layout.chunk_bytes or ring_slots < 1):
            raise ValueError(
                f"ring_slots {ring_slots} must be >= 1 and slot_bytes {slot_bytes} must hold a "
                f"{layout.chunk_bytes}-byte chunk"
            )
        layout.validate(os.stat(self.path).st_size)
        self._units = _plan_units(layout, slot_bytes)
        self._ring: list[tuple[torch.Tensor, memoryview]] | None = None
        self._ring_lock = threading.Lock()  # prepare() may run on a side thread
        self._iov_max = os.sysconf("SC_IOV_MAX")

    def __enter__(self) -> WeightStreamer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the pinned ring (to torch's host allocator cache)."""
        self._ring = None

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
        on_cuda = self.device.type == "cuda"
        ring_alloc_s = self.prepare()
        fd = os.open(self.path, os.O_RDONLY)
        try:
            self.layout.validate(os.fstat(fd).st_size)  # the file may have changed since init
            start = time.perf_counter()
            if on_cuda:
                hash_s = self._stream_cuda(fd, _device_bytes(dest))
            else:
                hash_s = self._stream_cpu(fd, _host_bytes(dest))
            elapsed_s = time.perf_counter() - start
        finally:
            os.close(fd)
        num_bytes = self.layout.file_bytes
        gbps = num_bytes / elapsed_s / 1e9 if elapsed_s > 0 else 0.0
        n = self.layout.num_chunks
        return StreamReport(num_bytes, elapsed_s, gbps, sum(hash_s), n, ring_alloc_s)

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

    def _verify_chunk(self, chunk: _Chunk, views: list[memoryview]) -> float:
        start = time.perf_counter()
        digest = hashlib.sha256()
        for view in views:
            digest.update(view)
        if digest.hexdigest() != self.layout.chunk_sha256[chunk.index]:
            raise BadSnapshot(
                f"{self.path}: chunk {chunk.index} (file bytes {chunk.file_lo}..{chunk.file_hi}) "
                "failed its sha256 check; the restored tensors must not be used"
            )
        return time.perf_counter() - start

    def _submit_checks(
        self, pool: ThreadPoolExecutor, chunks: tuple[_Chunk, ...], views: list[list[memoryview]]
    ) -> list[Future]:
        if not self.verify:
            return []
        return [pool.submit(self._verify_chunk, c, v) for c, v in zip(chunks, views, strict=True)]

    def _stream_cpu(self, fd: int, dest: dict[str, memoryview]) -> list[float]:
        with _pools(self.num_threads) as (reads, hashes):
            reading = [reads.submit(self._read_into_tensors, fd, u, dest) for u in self._units]
            checks: list[Future] = []
            for unit, done in zip(self._units, reading, strict=True):
                checks += self._submit_checks(hashes, unit.chunks, done.result())
            return [c.result() for c in checks]

    def _read_into_tensors(
        self, fd: int, unit: _Unit, dest: dict[str, memoryview]
    ) -> list[list[memoryview]]:
        views = [[_piece_view(p, dest) for p in c.pieces] for c in unit.chunks]
        _preadv_exact(fd, [v for vs in views for v in vs], unit.file_lo, self._iov_max)
        return views

    def _stream_cuda(self, fd: int, dest: dict[str, torch.Tensor]) -> list[float]:
        stream = torch.cuda.Stream(self.device)
        # NOTE: copies must not overtake work already queued on the destinations
        stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with _pools(self.num_threads) as (reads, hashes):
                checks = self._pump_ring(fd, dest, stream, reads, hashes)
                return [c.result() for c in checks]
        finally:
            stream.synchronize()  # NOTE: every copy has landed before stream_into returns

    def _pump_ring(
        self,
        fd: int,
        dest: dict[str, torch.Tensor],
        stream: torch.cuda.Stream,
        reads: ThreadPoolExecutor,
        hashes: ThreadPoolExecutor,
    ) -> list[Future]:
        """Read → (verify ∥ copy) through the ring; a slot is refilled once both are done."""
        ring, units = self._ring or [], self._units
        reading = {
            u: reads.submit(self._read_into_slot, fd, units[u], ring[u][1])
            for u in range(len(ring))
        }
        checks: list[Future] = []
        for u, unit in enumerate(units):
            reading.pop(u).result()
            slot, view = ring[u % len(ring)]
            unit_checks = self._submit_checks(hashes, unit.chunks, _slot_views(unit, view))
            copied = _enqueue_copies(unit, slot, dest, stream)
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


def _enqueue_copies(
    unit: _Unit, slot: torch.Tensor, dest: dict[str, torch.Tensor], stream: torch.cuda.Stream
) -> torch.cuda.Event:
    """Queue host slot → device copies of the unit's tensor pieces; padding is skipped."""
    with torch.cuda.stream(stream):
        for p in unit.copies:
            src = slot[p.file_lo - unit.file_lo : p.file_hi - unit.file_lo]
            dest[p.name][p.tensor_lo : p.tensor_lo + src.numel()].copy_(src, non_blocking=True)
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
