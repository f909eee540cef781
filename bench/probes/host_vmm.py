"""Can pinned host memory outlive the process that copies it to the GPU (device probe)?

A keeper makes a host-located VMM allocation (cuMemCreate, CU_MEM_LOCATION_TYPE_HOST, POSIX-fd
handle), fills it from a file in the page cache through the CPU, and exports its fd; a second
process (fresh, its own context) imports the fd, maps it, and copies it to device memory. Prints
each step's time and the copy's GB/s: the tier-1 helper's fill from memory that stays pinned.

python3 bench/probes/host_vmm.py [GB]      (on a GPU machine)
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import time

from snapfn.snapshot.cuda.driver import driver, ok

cu = driver()
GRAIN = 2 << 20


def _prop(host: bool):
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    kind = "CU_MEM_LOCATION_TYPE_HOST_NUMA" if host else "CU_MEM_LOCATION_TYPE_DEVICE"
    prop.location.type = getattr(cu.CUmemLocationType, kind)
    prop.location.id = 0  # NUMA node 0 (the lent VM has one) or device 0
    fd_type = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    prop.requestedHandleTypes = fd_type
    return prop


def _map(handle, size: int, host_access: bool) -> int:
    va = int(ok(cu.cuMemAddressReserve(size, GRAIN, 0, 0), "cuMemAddressReserve"))
    ok(cu.cuMemMap(va, size, 0, handle, 0), "cuMemMap")
    descs = []
    for host in (False, True) if host_access else (False,):
        access = cu.CUmemAccessDesc()
        kind = "CU_MEM_LOCATION_TYPE_HOST_NUMA" if host else "CU_MEM_LOCATION_TYPE_DEVICE"
        access.location.type = getattr(cu.CUmemLocationType, kind)
        access.location.id = 0
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        descs.append(access)
    ok(cu.cuMemSetAccess(va, size, descs, len(descs)), "cuMemSetAccess")
    return va


def keeper(size: int) -> None:
    out: dict = {"gb": size / 1e9}
    device = ok(cu.cuDeviceGet(0), "cuDeviceGet")
    ctx = ok(cu.cuDevicePrimaryCtxRetain(device), "ctx")
    ok(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    attr = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
    out["host_numa_vmm_supported"] = int(ok(cu.cuDeviceGetAttribute(attr, device), "attr"))
    t = time.perf_counter()
    handle = ok(cu.cuMemCreate(size, _prop(host=True), 0), "cuMemCreate(host)")
    va = _map(handle, size, host_access=True)
    out["create_map_s"] = round(time.perf_counter() - t, 3)
    t = time.perf_counter()
    path = "/tmp/snapfn-fill.bin"
    if not os.path.exists(path) or os.path.getsize(path) < size:
        block = os.urandom(64 << 20)
        with open(path, "wb") as f:
            for _ in range(-(-size // len(block))):
                f.write(block)
    fd = os.open(path, os.O_RDONLY)
    view = (ctypes.c_ubyte * size).from_address(va)
    done = 0
    while done < size:
        done += os.preadv(fd, [memoryview(view)[done : done + (256 << 20)]], done)
    os.close(fd)
    out["cpu_fill_s"] = round(time.perf_counter() - t, 3)
    export = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    shared = int(ok(cu.cuMemExportToShareableHandle(handle, export, 0), "export"))
    os.set_inheritable(shared, True)
    argv = [sys.executable, __file__, "--import", str(shared), str(size)]
    child = subprocess.run(argv, pass_fds=(shared,), capture_output=True, text=True)
    out["importer"] = json.loads(child.stdout) if child.returncode == 0 else child.stderr[-800:]
    print(json.dumps(out))


def importer(fd: int, size: int) -> None:
    out: dict = {}
    t = time.perf_counter()
    device = ok(cu.cuDeviceGet(0), "cuDeviceGet")
    ctx = ok(cu.cuDevicePrimaryCtxRetain(device), "ctx")
    ok(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    out["context_s"] = round(time.perf_counter() - t, 3)
    t = time.perf_counter()
    fd_type = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    handle = ok(cu.cuMemImportFromShareableHandle(fd, fd_type), "import")
    src = _map(handle, size, host_access=False)
    out["import_map_s"] = round(time.perf_counter() - t, 3)
    dst_handle = ok(cu.cuMemCreate(size, _prop(host=False), 0), "cuMemCreate(device)")
    dst = _map(dst_handle, size, host_access=False)
    stream = ok(cu.cuStreamCreate(1), "cuStreamCreate")
    for attempt in range(3):
        t = time.perf_counter()
        ok(cu.cuMemcpyAsync(dst, src, size, stream), "cuMemcpyAsync")
        ok(cu.cuStreamSynchronize(stream), "sync")
        out[f"copy_{attempt}_gbps"] = round(size / (time.perf_counter() - t) / 1e9, 2)
    print(json.dumps(out))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--import":
        importer(int(sys.argv[2]), int(sys.argv[3]))
    else:
        gigabytes = float(sys.argv[1]) if len(sys.argv) > 1 else 8.0
        keeper(int(gigabytes * 1e9) // GRAIN * GRAIN)
