"""The bytes' floor of a pull: the same ranged GETs a pull makes, into memory, nothing else.

    floor = measure_get_floor("s3://bucket/prefix", client, num_threads=16)
    floor["seconds"], floor["bytes"], floor["gbps"]

The manifest is fetched (not timed), then every range `pull` would fetch (each chunk of a
chunked file, each other file whole: transfer.py) is read with a ranged GET in `num_threads`
threads, in the blocks a pull reads, into memory: no disk, no hashing, no restore. A pull, and a restore
that follows it, can be no faster than this; `snapfn bench --modes restore_s3` reports both as
ratios to it.
"""

from __future__ import annotations

import time
from typing import Any

from snapfn.snapshot.portable.digests import run_parallel
from snapfn.snapshot.portable.format import parse_manifest
from snapfn.snapshot.store.s3 import S3Location
from snapfn.snapshot.store.transfer import fetch_manifest, fetch_ranges

_BLOCK_BYTES = 1 << 20


def measure_get_floor(uri: str, client: Any, num_threads: int) -> dict[str, Any]:
    """Seconds to GET every range of the snapshot at `uri` into memory; its bytes and GB/s."""
    where = S3Location.parse(uri)
    files = parse_manifest(where, fetch_manifest(client, where))["files"]
    ranges = [r for p in sorted(files) for r in fetch_ranges(p, files[p]) if r.length]

    def get(r) -> int:
        end = r.offset + r.length - 1
        key = where.key(r.relpath)
        body = client.get_object(Bucket=where.bucket, Key=key, Range=f"bytes={r.offset}-{end}")
        got, stream = 0, body["Body"]
        try:
            while block := stream.read(_BLOCK_BYTES):  # as a pull reads them (s3.py)
                got += len(block)
        finally:
            stream.close()
        return got

    start = time.perf_counter()
    num_bytes = sum(run_parallel(get, ranges, num_threads))
    seconds = time.perf_counter() - start
    return {
        "seconds": round(seconds, 4),
        "bytes": num_bytes,
        "gbps": round(num_bytes / max(seconds, 1e-9) / 1e9, 3),
        "num_gets": len(ranges),
        "num_threads": num_threads,
    }
