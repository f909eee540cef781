"""Writing a restore-layout file (the format: table.py) from named tensors, atomically.

`write_restore_layout(path, tensors)` writes each tensor's raw bytes at the next `align`-ed
offset, zero bytes between, while three helper threads digest the same bytes (the whole file's
sha256, each chunk's sha256, each chunk's sum64), and returns the file's `RestoreLayout`.
Device tensors come to the host `chunk_bytes` at a time, never the whole model at once. The
file appears at `path` only once complete and fsynced (temp name + rename, then the directory
fsynced); on any error the temp file is removed. A duplicate name or a dtype missing from
`DTYPE_ITEMSIZE` is a ValueError.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from snapfn.snapshot.layout.checksum import Sum64Chunk, odd_weights
from snapfn.snapshot.layout.table import DTYPE_ITEMSIZE, RestoreLayout, TensorEntry, dtype_name


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

    def __init__(self, chunk_bytes: int, digest: _Sha256Chunk | Sum64Chunk) -> None:
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


class _DigestWriter:
    """Appends to a file while three helper threads digest the same bytes: the whole file's
    sha256, each chunk's sha256 and each chunk's sum64."""

    def __init__(self, f, chunk_bytes: int, pool: ThreadPoolExecutor) -> None:
        self._f, self._pool = f, pool
        chunk_words = -(-chunk_bytes // 8)
        sums = Sum64Chunk(odd_weights(chunk_words), torch.empty(chunk_words, dtype=torch.int64))
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
