"""The memory move on criu images built here (no criu needed): every page of the process reads
the same after the move, from memory.bin or from what is left of criu's page image, and only
what may move does. tests/test_worker_process.py restores real criu images moved this way."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from snapfn.snapshot.process import criu_image as ci
from snapfn.snapshot.process import image_memory as im
from snapfn.snapshot.process.criu_image import ImageError, Message

PAGE = os.sysconf("SC_PAGE_SIZE")
MIB = 1 << 20
GAP = 64 * 1024
ANON = im.MAP_PRIVATE | im.MAP_ANONYMOUS
REGULAR_ANON = ci.VMA_AREA_REGULAR | ci.VMA_ANON_PRIVATE
COMMON = ci.IMG_COMMON_MAGIC.to_bytes(4, "little")


def vma(start: int, size: int, status: int = REGULAR_ANON, flags: int = ANON) -> Message:
    fields = [(ci.VMA_START, start), (ci.VMA_END, start + size), (ci.VMA_PGOFF, 0)]
    fields += [(ci.VMA_SHMID, 0), (ci.VMA_PROT, 3), (ci.VMA_FLAGS, flags)]
    fields += [(ci.VMA_STATUS, status), (ci.VMA_FD, 1)]  # fd: sint64 -1
    return Message([(n, ci.VARINT, v) for n, v in fields])


# the process: (vma, [(offset in the vma, bytes dumped)])
LAYOUT = [
    (
        "heap",
        vma(0x1000_0000, 16 * MIB, REGULAR_ANON | ci.VMA_AREA_HEAP),
        [(0, 6 * MIB), (12 * MIB, PAGE)],
    ),
    ("sparse", vma(0x2000_0000, 8 * MIB), [(0, 2 * MIB), (2 * MIB + GAP, 2 * MIB), (7 * MIB, MIB)]),
    ("tail", vma(0x2080_0000, 4 * MIB), [(0, 3 * MIB)]),  # one pagemap entry with "sparse"'s end
    ("small", vma(0x3000_0000, MIB), [(0, 256 * 1024)]),
    (
        "file",
        vma(0x4000_0000, 2 * MIB, ci.VMA_AREA_REGULAR | ci.VMA_FILE_PRIVATE, 2).set(
            ci.VMA_SHMID, 5
        ),
        [(0, 2 * MIB)],
    ),
    (
        "stack",
        vma(0x7FF0_0000, 4 * MIB, REGULAR_ANON | ci.VMA_AREA_STACK, ANON | 0x100),
        [(0, 4 * MIB)],
    ),
]


def build_images(images: Path, seed: int = 0) -> dict[int, bytes]:
    """Write mm-1, pagemap-1, pages-1 and files images; returns page address → its bytes."""
    rng = random.Random(seed)
    runs = []
    for _, area, dumped in LAYOUT:
        runs += [(area.get(ci.VMA_START) + off, size) for off, size in dumped]
    runs.sort()
    merged = [list(runs[0])]
    for start, size in runs[1:]:  # criu's pagemap entries run across adjacent mappings
        if merged[-1][0] + merged[-1][1] == start:
            merged[-1][1] += size
        else:
            merged.append([start, size])
    pages, data = {}, bytearray()
    entries = [Message([(ci.PAGEMAP_PAGES_ID, ci.VARINT, 1)]).encode()]
    for start, size in merged:
        for addr in range(start, start + size, PAGE):
            pages[addr] = rng.randbytes(PAGE)
            data += pages[addr]
        fields = [(ci.PE_VADDR, start), (ci.PE_COMPAT_NR_PAGES, 0)]
        fields += [(ci.PE_FLAGS, ci.PE_PRESENT | ci.PE_LAZY), (ci.PE_NR_PAGES, size // PAGE)]
        entries.append(Message([(n, ci.VARINT, v) for n, v in fields]).encode())
    images.mkdir(parents=True, exist_ok=True)
    (images / "pages-1.img").write_bytes(bytes(data))
    magic = lambda kind: COMMON + ci.MAGICS[kind].to_bytes(4, "little")  # noqa: E731
    ci.write_image(images / "pagemap-1.img", magic("pagemap"), entries)
    mm = Message([(1, ci.VARINT, 0x400000), (12, ci.VARINT, 3)])
    mm.fields += [(ci.MM_VMAS, ci.BYTES, area.encode()) for _, area, _ in LAYOUT]
    mm.fields += [(13, ci.VARINT, 33)]  # a field after the mappings stays after them
    ci.write_image(images / "mm-1.img", magic("mm"), [mm.encode()])
    reg = Message([(ci.RFE_ID, ci.VARINT, 5), (ci.RFE_NAME, ci.BYTES, b"/usr/lib/x.so")])
    file = Message([(ci.FE_TYPE, ci.VARINT, 1), (ci.FE_ID, ci.VARINT, 5)])
    file.set(ci.FE_REG, reg.encode())
    ci.write_image(images / "files.img", magic("files"), [file.encode()])
    return pages


def read_back(images: Path) -> tuple[dict[int, bytes], list[Message]]:
    """Every page as a restore would see it: criu's pages, else memory.bin's, else absent."""
    _, entries = ci.read_image(images / "pagemap-1.img")
    data, pages, offset = (images / "pages-1.img").read_bytes(), {}, 0
    for entry in map(Message.decode, entries[1:]):
        for i in range(entry.get(ci.PE_NR_PAGES)):
            pages[entry.get(ci.PE_VADDR) + i * PAGE] = data[offset : offset + PAGE]
            offset += PAGE
    assert offset == len(data)
    _, (mm,) = ci.read_image(images / "mm-1.img")
    vmas = [Message.decode(v) for v in Message.decode(mm).values(ci.MM_VMAS)]
    memory = images / im.MEMORY_FILE
    blob = memory.read_bytes() if memory.exists() else b""
    for area in vmas:
        if area.get(ci.VMA_STATUS) & ci.VMA_FILE_PRIVATE and area.get(ci.VMA_SHMID) != 5:
            for addr in range(area.get(ci.VMA_START), area.get(ci.VMA_END), PAGE):
                at = area.get(ci.VMA_PGOFF) + addr - area.get(ci.VMA_START)
                page = blob[at : at + PAGE]
                assert addr not in pages, f"{addr:#x} both moved and kept"
                if page.strip(b"\0"):
                    pages[addr] = page
    return pages, vmas


def test_every_page_reads_the_same_after_the_move(tmp_path):
    before = build_images(tmp_path)
    moved = im.move_memory(tmp_path, min_bytes=MIB, gap_bytes=MIB)
    after, vmas = read_back(tmp_path)
    assert after == before
    assert moved.moved_bytes == (6 + 4 + 1 + 3) * MIB and moved.pieces == 4
    assert moved.kept_bytes == (tmp_path / "pages-1.img").stat().st_size
    assert moved.moved_bytes + moved.kept_bytes == len(before) * PAGE


def test_only_private_anonymous_clusters_of_min_bytes_move_and_the_heap_goes_last(tmp_path):
    build_images(tmp_path)
    im.move_memory(tmp_path, min_bytes=MIB, gap_bytes=MIB)
    _, vmas = read_back(tmp_path)
    moved = [v for v in vmas if v.get(ci.VMA_SHMID) not in (0, 5)]
    spans = {(v.get(ci.VMA_START), v.get(ci.VMA_END)) for v in moved}
    heap, sparse, tail = (area.get(ci.VMA_START) for _, area, _ in LAYOUT[:3])
    # the heap's lone page 6 MiB past its cluster stays in criu's image; "sparse"'s 64 KiB gap
    # is closed (a hole in the file), its 3 MiB gap is not; "small", "file", "stack" stay
    assert spans == {
        (heap, heap + 6 * MIB),
        (sparse, sparse + 4 * MIB + GAP),
        (sparse + 7 * MIB, sparse + 8 * MIB),
        (tail, tail + 3 * MIB),
    }
    for area in moved:
        assert area.get(ci.VMA_STATUS) == ci.VMA_AREA_REGULAR | ci.VMA_FILE_PRIVATE
        assert area.get(ci.VMA_FLAGS) == im.MAP_PRIVATE and area.get(ci.VMA_FDFLAGS) == os.O_RDONLY
        assert area.get(ci.VMA_FD) == 1  # untouched fields stay
    heap_piece = next(v for v in moved if v.get(ci.VMA_START) == heap)
    assert heap_piece.get(ci.VMA_PGOFF) == max(v.get(ci.VMA_PGOFF) for v in moved)
    # the mappings still tile the address space they did, in order
    starts = [v.get(ci.VMA_START) for v in vmas]
    assert starts == sorted(starts)
    assert all(
        a.get(ci.VMA_END) <= b.get(ci.VMA_START) for a, b in zip(vmas, vmas[1:], strict=False)
    )
    rest = [v for v in vmas if v.get(ci.VMA_START) == heap + 6 * MIB]
    assert (
        rest[0].get(ci.VMA_STATUS) & ci.VMA_AREA_HEAP and rest[0].get(ci.VMA_END) == heap + 16 * MIB
    )


def test_the_memory_file_is_registered_under_the_inherit_fd_key(tmp_path):
    build_images(tmp_path)
    moved = im.move_memory(tmp_path)
    _, files = ci.read_image(tmp_path / "files.img")
    entry = Message.decode(files[-1])
    reg = Message.decode(entry.get(ci.FE_REG))
    assert (entry.get(ci.FE_TYPE), entry.get(ci.FE_ID)) == (ci.FD_TYPE_REG, 6)
    assert reg.get(ci.RFE_NAME) == f"/{im.MEMORY_KEY}".encode()
    assert reg.get(ci.RFE_SIZE) == moved.file_bytes == (tmp_path / im.MEMORY_FILE).stat().st_size
    _, (mm,) = ci.read_image(tmp_path / "mm-1.img")
    assert [n for n, _, _ in Message.decode(mm).fields if n != ci.MM_VMAS] == [1, 12, 13]
    with pytest.raises(ImageError, match="moved already"):
        im.move_memory(tmp_path)


def test_nothing_to_move_leaves_the_images_as_they_were(tmp_path):
    build_images(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert im.move_memory(tmp_path, min_bytes=1 << 40) is None
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda d: (d / "pages-1.img").write_bytes(b"\0" * PAGE), "its pagemap says"),
        (
            lambda d: (d / "mm-1.img").write_bytes(b"\x19\x43\x56\x54\0\0\0\0"),
            "not a criu mm image",
        ),
        (
            lambda d: (d / "pagemap-1.img").write_bytes((d / "pagemap-1.img").read_bytes()[:-3]),
            "past the end",
        ),
    ],
)
def test_an_image_it_does_not_understand_is_refused(tmp_path, damage, match):
    build_images(tmp_path)
    damage(tmp_path)
    with pytest.raises(ImageError, match=match):
        im.move_memory(tmp_path)
    assert not (tmp_path / im.MEMORY_FILE).exists()


def test_pages_in_a_parent_image_are_refused(tmp_path):
    build_images(tmp_path)
    magics, entries = ci.read_image(tmp_path / "pagemap-1.img")
    entries[1] = Message.decode(entries[1]).set(ci.PE_FLAGS, ci.PE_PARENT).encode()
    ci.write_image(tmp_path / "pagemap-1.img", magics, entries)
    with pytest.raises(ImageError, match="not in this image"):
        im.move_memory(tmp_path)


def test_messages_read_and_written_back_are_the_same_bytes():
    raw = Message([(1, ci.VARINT, 2**64 - 1), (2, ci.BYTES, b"x" * 300), (3, ci.FIXED64, 7)])
    raw.fields.append((4, ci.FIXED32, 9))
    data = raw.encode()
    assert Message.decode(data).encode() == data and Message.decode(data) == raw
    with pytest.raises(ImageError):
        Message.decode(data[:-2])
