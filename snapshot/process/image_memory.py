"""Move a dumped process's large anonymous memory out of criu's page image into a file that the
restored process maps privately, so criu restores it by mmap instead of copying it page by page.

    moved = move_memory(images_dir)       after `criu dump`, before the snapshot is published
    criu restore ... --inherit-fd fd[N]:snapfn-memory     N: an O_RDONLY fd of memory.bin

Why: criu's eager restore copies every dumped page into freshly faulted anonymous memory, one
thread at ~1.5 GB/s (1.0 s of the 8B llama's tier-1 restore on the H200, for 0.94 GB of host
memory and 0.63 GB of saved GPU state). A private file mapping costs nothing up front; a page
is read from the page cache on its first touch and copied only if it is written.

What moves: private anonymous mappings (criu's REGULAR | ANON_PRIVATE, the brk heap included;
never a stack, a shared, locked or hugetlb mapping, or one that another task of the tree shares
copy-on-write), in clusters of dumped pages (gaps under `gap_bytes` closed) that hold at least
`min_bytes`. Each cluster becomes a mapping of its own, MAP_PRIVATE of memory.bin at its offset;
the rest of the mapping stays anonymous with its pages in criu's image. A hole in a cluster is a
hole in the sparse file and reads as zeros, as an untouched anonymous page does.

After the restore a moved mapping differs from anonymous memory in two ways, neither of which
glibc's malloc, CPython or torch rely on: MADV_DONTNEED brings back the snapshot's bytes rather
than zeros, and an mremap that grows one maps the file's next bytes (the heap's cluster is
placed last, so growing any other runs into file data, not past the end of the file).
memory.bin is never written in place: a snapshot is replaced by renaming a new one over it.

The rewrite touches mm-*.img (the mappings), pagemap-*.img and pages-*.img (the pages left),
and files.img (one regular file, "/snapfn-memory", whose name criu's --inherit-fd matches).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from snapfn.snapshot.process import criu_image as ci
from snapfn.snapshot.process.criu_image import ImageError, Message

MEMORY_FILE = "memory.bin"
MEMORY_KEY = "snapfn-memory"  # the file's name in files.img without its "/": --inherit-fd's key
MIN_BYTES = 1 << 20
GAP_BYTES = 1 << 20
# mmap flags as criu records them (Linux x86_64 and arm64 agree on these)
MAP_PRIVATE, MAP_ANONYMOUS, MAP_GROWSDOWN, MAP_LOCKED, MAP_HUGETLB = (
    0x02,
    0x20,
    0x100,
    0x2000,
    0x40000,
)
_MOVABLE_STATUS = ci.VMA_AREA_REGULAR | ci.VMA_ANON_PRIVATE


@dataclass(frozen=True)
class Run:
    """Pages dumped for [start, end), found at `offset` of the task's pages image."""

    start: int
    end: int
    offset: int


@dataclass
class Piece:
    """One cluster that moves: [start, end) of task `pid`, at `file_offset` of memory.bin."""

    pid: int
    start: int
    end: int
    heap: bool
    present_bytes: int
    file_offset: int = -1


@dataclass
class Task:
    """One process of the dump: its mm entry, its pagemap and where its pages are."""

    pid: int
    mm_magics: bytes
    mm: Message
    pagemap_magics: bytes
    head: bytes
    entries: list[Message]
    runs: list[Run]
    pages: Path
    vmas: list[Message] = field(init=False)  # the mm entry's, decoded once
    pieces: list[Piece] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.vmas = [Message.decode(v) for v in self.mm.values(ci.MM_VMAS)]


@dataclass(frozen=True)
class MovedMemory:
    """What `move_memory` did: the file, its size, and how much left criu's page image."""

    file: str
    key: str
    file_bytes: int
    moved_bytes: int
    kept_bytes: int
    pieces: int

    def to_json(self) -> dict:
        return dict(self.__dict__)


