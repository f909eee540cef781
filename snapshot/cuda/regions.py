"""Regions: memory whose pages can be given back while its addresses stay valid.

A process snapshot keeps the weights and the KV pool out of its image. Both live in a `Region`,
and tensors are views into it (`region.view(offset, shape, dtype)`), so the CUDA graphs captured
at init hold addresses inside the region. Before the checkpoint `release()` drops the physical
pages; after the restore `remap()` maps fresh pages at the same addresses and the weights are
streamed back in — the graphs replay unchanged.

- CUDA (`CudaRegion`): the driver's virtual memory management through `cuda.bindings`:
  `cuMemAddressReserve` once, then `cuMemCreate` + `cuMemMap` + `cuMemSetAccess` to map and
  `cuMemUnmap` + `cuMemRelease` to release. The reservation survives the CUDA driver checkpoint
  and restore (measured on the H200: DESIGN.md). Torch sees the memory through
  `__cuda_array_interface__`; its allocator never owns it. Contents after `remap()` are undefined.
- CPU (`CpuRegion`): an anonymous private mapping; `release()` is `madvise(MADV_DONTNEED)`, which
  drops the pages (criu dumps only pages that are present), `remap()` has nothing to do and the
  pages read as zeros until written.

`remap()` raises RestoreFailed (with the driver's error, e.g. out of memory) and leaves the region
released; `release()` and `remap()` are idempotent.
"""

from __future__ import annotations

import mmap
import os
from typing import Any

import torch

from snapfn.snapshot.cuda.driver import ok as _ok
from snapfn.snapshot.errors import RestoreFailed

ALIGN = 2 << 20  # offsets of views, and the CUDA mapping granularity on current GPUs


class Region:
    """`nbytes` of memory at a fixed address on `device`; tensors are views into it."""

    device: torch.device
    nbytes: int
    base: torch.Tensor  # uint8 view of the whole region
    mapped: bool

    def view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of `shape`/`dtype` over bytes [offset, offset + its size) of the region."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        size = itemsize
        for dim in shape:
            size *= dim
        if offset < 0 or offset % itemsize or offset + size > self.nbytes:
            raise ValueError(
                f"view [{offset}, {offset + size}) does not fit a {self.nbytes}-byte region"
            )
        return self.base[offset : offset + size].view(dtype).view(shape)

    def release(self) -> None:
        raise NotImplementedError

    def remap(self) -> None:
        raise NotImplementedError

    def zero(self) -> None:
        self.base.zero_()


class CpuRegion(Region):
    def __init__(self, nbytes: int) -> None:
        self.device = torch.device("cpu")
        self.nbytes = round_up(max(nbytes, 1), mmap.PAGESIZE)
        self._map = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.base = torch.frombuffer(self._map, dtype=torch.uint8)
        self.mapped = True

    def release(self) -> None:
        self._map.madvise(mmap.MADV_DONTNEED)
        self.mapped = False

    def remap(self) -> None:
        self.mapped = True  # anonymous pages come back, zero-filled, on first touch

    def resident_bytes(self) -> int:
        """Bytes of the region backed by memory now (mincore), to check a release."""
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pages = self.nbytes // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * pages)()
        address = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(self.nbytes), vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
        return sum(b & 1 for b in vec) * mmap.PAGESIZE


class CudaRegion(Region):
    def __init__(self, nbytes: int, device: torch.device, in_allocator: bool = False) -> None:
        """`in_allocator`: called from inside torch's allocator (RegionPool): no torch calls,
        `device` must carry its index and its context must already be current."""
        from cuda.bindings import driver as cu

        self._cu = cu
        self.device = device
        if not in_allocator:
            torch.zeros(1, device=device)  # the primary context exists and is current
        index = device.index if device.index is not None else torch.cuda.current_device()
        self._prop, self._access, granularity = device_memory_props(cu, index)
        self.nbytes = round_up(max(nbytes, 1), max(granularity, ALIGN))
        self.address = int(_ok(cu.cuMemAddressReserve(self.nbytes, ALIGN, 0, 0), "reserve"))
        self._handle: Any = None
        self.mapped = False
        self.remap()
        self._base: torch.Tensor | None = None

    @property
    def base(self) -> torch.Tensor:  # type: ignore[override]
        if self._base is None:
            self._base = torch.as_tensor(CudaArray(self.address, self.nbytes), device=self.device)
        return self._base

    def remap(self) -> None:
        if self.mapped:
            return
        self._map(_ok(self._cu.cuMemCreate(self.nbytes, self._prop, 0), "cuMemCreate"))

    def adopt(self, fd: int) -> None:
        """Map memory another process made (its POSIX fd handle, `cuMemCreate`d with this
        region's size) at this region's address, in place of `remap()`; closes `fd`."""
        cu = self._cu
        try:
            if self.mapped:
                raise RestoreFailed("region is mapped already")
            fd_type = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            handle = _ok(cu.cuMemImportFromShareableHandle(fd, fd_type), "import")
        finally:
            os.close(fd)  # NOTE: an open fd would keep the memory alive after cuMemRelease
        self._map(handle)

    def _map(self, handle: Any) -> None:
        """Map physical memory `handle` (the region's from now on) at the region's address."""
        cu = self._cu
        try:
            _ok(cu.cuMemMap(self.address, self.nbytes, 0, handle, 0), "cuMemMap")
        except RestoreFailed:
            cu.cuMemRelease(handle)
            raise
        self._handle, self.mapped = handle, True
        _ok(cu.cuMemSetAccess(self.address, self.nbytes, [self._access], 1), "cuMemSetAccess")

    @property
    def device_index(self) -> int:
        return int(self._access.location.id)

    def release(self, synchronize: bool = True) -> None:
        if not self.mapped:
            return
        if synchronize:
            torch.cuda.synchronize(self.device)
        _ok(self._cu.cuMemUnmap(self.address, self.nbytes), "cuMemUnmap")
        _ok(self._cu.cuMemRelease(self._handle), "cuMemRelease")
        self._handle, self.mapped = None, False

    def close(self, synchronize: bool = True) -> None:
        """Release the memory and give the addresses back (the region is unusable after)."""
        self.release(synchronize)
        _ok(self._cu.cuMemAddressFree(self.address, self.nbytes), "cuMemAddressFree")


