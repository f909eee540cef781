"""Tier 1 on a GPU: VMM regions under captured graphs, and a whole restore equal to a cold init."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from snapfn.handler.llm.embedded import embedded_model_dir
from snapfn.handler.llm.init_config import InitConfig
from snapfn.snapshot.cuda.regions import Arena, allocate_region

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_cuda_region_release_and_remap_keep_a_captured_graph_valid():
    region = allocate_region(64 << 20, "cuda")
    weights = Arena(region).take((1 << 20,), torch.float32)
    weights.copy_(torch.arange(1 << 20, device="cuda", dtype=torch.float32))
    out = torch.zeros((), device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out.copy_(weights.sum())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(weights.sum())
    graph.replay()
    expected, address = out.item(), weights.data_ptr()
    region.release()
    assert not region.mapped and torch.cuda.mem_get_info()[0] > 0
    region.remap()
    weights.copy_(torch.arange(1 << 20, device="cuda", dtype=torch.float32))
    out.zero_()
    graph.replay()
    assert out.item() == expected and weights.data_ptr() == address


def test_graphs_captured_into_a_region_pool_replay_after_release_and_remap():
    from snapfn.snapshot.cuda.regions import RegionPool

    weights = torch.randn(256, 256, device="cuda")
    x = torch.randn(8, 256, device="cuda")
    regions = RegionPool("cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.relu(x @ weights).sum(dim=1)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=regions.mempool().id):
        out = torch.relu(x @ weights).sum(dim=1)  # intermediates live in the pool's regions
    graph.replay()
    expected = out.clone()
    spans = [(r.address, r.address + r.nbytes) for r in regions.regions.values()]
    assert any(lo <= out.data_ptr() < hi for lo, hi in spans), spans
    regions.release()
    regions.remap()
    out.zero_()
    graph.replay()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def weights_file_and_region(tmp_path):
    """A 6 MiB + 123 B weights file, and a released 8 MiB CUDA region (filled with 7s before
    its release) that a prefetch fills from it: (payload, region, spec)."""
    from snapfn.snapshot.cuda.regions import CudaRegion
    from snapfn.snapshot.keeper.region_prefetch import RegionSpec

    payload = torch.randint(0, 256, ((6 << 20) + 123,), dtype=torch.uint8)
    (tmp_path / "weights.bin").write_bytes(payload.numpy().tobytes())
    weights = CudaRegion(8 << 20, torch.device("cuda", 0))
    weights.base.fill_(7)
    weights.release()
    spec = RegionSpec("weights", weights.address, weights.nbytes, 0, "file", "weights.bin")
    return payload, weights, spec


def take_regions(address: str, *regions) -> dict:
    """The worker's side of a hand-over: receive, adopt each region's fd, ack; the message."""
    from snapfn.snapshot.keeper import region_prefetch

    message, fds, sock = region_prefetch.receive(address, timeout_s=60)
    assert message["ok"], message["error"]
    for region in regions:
        region.adopt(fds[region.address])
    region_prefetch.ack(sock)
    return message


def assert_copied_from_the_hold(message: dict, payload, weights) -> None:
    figures = message["figures"]
    assert figures["pinned_bytes"] == payload.numel() and "pinned_miss" not in figures, figures
    assert torch.equal(weights.base[: payload.numel()].cpu(), payload)


def test_regions_made_and_filled_by_a_prefetch_helper_map_at_our_addresses(tmp_path):
    from snapfn.snapshot.cuda.regions import CudaRegion
    from snapfn.snapshot.keeper.region_prefetch import PrefetchHelper, RegionSpec, prefetch_doc

    payload, weights, weights_spec = weights_file_and_region(tmp_path)
    kv = CudaRegion(4 << 20, torch.device("cuda", 0))
    kv.base.fill_(7)
    kv.release()
    specs = [weights_spec, RegionSpec("kv", kv.address, kv.nbytes, 0, "zero")]
    helper = PrefetchHelper(prefetch_doc(specs, tmp_path, timeout_s=60))
    try:
        message = take_regions(helper.address, weights, kv)
        assert helper.wait(30) == 0  # it let go; our imports keep the memory
    finally:
        helper.close()
    got = weights.base[: payload.numel()].cpu()
    assert torch.equal(got, payload)
    assert int(kv.base.count_nonzero()) == 0
    assert message["figures"]["file_bytes"] == payload.numel()


def test_a_prefetch_helper_copies_the_weights_from_a_pinned_keeper(tmp_path):
    import threading

    from snapfn.snapshot.keeper.daemon import Keeper
    from snapfn.snapshot.keeper.pinned_cache import PinnedCache
    from snapfn.snapshot.keeper.region_prefetch import PrefetchHelper, prefetch_doc

    payload, weights, spec = weights_file_and_region(tmp_path)
    cache = PinnedCache("cuda")
    cache.add(tmp_path / "weights.bin")
    address, stop = str(tmp_path / "pinned.sock"), threading.Event()
    keeper = threading.Thread(target=Keeper(cache).serve, args=(address, stop), daemon=True)
    keeper.start()
    try:
        helper = PrefetchHelper(prefetch_doc([spec], tmp_path, timeout_s=60, pinned=address))
        try:
            message = take_regions(helper.address, weights)
            assert helper.wait(30) == 0
        finally:
            helper.close()
    finally:
        stop.set()
        keeper.join(5)
        cache.close()
    assert_copied_from_the_hold(message, payload, weights)


@pytest.mark.parametrize("hold", ["cuda", "page-cache"])
def test_a_keepers_own_prefetch_copies_from_what_it_holds(tmp_path, hold):
    import threading

    from snapfn.snapshot.keeper.pinned_cache import PinnedCache
    from snapfn.snapshot.keeper.region_fill import RegionPrefetch

    payload, weights, spec = weights_file_and_region(tmp_path)
    cache = PinnedCache(hold)
    cache.add(tmp_path / "weights.bin")
    address = str(tmp_path / "regions.sock")
    prefetch = RegionPrefetch([spec], tmp_path, address, timeout_s=60, local=cache)
    running = threading.Thread(target=prefetch.run, daemon=True)
    running.start()
    try:
        message = take_regions(address, weights)
        running.join(30)
    finally:
        prefetch.cancel()
        running.join(30)
        cache.close()
    assert_copied_from_the_hold(message, payload, weights)


def assert_serves(service, prompts, params, want) -> None:
    """The restored service generates what the cold init did: the same tokens, logprobs."""
    got = [service.generate(p, params) for p in prompts]
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids and g.logprobs == w.logprobs


def wait_for_exit(pid: int, timeout_s: float = 30.0) -> None:
    import os
    import time

    deadline = time.monotonic() + timeout_s
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not os.path.exists(f"/proc/{pid}"), f"worker {pid} still there after {timeout_s} s"


def test_tier1_restore_on_cuda_equals_cold_init(tmp_path, criu_config, monkeypatch):
    from snapfn.handler.llm.engine.request import SamplingParams
    from snapfn.handler.llm.recipes.cli import _init_process
    from snapfn.handler.llm.recipes.process_restore import restore_llm
    from snapfn.handler.llm.service import LLMService
    from snapfn.snapshot.runtime import cold_init

    # NOTE: SNAPFN_BACKEND picks the backend (default: the best installed). With the Triton
    # kernels, the two cold inits tune every GEMV config first (over 2 minutes on the H200).
    backend = os.environ.get("SNAPFN_BACKEND", "auto")
    config = InitConfig(
        device="cuda", mem_fraction_static=0.1, cache_dir=tmp_path / "cache", backend=backend
    )
    startup = _init_process(config, embedded_model_dir(), tmp_path / "snap")
    assert startup.tier == "process", startup.fallbacks

    from snapfn.handler.llm.recipes.function import LLMFunction

    cold = LLMFunction(config, embedded_model_dir())
    cold_init(cold, log=None)
    reference = LLMService(cold.engine)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11]]
    want = [reference.generate(p, params) for p in prompts]
    reference.close()
    cold.release()

    service, restored, fn = restore_llm(Path(tmp_path / "snap"), config, None, log=print)
    try:
        assert fn is None and restored.tier == "process", restored.fallbacks
        assert_serves(service, prompts, params, want)
        assert restored.stage("cuda_restore").ok
        adopt = restored.stage("worker.adopt")  # the restorer made and filled the regions
        assert adopt is not None and "fallback" not in adopt.figures, adopt
        print({s.name: round(s.seconds, 3) for s in restored.stages})
    finally:
        service.close()
    # NOTE: a CUDA worker keeps its pid (no pid namespace): the next restore needs it free
    wait_for_exit(restored.stage("criu_restore").figures["pid"])

    assert restored.stage("cuda_restore").figures["keeper"].startswith("no keeper at")

    # a keeper serving: it makes and fills the regions (from its pinned copy) and does the
    # CUDA restore; this process never initialises the driver for the restore
    import threading

    from snapfn.snapshot.keeper.daemon import Keeper
    from snapfn.snapshot.keeper.pinned_cache import PinnedCache, files_to_pin

    cache = PinnedCache("cuda")
    for path in files_to_pin(tmp_path / "snap"):
        cache.add(path)
    address, stop = str(tmp_path / "keeper.sock"), threading.Event()
    keeper = Keeper(cache)
    keeper.warm()
    serving = threading.Thread(target=keeper.serve, args=(address, stop), daemon=True)
    serving.start()
    monkeypatch.setenv("SNAPFN_PINNED_SOCKET", address)
    try:
        while not Path(address).exists():
            time.sleep(0.01)
        service, restored, fn = restore_llm(Path(tmp_path / "snap"), config, None, log=print)
        try:
            assert fn is None and restored.tier == "process", restored.fallbacks
            assert_serves(service, prompts, params, want)
            assert restored.stage("prefetch").figures.get("by") == "keeper", restored.stages
            assert restored.stage("cuda_restore").figures.get("by") == "keeper", restored.stages
            figures = restored.stage("worker.adopt").figures
            assert "fallback" not in figures and figures["restorer"]["pinned_bytes"] > 0, figures
            print({s.name: round(s.seconds, 3) for s in restored.stages})
        finally:
            service.close()
        wait_for_exit(restored.stage("criu_restore").figures["pid"])
    finally:
        stop.set()
        serving.join(5)
        cache.close()
    monkeypatch.delenv("SNAPFN_PINNED_SOCKET")

    monkeypatch.setenv("SNAPFN_PROCESS_PREFETCH", "off")  # the worker maps and streams itself
    service, restored, fn = restore_llm(Path(tmp_path / "snap"), config, None, log=print)
    try:
        assert fn is None and restored.tier == "process", restored.fallbacks
        assert restored.stage("worker.adopt") is None and restored.stage("worker.stream_weights")
        assert_serves(service, prompts, params, want)
    finally:
        service.close()
