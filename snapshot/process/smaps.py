"""What a process's memory image will hold: its private pages by mapping, from /proc/PID/smaps.

criu dumps the pages a process owns privately: anonymous memory (heap, thread stacks, pinned
host buffers, the CUDA driver's copy of GPU state after a CUDA checkpoint) and the written
(copy-on-write) pages of private file mappings. `census(pid)` sums them per mapping name so a
checkpoint can say where its image comes from; the process manifest keeps the census taken
before and after the CUDA checkpoint, whose difference is the GPU state moved into host memory.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

_KB = 1024
_SHARED_ANON = ("/dev/zero", "[anon_shmem]", "/memfd:", "/SYSV")


def census(pid: int, top: int = 12) -> dict[str, Any]:
    """{"private_bytes": total, "mappings": n, "top": [[name, bytes], …]} of process `pid`.

    A mapping's private bytes are its "Anonymous" pages plus, for shared anonymous memory
    (which criu dumps too), its resident pages. Unnamed anonymous mappings are "[anon]".
    Raises OSError when the process's smaps cannot be read.
    """
    by_name: dict[str, int] = defaultdict(int)
    count = 0
    with open(f"/proc/{pid}/smaps", encoding="utf-8", errors="replace") as smaps:
        name, shared_anon = "[anon]", False
        for line in smaps:
            key, _, rest = line.partition(" ")
            if not key.endswith(
                ":"
            ):  # a mapping's header: "start-end perms offset dev inode [path]"
                fields = line.split(maxsplit=5)
                name = fields[5].strip() if len(fields) > 5 else "[anon]"
                shared_anon = name.startswith(_SHARED_ANON)
                count += 1
            elif key == "Anonymous:" or (key == "Rss:" and shared_anon):
                by_name[name] += int(rest.split()[0]) * _KB
    ranked = sorted(((n, b) for n, b in by_name.items() if b), key=lambda nb: -nb[1])
    return {
        "private_bytes": sum(by_name.values()),
        "mappings": count,
        "top": [[n, b] for n, b in ranked[:top]],
    }


def census_or_reason(pid: int, top: int = 12) -> dict[str, Any]:
    """`census`, or {"error": why} when /proc cannot tell (never raises)."""
    try:
        return census(pid, top)
    except (OSError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def describe(found: Mapping[str, Any], top: int = 4) -> str:
    """One line for a census: "936.0 MB in 705 mappings ([heap] 642 MB, …)", or its error."""
    if "private_bytes" not in found:
        return str(found.get("error", found))
    names = ", ".join(f"{n.rsplit('/', 1)[-1]} {b / 1e6:.0f} MB" for n, b in found["top"][:top])
    count = f" in {found['mappings']} mappings" if "mappings" in found else ""
    return f"{found['private_bytes'] / 1e6:.1f} MB{count} ({names})"