def move_memory(
    images_dir: Path, *, min_bytes: int = MIN_BYTES, gap_bytes: int = GAP_BYTES
) -> MovedMemory | None:
    """Rewrite the criu images in `images_dir` (see the module docstring); None when nothing
    qualifies (the images are left as they were). ImageError on an image it does not know."""
    images = Path(images_dir)
    page_bytes = os.sysconf("SC_PAGE_SIZE")
    tasks = [_read_task(images, path, page_bytes) for path in sorted(images.glob("mm-*.img"))]
    files_magics, files = ci.read_image(images / "files.img")
    ci.check_magic(files_magics, "files", images / "files.img")
    if any(_file_name(Message.decode(f)) == f"/{MEMORY_KEY}" for f in files):
        raise ImageError(f"{images}: its memory was moved already")
    shared = _shared_ranges(tasks)
    for task in tasks:
        task.pieces = _choose_pieces(task, shared, min_bytes, gap_bytes)
    pieces = [p for t in tasks for p in t.pieces]
    if not pieces:
        return None
    file_bytes = _place(pieces)
    file_id = 1 + max(int(Message.decode(f).get(ci.FE_ID, 0)) for f in files)
    _write_memory_file(images / MEMORY_FILE, tasks, file_bytes)
    kept_bytes = sum(_rewrite_task(images, task, file_id, page_bytes) for task in tasks)
    files.append(_memory_file_entry(file_id, file_bytes).encode())
    ci.write_image(images / "files.img", files_magics, files)
    moved = sum(p.present_bytes for p in pieces)
    return MovedMemory(MEMORY_FILE, MEMORY_KEY, file_bytes, moved, kept_bytes, len(pieces))


def _read_task(images: Path, mm_path: Path, page_bytes: int) -> Task:
    pid = int(mm_path.stem.split("-", 1)[1])
    magics, entries = ci.read_image(mm_path)
    ci.check_magic(magics, "mm", mm_path)
    if len(entries) != 1:
        raise ImageError(f"{mm_path}: {len(entries)} mm entries, expected 1")
    pagemap_path = images / f"pagemap-{pid}.img"
    pm_magics, pm_entries = ci.read_image(pagemap_path)
    ci.check_magic(pm_magics, "pagemap", pagemap_path)
    if not pm_entries:
        raise ImageError(f"{pagemap_path}: no pagemap head")
    head, pagemap = pm_entries[0], [Message.decode(e) for e in pm_entries[1:]]
    pages = images / f"pages-{Message.decode(head).get(ci.PAGEMAP_PAGES_ID)}.img"
    runs, offset = [], 0
    for entry in pagemap:
        start, num_pages, flags = _pagemap_entry(entry)
        if flags & ci.PE_PARENT or not flags & ci.PE_PRESENT:  # PE_LAZY alone: served remotely
            raise ImageError(f"{pagemap_path}: pages not in this image (flags {flags:#x})")
        runs.append(Run(start, start + num_pages * page_bytes, offset))
        offset += num_pages * page_bytes
    if pages.stat().st_size != offset:
        raise ImageError(f"{pages}: {pages.stat().st_size} bytes, its pagemap says {offset}")
    return Task(pid, magics, Message.decode(entries[0]), pm_magics, head, pagemap, runs, pages)


def _pagemap_entry(entry: Message) -> tuple[int, int, int]:
    """(vaddr, number of pages, flags) as criu reads them (old images: compat fields)."""
    num_pages = entry.get(ci.PE_NR_PAGES)
    if num_pages is None:
        num_pages = entry.get(ci.PE_COMPAT_NR_PAGES, 0)
    flags = entry.get(ci.PE_FLAGS)
    if flags is None:
        flags = ci.PE_PARENT if entry.get(ci.PE_IN_PARENT) else ci.PE_PRESENT
    return int(entry.get(ci.PE_VADDR)), int(num_pages), int(flags)


def _shared_ranges(tasks: list[Task]) -> set[tuple[int, int]]:
    """Mappings that more than one task holds: possibly copy-on-write shared, never moved."""
    seen: dict[tuple[int, int], int] = {}
    for task in tasks:
        for vma in task.vmas:
            key = (vma.get(ci.VMA_START), vma.get(ci.VMA_END))
            seen[key] = seen.get(key, 0) + 1
    return {key for key, count in seen.items() if count > 1}


