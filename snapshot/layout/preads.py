"""Positional reads that fill byte views exactly: `preadv_exact(fd, views, offset)`.

Torch-free, so that the restorer's helper processes (region_fill.py, pinned_cache.py) share it
with the weight streamer (streamer.py). A file that ends before the views are full is a damaged
snapshot: BadSnapshot naming the file and the byte.
"""

from __future__ import annotations

import os

from snapfn.snapshot.errors import BadSnapshot

IOV_MAX = 1024  # Linux's limit on the buffers of one preadv


def preadv_exact(
    fd: int, views: list[memoryview], offset: int, iov_max: int = IOV_MAX, what: str = "file"
) -> None:
    """Fill `views` in order from the file bytes at `offset`, through short reads and IOV_MAX."""
    views, i = list(views), 0
    while i < len(views):
        got = os.preadv(fd, views[i : i + iov_max], offset)
        if got == 0:
            raise BadSnapshot(f"{what}: the file ends at byte {offset}, before the bytes read")
        offset += got
        while got:
            if got >= len(views[i]):
                got -= len(views[i])
                i += 1
            else:
                views[i], got = views[i][got:], 0
