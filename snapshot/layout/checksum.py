"""sum64, the position-weighted chunk checksum of restore-layout files (the same torch code on
CPU and CUDA).

A chunk's bytes, zero-padded to a multiple of 8, are read as little-endian int64 words w[0..n)
and

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

`sum64` and `sum64_bytes` compute it over a tensor on its own device with no host sync (the
streamer's "device" check runs them on its copy stream; on CUDA with triton, `sum64_bytes` and
`chunk_sums` run `sum64_triton`'s one-pass kernel, `SNAPFN_SUM64_KERNEL=torch` turns it off); `Sum64Chunk` computes it on the host
over a chunk fed in pieces of any length and alignment (the writer, and "device" verification
on CPU).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

# "torch": the chunk sums by torch's multiply and sum on CUDA too; "auto": by sum64_triton's
# kernel on CUDA where triton is installed (one pass over the data instead of three)
SUM64_KERNEL_ENV = "SNAPFN_SUM64_KERNEL"


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
    kernel = _kernel(data.device)
    if kernel is not None and body:
        partials = kernel.partial_sums(data[:body].view(torch.int64).view(1, body // 8))
        total = partials.sum() if out is None else torch.sum(partials.view(-1), 0, out=out)
    else:
        total = sum64(data[:body].view(torch.int64), weights, scratch=scratch, out=out)
    if body < data.numel():
        last = torch.zeros(8, dtype=torch.uint8, device=data.device)  # the zero-padded word
        last[: data.numel() - body] = data[body:]
        total.add_(last.view(torch.int64)[0] * (2 * (body // 8) + 1))
    return total


def _signed64(value: int) -> int:
    value %= 1 << 64
    return value - (1 << 64) if value >= 1 << 63 else value


class Sum64Chunk:
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
        if self._num_words + body // 8 > self._weights.numel():
            raise ValueError(f"a chunk past its {self._weights.numel()} weights' words")
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


BATCH_BYTES = 64 << 20  # the products of this much data at a time: 64 MiB of int64 scratch


def chunk_sums(
    data: torch.Tensor, chunk_bytes: int, batch_bytes: int = BATCH_BYTES
) -> torch.Tensor:
    """[num_chunks] int64: the sum64 of each `chunk_bytes` chunk of [n] uint8 `data`, on its
    device, no host sync. Whole chunks are summed as rows of a [k, words] view, k chunks per
    multiply and row sum (two kernels per `batch_bytes`, not per chunk); a short last chunk, or
    data not aligned to 8 bytes, takes `sum64_bytes`. On CUDA with triton, sum64_triton's
    kernel sums every whole chunk in one pass instead (`SNAPFN_SUM64_KERNEL=torch`: not)."""
    num_chunks = -(-data.numel() // chunk_bytes)
    words = -(-chunk_bytes // 8)
    sums = torch.empty(num_chunks, dtype=torch.int64, device=data.device)
    whole = data.numel() // chunk_bytes if chunk_bytes % 8 == 0 else 0
    if data.data_ptr() % 8 or data.storage_offset() % 8:
        whole = 0  # NOTE: viewing bytes as int64 needs an 8-byte-aligned start
    per_batch = max(1, min(whole, batch_bytes // chunk_bytes))
    kernel = _kernel(data.device)
    # NOTE: the weights (as many int64 as a chunk has words) only where torch multiplies
    weights = odd_weights(words, data.device) if kernel is None or whole < num_chunks else None
    if whole and kernel is not None:  # every whole chunk in one kernel and one row sum
        rows = data[: whole * chunk_bytes].view(torch.int64).view(whole, words)
        torch.sum(kernel.partial_sums(rows), 1, out=sums[:whole])
    elif whole:
        rows = data[: whole * chunk_bytes].view(torch.int64).view(whole, words)
        scratch = torch.empty(per_batch, words, dtype=torch.int64, device=data.device)
        for lo in range(0, whole, per_batch):
            block = rows[lo : lo + per_batch]
            products = torch.mul(block, weights, out=scratch[: block.shape[0]])
            torch.sum(products, 1, out=sums[lo : lo + block.shape[0]])
    scratch = (
        torch.empty(words, dtype=torch.int64, device=data.device) if weights is not None else None
    )
    for i in range(whole, num_chunks):
        chunk = data[i * chunk_bytes : (i + 1) * chunk_bytes]
        sum64_bytes(chunk, weights, scratch=scratch, out=sums[i])
    return sums


def first_bad_chunk(data: torch.Tensor, chunk_bytes: int, expected: list[int]) -> int | None:
    """The first `chunk_bytes` chunk of [n] uint8 `data` whose sum64 is not `expected[i]`, or
    None: every chunk's sum is computed on `data`'s device (`chunk_sums`), then compared in one
    host sync."""
    num_chunks = -(-data.numel() // chunk_bytes)
    if len(expected) != num_chunks:
        raise ValueError(f"{len(expected)} sums for {num_chunks} chunks")
    sums = chunk_sums(data, chunk_bytes)
    mismatch = (sums.cpu() != torch.tensor(expected, dtype=torch.int64)).tolist()
    return mismatch.index(True) if True in mismatch else None


def warm_kernel(device: str | torch.device) -> bool:
    """Compile (or load from Triton's cache) `sum64_triton`'s kernel now where it runs for
    `device`: an init calls it, so that the kernel is in the compile caches its snapshot carries
    and loaded in a process image's context, and no restore compiles it (the first tier-1
    restore's weight check took 1.1 s compiling it on the H200, 2026-12-07). Whether it ran."""
    device = torch.device(device)
    if _kernel(device) is None:
        return False
    data = torch.zeros(4096, dtype=torch.uint8, device=device)
    chunk_sums(data, 1024)
    sum64_bytes(data[:1000])
    return True


@functools.cache
def _kernels_on() -> bool:
    choice = os.environ.get(SUM64_KERNEL_ENV, "auto")
    if choice not in ("auto", "torch"):
        raise ValueError(f"{SUM64_KERNEL_ENV} must be auto or torch, not {choice!r}")
    return choice == "auto" and importlib.util.find_spec("triton") is not None


def _kernel(device: torch.device):
    """sum64_triton where it runs for `device` (CUDA, triton installed, not turned off), else
    None: the torch path, which is also the reference it is checked against."""
    if device.type != "cuda" or not _kernels_on():
        return None
    from snapfn.snapshot.layout import sum64_triton

    return sum64_triton