def _movable(vma: Message) -> bool:
    status, flags = int(vma.get(ci.VMA_STATUS)), int(vma.get(ci.VMA_FLAGS))
    if (
        status & ~(_MOVABLE_STATUS | ci.VMA_AREA_HEAP)
        or status & _MOVABLE_STATUS != _MOVABLE_STATUS
    ):
        return False
    wanted = MAP_PRIVATE | MAP_ANONYMOUS
    return flags & wanted == wanted and not flags & (MAP_GROWSDOWN | MAP_LOCKED | MAP_HUGETLB)


def _choose_pieces(
    task: Task, shared: set[tuple[int, int]], min_bytes: int, gap_bytes: int
) -> list[Piece]:
    pieces = []
    for vma in task.vmas:
        start, end = int(vma.get(ci.VMA_START)), int(vma.get(ci.VMA_END))
        if not _movable(vma) or (start, end) in shared:
            continue
        heap = bool(int(vma.get(ci.VMA_STATUS)) & ci.VMA_AREA_HEAP)
        clusters: list[list[int]] = []  # [start, end, present bytes]
        for run in task.runs:
            lo, hi = max(run.start, start), min(run.end, end)
            if lo >= hi:
                continue
            if clusters and lo - clusters[-1][1] < gap_bytes:
                clusters[-1][1] = hi
                clusters[-1][2] += hi - lo
            else:
                clusters.append([lo, hi, hi - lo])
        pieces += [Piece(task.pid, lo, hi, heap, n) for lo, hi, n in clusters if n >= min_bytes]
    return pieces


def _place(pieces: list[Piece]) -> int:
    """File offsets, heap clusters last (see the module docstring); returns the file's size."""
    offset = 0
    for piece in sorted(pieces, key=lambda p: (p.heap, p.pid, p.start)):
        piece.file_offset = offset
        offset += piece.end - piece.start
    return offset


def _write_memory_file(path: Path, tasks: list[Task], file_bytes: int) -> None:
    tmp = Path(f"{path}.tmp")
    with open(tmp, "wb") as out:
        for task in tasks:
            with open(task.pages, "rb") as pages:
                for run in task.runs:
                    for piece in task.pieces:
                        lo, hi = max(run.start, piece.start), min(run.end, piece.end)
                        if lo < hi:
                            dst = piece.file_offset + lo - piece.start
                            _copy(pages, out, run.offset + lo - run.start, dst, hi - lo)
        out.truncate(file_bytes)  # trailing holes
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)


