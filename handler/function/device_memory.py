"""A function's device memory, kept out of its process image (tier 1 on CUDA).

    memory = DeviceMemory(device)                 a SpanPool on the device (snapshot/cuda/span.py)
    with memory.routing():                        the init hooks run here: what they allocate on
        run the init hooks                        this thread lands in the pool
    section, registered = memory.checkpoint(root, unsaved)
                                                  before the dump, after the function's own
                                                  before-snapshot hooks: the pool's live blocks
                                                  written to MEMORY_FILE in the snapshot being
                                                  built (a restore layout), the pool released
    memory.region_specs                           what a restorer makes and fills beside criu
    figures = memory.restore(section, snapshot_dir, resume)
                                                  after the CUDA restore: the restorer's runs
                                                  adopted and checked, else mapped here and the
                                                  file streamed back, every chunk verified

Bytes outside live blocks, and ranges the function marked `api.unsaved`, come back as zeros.
Device memory outside the pool (graphs' private pools, cuBLAS workspaces, allocations on other
streams) stays in the CUDA driver's checkpoint, which copies it into the image.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

MEMORY_FILE = "process/cuda0.bin"  # the pool's image, beside the process image it belongs to
ADOPT_TIMEOUT_S = 60.0  # for the restorer's runs (it may still be filling them)


class DeviceMemory:
    def __init__(self, device: str) -> None:
        import torch

        from snapfn.snapshot.cuda.span import SpanPool

        self.pool = SpanPool(torch.device(device))
        self.image = None  # the PoolImage written at checkpoint (or read at restore)
        self.region_specs: list[dict[str, Any]] = []

    def routing(self):
        return self.pool.routing()

    def pool_bytes(self) -> int:
        return sum(n for _, n in self.pool.span.segments())

    def checkpoint(
        self, root: Path, unsaved: list[tuple[int, int]]
    ) -> tuple[dict[str, Any], list[list[Any]]]:
        """Write the pool's image into `root` and release the pool: (the manifest section's
        "memory", the file's chunk digests to register). Nothing to write: ({}, [])."""
        import torch

        from snapfn.snapshot.errors import RestoreFailed
        from snapfn.snapshot.layout.image import check_image, save_image

        torch.cuda.synchronize(self.pool.device)
        pieces = self.pool.span.segments()
        if not pieces:
            return {}, []
        live = self.pool.live_blocks()
        start = time.perf_counter()
        self.image = save_image(self.pool.span, live, unsaved, root / MEMORY_FILE)
        write_s = time.perf_counter() - start
        # NOTE: the written sums checked against the memory they came from; this also loads the
        # check's kernels into the context, so that the restore's check does not load them
        bad = check_image(self.pool.span, self.image)
        if bad is not None:
            raise RestoreFailed(f"the device memory image's chunk {bad} does not match the pool")
        if self.pool.device.type == "cuda":
            torch.cuda.empty_cache()  # the check's scratch need not be in the image
        self.region_specs = self.image.region_specs(MEMORY_FILE, self.pool.device.index)
        released = self.pool.span.release()
        layout = self.image.layout
        section = {
            "file": MEMORY_FILE,
            "image": self.image.to_json(),
            "pool_bytes": released,
            "live_bytes": sum(n for _, n in live),
            "unsaved_bytes": sum(n for _, n in unsaved),
            "runs": len(self.image.runs),
            "write_s": round(write_s, 4),
        }
        chunks = [MEMORY_FILE, layout.chunk_bytes, layout.chunk_sha256, layout.file_sha256]
        return section, [chunks]

    def restore(
        self, section: dict[str, Any], snapshot_dir: Path, resume: dict[str, Any]
    ) -> dict[str, Any]:
        """Map the pool back at its addresses and fill it, verified; the figures."""
        from snapfn.snapshot.layout.image import PoolImage

        if not section:
            return {"pool_bytes": 0}
        self.image = image = PoolImage.from_json(section["image"])
        figures: dict[str, Any] = {"pool_bytes": section.get("pool_bytes"), "runs": len(image.runs)}
        if resume.get("regions") and self._adopt(figures, resume["regions"]):
            figures["by"] = "restorer"
            return figures
        from snapfn.snapshot.layout.image import load_image

        self.pool.span.release()  # whatever an adoption left mapped
        report = load_image(self.pool.span, image, Path(snapshot_dir) / section["file"])
        figures.update(by="worker", stream_s=round(report.elapsed_s, 4), gbps=round(report.gbps, 2))
        figures["verify"] = report.verify_mode
        return figures

    def _adopt(self, figures: dict[str, Any], address: str) -> bool:
        """Map the runs a restorer made and filled and check them against the image's sums;
        False, with the reason in the figures, when anything is off."""
        from snapfn.snapshot.keeper.region_prefetch import take_regions
        from snapfn.snapshot.layout.image import check_image

        adopt = functools.partial(self.pool.span.adopt_runs, self.image.runs)
        if not take_regions(address, ADOPT_TIMEOUT_S, adopt, figures):
            return False
        start = time.perf_counter()
        try:
            bad = check_image(self.pool.span, self.image)
        except ValueError as exc:  # no sums to check what the restorer filled: stream instead
            figures["fallback"] = str(exc)
            return False
        figures["verify_s"] = round(time.perf_counter() - start, 4)
        if bad is not None:
            figures["fallback"] = f"memory image chunk {bad} failed its sum64 check"
            return False
        return True
