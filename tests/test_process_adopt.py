"""The worker's side of the region prefetch (LLMProcessHost._adopt): every way the hand-over can
go wrong ends in a fallback with its reason, never in a restore that uses unchecked memory. The
regions are CPU tensors and memfds stand in for the CUDA fds (the CUDA path: test_process_gpu.py)."""

from __future__ import annotations

import os
import threading

import torch

from snapfn.handler.llm.recipes.process_host import LLMProcessHost
from snapfn.snapshot.errors import RestoreFailed
from snapfn.snapshot.keeper.region_fill import RegionPrefetch, _Made
from snapfn.snapshot.keeper.region_prefetch import RegionSpec
from snapfn.snapshot.layout.checksum import Sum64Chunk, odd_weights
from snapfn.snapshot.layout.table import RestoreLayout

CHUNK = 4096


class FakeMemory:
    """Stands in for ReleasableMemory: `adopt` records the fds (or refuses), `weights.base`
    holds what the restorer "wrote"."""

    def __init__(self, data: torch.Tensor, refuse: str | None = None) -> None:
        self.weights = type("W", (), {"base": data})()
        self.adopted: dict[int, int] = {}
        self.refuse = refuse

    def adopt(self, fds: dict[int, int]) -> None:
        for fd in fds.values():
            os.close(fd)
        if self.refuse:
            raise RestoreFailed(self.refuse)
        self.adopted = dict(fds)


class Restorer(RegionPrefetch):
    def __init__(self, *args, fail: str | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fail = fail

    def _make_and_fill(self, start: float) -> None:
        if self.fail:
            raise RuntimeError(self.fail)
        for spec in self.specs:
            self._made.append(_Made(spec, None, os.memfd_create(spec.name)))

    def _release(self) -> None:
        made, self._made = self._made, []
        for m in made:
            os.close(m.fd)


def host_with(data: torch.Tensor, layout: RestoreLayout, memory: FakeMemory) -> LLMProcessHost:
    host = LLMProcessHost.__new__(LLMProcessHost)
    host.fn = type("F", (), {"memory": memory})()
    host.layout = layout
    return host


def layout_for(data: torch.Tensor) -> RestoreLayout:
    sums = []
    for lo in range(0, data.numel(), CHUNK):
        s = Sum64Chunk(odd_weights(CHUNK // 8))
        s.update(memoryview(data[lo : lo + CHUNK].numpy()))
        sums.append(s.finish())
    return RestoreLayout(
        tensors={},
        file_bytes=data.numel(),
        align=CHUNK,
        chunk_bytes=CHUNK,
        chunk_sha256=["0" * 64] * len(sums),
        file_sha256="0" * 64,
        chunk_sum64=sums,
    )


def adopt(tmp_path, data, layout, memory, *, fail=None, serve=True) -> tuple[bool, dict]:
    address = str(tmp_path / "sock")
    spec = RegionSpec("weights", 1 << 40, 2 << 20, 0, "file", "weights/rank0.bin")
    if serve:
        restorer = Restorer([spec], tmp_path, address, timeout_s=10, fail=fail)
        threading.Thread(target=restorer.run, daemon=True).start()
    host = host_with(data, layout, memory)
    figures: dict = {}
    return host._adopt(figures, {"regions": address}), figures


def test_adopted_regions_with_the_right_weights_are_used(tmp_path):
    data = torch.randint(0, 256, (3 * CHUNK + 10,), dtype=torch.uint8)
    memory = FakeMemory(data)
    ok, figures = adopt(tmp_path, data, layout_for(data), memory)
    assert ok and "fallback" not in figures and list(memory.adopted) == [1 << 40]
    assert figures["verify_s"] >= 0


def test_weights_that_fail_their_check_are_streamed_again(tmp_path):
    data = torch.randint(0, 256, (3 * CHUNK + 10,), dtype=torch.uint8)
    layout = layout_for(data)
    data[2 * CHUNK + 5] ^= 0x10  # what the restorer wrote is not what the layout says
    ok, figures = adopt(tmp_path, data, layout, FakeMemory(data))
    assert not ok and figures["fallback"] == "weights chunk 2 failed its sum64 check"


def test_a_restorer_that_failed_says_why(tmp_path):
    data = torch.zeros(CHUNK, dtype=torch.uint8)
    ok, figures = adopt(tmp_path, data, layout_for(data), FakeMemory(data), fail="out of memory")
    assert not ok and figures["fallback"] == "the restorer failed: RuntimeError: out of memory"


def test_regions_that_do_not_match_ours_are_refused(tmp_path):
    data = torch.zeros(CHUNK, dtype=torch.uint8)
    memory = FakeMemory(data, refuse="the restorer's regions do not match ours (missing ['0x1'])")
    ok, figures = adopt(tmp_path, data, layout_for(data), memory)
    assert not ok and "do not match ours" in figures["fallback"]


def test_no_restorer_at_all_is_a_fallback_not_a_failure(tmp_path, monkeypatch):
    import snapfn.handler.llm.recipes.process_host as process_host

    monkeypatch.setattr(process_host, "ADOPT_TIMEOUT_S", 0.2)
    data = torch.zeros(CHUNK, dtype=torch.uint8)
    ok, figures = adopt(tmp_path, data, layout_for(data), FakeMemory(data), serve=False)
    assert not ok and figures["fallback"].startswith("no regions from the restorer")


def test_the_regions_a_restorer_makes_are_described_as_region_specs():
    from types import SimpleNamespace

    from snapfn.handler.llm.recipes.releasable import ReleasableMemory

    def region(address: int, nbytes: int):
        return SimpleNamespace(address=address, nbytes=nbytes, device_index=0)

    memory = ReleasableMemory("cuda")  # a description only: nothing touches a GPU
    memory.weights, memory.kv = region(1 << 40, 4 << 20), region(2 << 40, 8 << 20)
    memory.graphs = SimpleNamespace(regions={3 << 40: region(3 << 40, 2 << 20)})
    specs = [RegionSpec.from_json(s) for s in memory.region_specs("weights/rank0.bin")]
    assert [(s.name, s.fill, s.path) for s in specs] == [
        ("weights", "file", "weights/rank0.bin"),
        ("kv", "zero", ""),
        ("graphs.0", "none", ""),
    ]
    assert [s.address for s in specs] == [1 << 40, 2 << 40, 3 << 40]
    assert ReleasableMemory("cpu").region_specs("weights/rank0.bin") == []
