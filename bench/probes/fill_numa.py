"""How fast a file in the page cache reaches GPU memory (device probe), by reader path and
number of threads, with the tier-1 prefetch helper's own readers (snapshot/keeper/region_fill.py):
"pread" (16 MiB into one of two pinned slots per thread, then cuMemcpyHtoDAsync) and "register"
(64 MiB of the mapped file pinned read-only with cuMemHostRegister and copied from there), alone
and mixed (the file split between the two paths, each on its own threads). Also prints the GPU's
NUMA node and the machine's CPUs.

python3 bench/probes/fill_numa.py [GB]      (on a GPU machine; writes /tmp/snapfn-fill.bin)
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

from snapfn.snapshot.cuda.driver import driver, ok
from snapfn.snapshot.keeper import region_fill

cu = driver()
UNIT = {"pread": region_fill.SLOT_BYTES, "register": region_fill.REGISTER_UNIT_BYTES}


def gpu_numa_node() -> int:
    bus = ok(cu.cuDeviceGetPCIBusId(32, 0), "cuDeviceGetPCIBusId")
    bus = (bus.decode() if isinstance(bus, bytes) else str(bus)).split("\0")[0].lower()
    try:
        return int(Path(f"/sys/bus/pci/devices/{bus}/numa_node").read_text())
    except OSError:
        return -1


def fill(path: Path, dst: int, plan: list[tuple[str, int, float]], ctx) -> float:
    """Copy the file to `dst`: plan = [(path kind, threads, share of the file)], in order."""
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    mapping = region_fill._FileMapping(fd, size)
    threads, errors, lo = [], [], 0
    for i, (kind, num_threads, share) in enumerate(plan):
        hi = size if i == len(plan) - 1 else lo + int(size * share) // UNIT[kind] * UNIT[kind]
        units, lock = iter(range(lo, hi, UNIT[kind])), threading.Lock()

        def next_unit(units=units, lock=lock):
            with lock:
                return next(units, None)

        reader = region_fill._reader if kind == "pread" else region_fill._registered_reader
        source = fd if kind == "pread" else mapping
        args = (cu, ctx, source, hi, dst, next_unit, errors)
        threads += [threading.Thread(target=reader, args=args) for _ in range(num_threads)]
        lo = hi
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    mapping.close()
    os.close(fd)
    if errors:
        raise errors[0]
    return round(size / seconds / 1e9, 2)


def main() -> None:
    gb = float(sys.argv[1]) if len(sys.argv) > 1 else 8.0
    path = Path("/tmp/snapfn-fill.bin")
    size = int(gb * 1e9) // (64 << 20) * (64 << 20)
    if not path.exists() or path.stat().st_size != size:
        block = os.urandom(64 << 20)
        with open(path, "wb") as out:
            for _ in range(size // len(block)):
                out.write(block)
    device = ok(cu.cuDeviceGet(0), "cuDeviceGet")
    ctx = ok(cu.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")
    ok(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    dst = int(ok(cu.cuMemAlloc(size), "cuMemAlloc"))
    results = {"gb": size / 1e9, "gpu_numa_node": gpu_numa_node(), "cpus": os.cpu_count()}
    fill(path, dst, [("pread", 8, 1.0)], ctx)  # warm: the page cache, the first pins
    plans = {f"pread_{n}": [("pread", n, 1.0)] for n in (4, 8, 12, 16)}
    plans |= {f"register_{n}": [("register", n, 1.0)] for n in (8, 16)}
    plans |= {
        "mixed_8p_8r_half": [("pread", 8, 0.5), ("register", 8, 0.5)],
        "mixed_8p_4r_third": [("pread", 8, 0.67), ("register", 4, 0.33)],
    }
    for name, plan in plans.items():
        results[f"{name}_gbps"] = fill(path, dst, plan, ctx)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