def _rewrite_task(images: Path, task: Task, file_id: int, page_bytes: int) -> int:
    """The task's pagemap and pages without the moved pages, its mappings split; returns the
    bytes of pages left in criu's image."""
    if not task.pieces:
        return sum(run.end - run.start for run in task.runs)
    entries, kept = [task.head], 0
    tmp = Path(f"{task.pages}.tmp")
    with open(task.pages, "rb") as pages, open(tmp, "wb") as out:
        for entry, run in zip(task.entries, task.runs, strict=True):
            for lo, hi in _subtract(run.start, run.end, task.pieces):
                _copy(pages, out, run.offset + lo - run.start, kept, hi - lo)
                entries.append(_with_range(entry, lo, (hi - lo) // page_bytes).encode())
                kept += hi - lo
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, task.pages)
    ci.write_image(images / f"pagemap-{task.pid}.img", task.pagemap_magics, entries)
    _write_mm(images / f"mm-{task.pid}.img", task, file_id)
    return kept


def _subtract(start: int, end: int, pieces: list[Piece]) -> list[tuple[int, int]]:
    """[start, end) less every piece, as sorted ranges."""
    left = [(start, end)]
    for piece in pieces:
        left = [
            part
            for lo, hi in left
            for part in ((lo, min(hi, piece.start)), (max(lo, piece.end), hi))
            if part[0] < part[1]
        ]
    return sorted(left)


def _with_range(entry: Message, vaddr: int, num_pages: int) -> Message:
    out = entry.copy().set(ci.PE_VADDR, vaddr).set(ci.PE_NR_PAGES, num_pages)
    if entry.get(ci.PE_COMPAT_NR_PAGES):
        out.set(ci.PE_COMPAT_NR_PAGES, num_pages)
    return out


def _write_mm(path: Path, task: Task, file_id: int) -> None:
    vmas = []
    for vma in task.vmas:
        start, end = int(vma.get(ci.VMA_START)), int(vma.get(ci.VMA_END))
        inside = [p for p in task.pieces if start <= p.start and p.end <= end]
        cuts = sorted({start, end, *(x for p in inside for x in (p.start, p.end))})
        for lo, hi in zip(cuts, cuts[1:], strict=False):
            piece = next((p for p in inside if p.start == lo), None)
            part = vma.copy().set(ci.VMA_START, lo).set(ci.VMA_END, hi)
            vmas.append((_as_file_mapping(part, piece, file_id) if piece else part).encode())
    fields = task.mm.fields
    first = next(i for i, f in enumerate(fields) if f[0] == ci.MM_VMAS)
    rest = [f for f in fields if f[0] != ci.MM_VMAS]
    at = sum(1 for f in fields[:first] if f[0] != ci.MM_VMAS)
    mm = Message(rest[:at] + [(ci.MM_VMAS, ci.BYTES, v) for v in vmas] + rest[at:])
    ci.write_image(path, task.mm_magics, [mm.encode()])


def _as_file_mapping(vma: Message, piece: Piece, file_id: int) -> Message:
    status = int(vma.get(ci.VMA_STATUS)) & ~(ci.VMA_ANON_PRIVATE | ci.VMA_AREA_HEAP)
    vma.set(ci.VMA_STATUS, status | ci.VMA_FILE_PRIVATE)
    vma.set(ci.VMA_FLAGS, int(vma.get(ci.VMA_FLAGS)) & ~MAP_ANONYMOUS)
    vma.set(ci.VMA_PGOFF, piece.file_offset).set(ci.VMA_SHMID, file_id)
    return vma.set(ci.VMA_FDFLAGS, os.O_RDONLY)


def _memory_file_entry(file_id: int, file_bytes: int) -> Message:
    fown = Message([(n, ci.VARINT, 0) for n in range(1, 6)])  # uid euid signum pid_type pid
    reg = Message([(ci.RFE_ID, ci.VARINT, file_id), (ci.RFE_FLAGS, ci.VARINT, os.O_RDONLY)])
    reg.set(ci.RFE_POS, 0).set(ci.RFE_FOWN, fown.encode())
    reg.set(ci.RFE_NAME, f"/{MEMORY_KEY}".encode()).set(ci.RFE_SIZE, file_bytes)
    entry = Message([(ci.FE_TYPE, ci.VARINT, ci.FD_TYPE_REG), (ci.FE_ID, ci.VARINT, file_id)])
    return entry.set(ci.FE_REG, reg.encode())


def _file_name(entry: Message) -> str | None:
    reg = entry.get(ci.FE_REG)
    if not isinstance(reg, bytes):
        return None
    name = Message.decode(reg).get(ci.RFE_NAME)
    return name.decode(errors="replace") if isinstance(name, bytes) else None


def _copy(src, dst, src_offset: int, dst_offset: int, num_bytes: int) -> None:
    """num_bytes from src at src_offset to dst at dst_offset (in the kernel where it can)."""
    while num_bytes > 0:
        try:
            done = os.copy_file_range(src.fileno(), dst.fileno(), num_bytes, src_offset, dst_offset)
        except OSError:  # a file system without it: through a buffer
            done = os.pwrite(
                dst.fileno(),
                os.pread(src.fileno(), min(num_bytes, 64 << 20), src_offset),
                dst_offset,
            )
        if done <= 0:
            raise ImageError(f"{src.name}: ends before byte {src_offset + num_bytes}")
        src_offset, dst_offset, num_bytes = src_offset + done, dst_offset + done, num_bytes - done
