"""What checking restored weights by their sum64 table costs on the GPU (device probe): the
chunk sums of 16 GiB of device memory in 2 MiB and 64 MiB chunks, by torch's multiply and row
sum (`SNAPFN_SUM64_KERNEL=torch`) and by sum64_triton's one-pass kernel, five times each after
a warm-up, the sums compared bit for bit.

python3 bench/probes/sum64_kernel.py [GIB]      (on a GPU machine; prints one JSON object)
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from snapfn.snapshot.layout import checksum


def timed(data: torch.Tensor, chunk_bytes: int, kernel: bool) -> tuple[float, torch.Tensor]:
    checksum._kernels_on.cache_clear()
    checksum.os.environ[checksum.SUM64_KERNEL_ENV] = "auto" if kernel else "torch"
    sums = checksum.chunk_sums(data, chunk_bytes)  # warm-up (the kernel's compile)
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        sums = checksum.chunk_sums(data, chunk_bytes)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), sums


def main() -> None:
    gib = float(sys.argv[1]) if len(sys.argv) > 1 else 16.0
    data = torch.randint(0, 256, (int(gib * (1 << 30)),), dtype=torch.uint8, device="cuda")
    out = {"gib": gib, "device": torch.cuda.get_device_name()}
    for chunk_bytes in (2 << 20, 64 << 20):
        torch_s, want = timed(data, chunk_bytes, kernel=False)
        kernel_s, got = timed(data, chunk_bytes, kernel=True)
        out[f"chunk_{chunk_bytes >> 20}mib"] = {
            "torch_s": round(torch_s, 5),
            "kernel_s": round(kernel_s, 5),
            "kernel_gbps": round(data.numel() / kernel_s / 1e9, 1),
            "speedup": round(torch_s / kernel_s, 2),
            "equal": bool(torch.equal(got, want)),
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
