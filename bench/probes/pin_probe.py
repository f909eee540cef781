"""What pinning a weights stream's host ring costs, made each way a restore could make it.

python3 bench/probes/pin_probe.py [--slots 16] [--slot-mib 64] [--threads 16]

Each way runs in a fresh process whose CUDA context is made before any clock (as a restore
has it by then), and pins `slots` slots of `slot-mib` MiB:
  serial         torch.empty(pin_memory=True) per slot, one after another (today's ring)
  one_block      one pinned torch.empty as large as the ring
  thread_per_slot one pinned torch.empty per slot, each on its own thread
  register[_thp] anonymous memory (advised for huge pages: _thp), its pages touched by
                 `threads` threads, then one cudaHostRegister: touch and register timed apart
and then copies the first GiB of it to the device (the H2D rate, timed on the device).
Prints one JSON object: per way, its seconds and rate.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

WAYS = ("serial", "one_block", "thread_per_slot", "register", "register_thp")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--slot-mib", type=int, default=64)
    p.add_argument("--threads", type=int, default=16)
    p.add_argument("--way", choices=WAYS, default=None, help="one way, in this process")
    a = p.parse_args()
    if a.way is not None:
        print(json.dumps(pin_one_way(a.way, a.slots, a.slot_mib << 20, a.threads)))
        return
    out: dict = {"slots": a.slots, "slot_mib": a.slot_mib, "threads": a.threads}
    for way in WAYS:
        argv = [sys.argv[0], "--slots", str(a.slots), "--slot-mib", str(a.slot_mib)]
        argv += ["--threads", str(a.threads), "--way", way]
        done = subprocess.run([sys.executable, *argv], capture_output=True, text=True)
        if done.returncode != 0:
            out[way] = {"error": done.stderr.strip().splitlines()[-1:]}
        else:
            out[way] = json.loads(done.stdout)
    print(json.dumps(out, indent=1))


def pin_one_way(way: str, slots: int, slot: int, threads: int) -> dict:
    import torch

    total = slot * slots
    torch.empty(1, device="cuda")  # the context, before any clock
    t0 = time.perf_counter()
    if way == "serial":
        ring = [torch.empty(slot, dtype=torch.uint8, pin_memory=True) for _ in range(slots)]
        return {"seconds": round(time.perf_counter() - t0, 4), "gbps": _h2d_gbps(ring[0])}
    if way == "one_block":
        block = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        return {"seconds": round(time.perf_counter() - t0, 4), "gbps": _h2d_gbps(block)}
    if way == "thread_per_slot":
        with ThreadPoolExecutor(slots) as pool:
            ring = list(
                pool.map(
                    lambda _: torch.empty(slot, dtype=torch.uint8, pin_memory=True), range(slots)
                )
            )
        return {"seconds": round(time.perf_counter() - t0, 4), "gbps": _h2d_gbps(ring[0])}
    area = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if way == "register_thp":
        area.madvise(mmap.MADV_HUGEPAGE)
    host = torch.frombuffer(area, dtype=torch.uint8)
    step = -(-total // threads)
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda i: host[i * step : (i + 1) * step].fill_(1), range(threads)))
    touch_s = time.perf_counter() - t0
    anchor = ctypes.c_char.from_buffer(area)
    t1 = time.perf_counter()
    err = torch.cuda.cudart().cudaHostRegister(ctypes.addressof(anchor), total, 0)
    register_s = time.perf_counter() - t1
    return {
        "seconds": round(time.perf_counter() - t0, 4),
        "touch_s": round(touch_s, 4),
        "register_s": round(register_s, 4),
        "error": int(err),
        "pinned": bool(host.is_pinned()),
        "gbps": _h2d_gbps(host),
    }


def _h2d_gbps(host) -> float:
    import torch

    n = min(host.numel(), 1 << 30)
    dest = torch.empty(n, dtype=torch.uint8, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    dest.copy_(host[:n], non_blocking=True)
    end.record()
    end.synchronize()
    return round(n / (start.elapsed_time(end) / 1e3) / 1e9, 1)


if __name__ == "__main__":
    main()