class RegionPool:
    """Regions behind a torch `MemPool`: torch's caching allocator gets its segments from here.

    CUDA graphs captured into `mempool()` keep their intermediates in these regions, which a
    process snapshot releases like the KV pool: a replay recomputes every intermediate from the
    static inputs, so their contents never matter across a checkpoint. The callbacks run inside
    torch's allocator (with its lock held): they call the driver only, never torch.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.regions: dict[int, CudaRegion] = {}
        self._callbacks, self.allocator = pluggable_allocator(self._malloc, self._free)
        self.pool = None

    def mempool(self):
        """The torch MemPool to capture graphs into (`torch.cuda.graph(g, pool=mp.id)`)."""
        if self.pool is None:
            self.pool = torch.cuda.MemPool(allocator=self.allocator)
        return self.pool

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.regions.values())

    def _malloc(self, size: int, device: int, stream: int) -> int | None:
        try:
            region = CudaRegion(size, torch.device("cuda", device), in_allocator=True)
        except Exception:  # noqa: BLE001 - out of memory: torch raises its own OOM on None
            return None
        self.regions[region.address] = region
        return region.address

    def _free(self, ptr: int, size: int, device: int, stream: int) -> None:
        regions = getattr(self, "regions", None)  # None while the pool is being collected
        region = regions.pop(ptr, None) if regions is not None else None
        if region is not None:
            region.close(synchronize=False)

    def release(self) -> None:
        torch.cuda.synchronize(self.device)
        for region in self.regions.values():
            region.release(synchronize=False)

    def remap(self) -> None:
        for region in self.regions.values():
            region.remap()


def device_memory_props(cu: Any, index: int) -> tuple[Any, Any, int]:
    """(allocation prop, read-write access, granularity) of pinned device memory on GPU `index`,
    the kind every region and span maps."""
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = index
    flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    granularity = int(_ok(cu.cuMemGetAllocationGranularity(prop, flag), "granularity"))
    access = cu.CUmemAccessDesc()
    access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    access.location.id = index
    access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return prop, access, granularity


class CudaArray:
    """Device memory at an address, as torch.as_tensor takes it (`__cuda_array_interface__`)."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
        }


def allocate_region(nbytes: int, device: torch.device | str) -> Region:
    device = torch.device(device)
    if device.type == "cuda":
        return CudaRegion(nbytes, device)
    if device.type == "cpu":
        return CpuRegion(nbytes)
    raise ValueError(f"no releasable regions on {device.type}")


class Arena:
    """Hands out aligned views of one region in order (a bump allocator, never frees)."""

    def __init__(self, region: Region, align: int = ALIGN) -> None:
        self.region, self.align, self.used = region, align, 0

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        offset = round_up(self.used, self.align)
        tensor = self.region.view(offset, tuple(shape), dtype)
        self.used = offset + tensor.numel() * tensor.element_size()
        return tensor


def arena_bytes(sizes: list[int], align: int = ALIGN) -> int:
    """The region size an Arena needs to take tensors of these byte sizes, in order."""
    used = 0
    for size in sizes:
        used = round_up(used, align) + size
    return used


def pluggable_allocator(malloc: Any, free: Any) -> tuple[tuple[Any, Any], Any]:
    """A torch allocator calling `malloc(size, device, stream) -> address` and
    `free(address, size, device, stream)`: (the ctypes callbacks, which the caller keeps alive
    as long as the allocator, and the allocator for `torch.cuda.MemPool`)."""
    import ctypes

    alloc_type = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
    free_type = ctypes.CFUNCTYPE(
        None, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p
    )
    callbacks = (alloc_type(malloc), free_type(free))
    pointers = [ctypes.cast(c, ctypes.c_void_p).value for c in callbacks]
    return callbacks, torch._C._cuda_customAllocator(*pointers)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
