"""The LLM's weights and KV pool in releasable regions, for process snapshots (tier 1).

A process snapshot must not carry the weights (they stream back from the restore layout faster
than criu could restore them) nor the KV pool (empty between requests). Both live in regions
(snapfn.snapshot.cuda.regions) from the moment they are allocated, before warmup and graph capture, so
every captured graph points into them:

    memory = ReleasableMemory(device)
    memory.adopt_parameters(model)      after build_model, before the weights are loaded
    KVPool(..., alloc=memory.kv_alloc(kv_bytes))
    memory.release()                    before the checkpoint: physical pages dropped
    memory.remap_weights()              after the restore: same addresses
    memory.remap_kv()                   (beside the weight stream): the KV pool, zeroed
    streamer.stream_into(params)        the weights come back

Parameters are placed in `named_parameters()` order at 2 MiB alignment: the restore layout's
own offsets (snapshot/layout/writer.py), so the region is an image of the layout file.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from snapfn.snapshot.cuda.regions import Arena, Region, allocate_region, arena_bytes
from snapfn.snapshot.errors import RestoreFailed


class ReleasableMemory:
    def __init__(self, device: str | torch.device) -> None:
        self.device = torch.device(device)
        self.weights: Region | None = None
        self.kv: Region | None = None
        self.graphs = None  # RegionPool behind the decode graphs' memory pool (CUDA)

    def graph_pool(self):
        """A MemPool id for graph capture whose memory is released with the rest (CUDA)."""
        from snapfn.snapshot.cuda.regions import RegionPool

        self.graphs = RegionPool(self.device)
        return self.graphs.mempool().id

    def adopt_parameters(self, model: torch.nn.Module) -> int:
        """Move every parameter into one region (its data copied); returns the region's bytes."""
        params = list(model.named_parameters())
        sizes = [p.numel() * p.element_size() for _, p in params]
        self.weights = allocate_region(arena_bytes(sizes), self.device)
        arena = Arena(self.weights)
        for _, param in params:
            view = arena.take(tuple(param.shape), param.dtype)
            view.copy_(param.data)
            param.data = view
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the build's own parameter blocks go back to the driver
        return self.weights.nbytes

    def kv_alloc(self, num_bytes: int):
        """An `alloc(shape, dtype)` for KVPool that carves a fresh zeroed region of `num_bytes`."""
        self.kv = allocate_region(num_bytes, self.device)
        self.kv.zero()
        return Arena(self.kv).take

    def regions(self) -> dict[str, Region]:
        return {name: r for name, r in (("weights", self.weights), ("kv", self.kv)) if r}

    def release(self) -> dict[str, Any]:
        released = {name: r.nbytes for name, r in self.regions().items()}
        for region in self.regions().values():
            region.release()
        if self.graphs is not None:
            released["graphs"] = self.graphs.nbytes
            self.graphs.release()
        return released

    def _all_regions(self) -> list[tuple[str, Region]]:
        """(name, region): the weights, the KV pool, then each graph-pool region ("graphs.i")."""
        found = list(self.regions().items())
        if self.graphs is not None:
            found += [(f"graphs.{i}", r) for i, r in enumerate(self.graphs.regions.values())]
        return found

    def region_specs(self, weights_file: str) -> list[dict[str, Any]]:
        """What a restorer makes and fills for us (snapshot/keeper/region_prefetch.py): the weights'
        region is an image of `weights_file` (the restore layout, relative to the snapshot), the
        KV pool is zeroed, graph intermediates need nothing. CUDA only ([] on CPU)."""
        from snapfn.snapshot.keeper.region_prefetch import RegionSpec

        if self.device.type != "cuda":
            return []
        fills = {"weights": "file", "kv": "zero"}  # graph intermediates: "none"
        return [
            RegionSpec(
                name,
                region.address,
                region.nbytes,
                region.device_index,
                fills.get(name, "none"),
                weights_file if name == "weights" else "",
            ).to_json()
            for name, region in self._all_regions()
        ]

    def adopt(self, fds: dict[int, int]) -> None:
        """Map the memory a restorer made ({region address: fd}, every fd closed here) at each
        region's address. Raises RestoreFailed, with every region released again, unless all
        of them were adopted; the caller then remaps and streams as usual."""
        regions = [region for _, region in self._all_regions()]
        missing = [hex(r.address) for r in regions if r.address not in fds]
        try:
            if missing or len(fds) != len(regions):
                raise RestoreFailed(f"the restorer's regions do not match ours (missing {missing})")
            for region in regions:
                region.adopt(fds.pop(region.address))
        except BaseException:
            for fd in fds.values():
                os.close(fd)
            for region in regions:
                region.release(synchronize=False)
            raise

    def remap_weights(self) -> None:
        """The weights' region and the graphs' (intermediates only: replays rewrite them)."""
        if self.weights is not None:
            self.weights.remap()
        if self.graphs is not None:
            self.graphs.remap()

    def remap_kv(self) -> float:
        """The KV pool's region, zeroed (it may run on a side thread while weights stream)."""
        start = time.perf_counter()
        if self.kv is not None:
            self.kv.remap()
            if self.device.type == "cuda":
                self.kv.zero()  # fresh device pages hold anything; CPU pages come back zeroed
                torch.cuda.synchronize(self.device)
        return time.perf_counter() - start


def kv_region_bytes(model: Any, num_pages: int, page_size: int) -> int:
    """Bytes the KV pool's buffers take in a region (each 2 MiB aligned, scratch page included)."""
    tokens = (num_pages + 1) * page_size
    return arena_bytes([tokens * s.bytes_per_token(model.dtype) for s in model.kv_buffer_specs()])
