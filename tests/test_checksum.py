"""sum64: against a Python-int reference, with wrapping, unaligned starts and zero-padded tails;
what it catches (every single-bit flip, swaps) and its documented blind spot; CUDA equals CPU."""

from __future__ import annotations

import pytest
import torch

from snapfn.snapshot.layout.checksum import odd_weights, sum64, sum64_bytes

from layout_files import needs_cuda, random_words, reference_sum64


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


# --- CUDA ------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
def test_cuda_sum64_matches_cpu():
    n = 1 << 20
    words = torch.tensor(random_words(n, seed=7), dtype=torch.int64)
    data = words.view(torch.uint8)[3 : 3 + 8 * n - 8]  # unaligned start, a 5-byte tail
    assert int(sum64(words.cuda())) == int(sum64(words)) == reference_sum64(words.numpy().tobytes())
    assert int(sum64_bytes(data.cuda())) == int(sum64_bytes(data))


def test_first_bad_chunk_finds_the_changed_chunk_and_passes_the_same_bytes():
    from snapfn.snapshot.layout.checksum import Sum64Chunk, first_bad_chunk, odd_weights

    data = torch.randint(0, 256, (5 * 4096 + 100,), dtype=torch.uint8)
    chunk = 4096
    weights = odd_weights(chunk // 8)
    expected = []
    for lo in range(0, data.numel(), chunk):
        s = Sum64Chunk(weights)
        s.update(memoryview(data[lo : lo + chunk].numpy()))
        expected.append(s.finish())
    assert first_bad_chunk(data, chunk, expected) is None
    data[3 * chunk + 17] ^= 1
    assert first_bad_chunk(data, chunk, expected) == 3
    with pytest.raises(ValueError, match="sums for"):
        first_bad_chunk(data, chunk, expected[:-1])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
@pytest.mark.parametrize("start", [0, 3])  # aligned: the batched rows; unaligned: chunk by chunk
def test_chunk_sums_in_batches_equal_each_chunk_summed_alone(device, start):
    from snapfn.snapshot.layout.checksum import chunk_sums

    chunk = 4096
    data = torch.randint(0, 256, (start + 7 * chunk + 100,), dtype=torch.uint8)[start:]
    alone = [
        reference_sum64(data[lo : lo + chunk].numpy().tobytes())
        for lo in range(0, data.numel(), chunk)
    ]
    for batch_bytes in (
        chunk,
        3 * chunk,
        1 << 20,
    ):  # 1 chunk a batch, a short last batch, one batch
        got = chunk_sums(data.to(device), chunk, batch_bytes=batch_bytes).cpu().tolist()
        assert got == alone, batch_bytes


def test_a_chunk_fed_past_its_weights_is_refused_not_summed_short():
    from snapfn.snapshot.layout.checksum import Sum64Chunk, odd_weights

    chunk = Sum64Chunk(odd_weights(2))
    chunk.update(memoryview(bytes(range(16))))
    with pytest.raises(ValueError, match="past its 2 weights"):
        chunk.update(memoryview(bytes(8)))
