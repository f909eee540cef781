"""GPU functions on a GPU: the releasable pool under tensors and captured graphs, and each
example restored from tier 1 and tier 0 answering bit for bit what a cold init answers, its
device memory out of the process image (CPU: test_function_examples.py, test_span.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from snapfn.snapshot.portable.format import read_manifest

from function_examples import EXAMPLES, assert_informative

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
REPO = Path(__file__).resolve().parent.parent


def test_the_pool_holds_what_the_current_stream_allocates_and_a_graph_keeps_its_own():
    from snapfn.snapshot.cuda.span import SpanPool

    pool = SpanPool("cuda")
    with pool.routing():
        weights = torch.randn(1 << 20, device="cuda")
        static_in = torch.ones(1024, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            (static_in * weights[:1024]).sum()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = (static_in * weights[:1024]).sum()
    span = pool.span
    inside = lambda t: span.base <= t.data_ptr() < span.top  # noqa: E731
    assert inside(weights) and inside(static_in)
    assert not inside(out)  # the graph's own private pool, on its capture stream
    live = pool.live_blocks()
    assert any(a <= weights.data_ptr() < a + n for a, n in live)


def test_a_released_pool_comes_back_bitwise_and_its_graph_replays(tmp_path):
    from snapfn.snapshot.cuda.span import SpanPool
    from snapfn.snapshot.layout.image import check_image, load_image, save_image

    pool = SpanPool("cuda")
    with pool.routing():
        weights = torch.randn(3 << 20, device="cuda", dtype=torch.float16)
        scratch = torch.full((1 << 20,), 7.0, device="cuda")
        x = torch.randn(1024, device="cuda", dtype=torch.float16)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            (x * weights[:1024]).float().sum()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = (x * weights[:1024]).float().sum()
    graph.replay()
    expected, before = out.item(), weights.clone().cpu()
    storage = scratch.untyped_storage()
    image = save_image(
        pool.span,
        pool.live_blocks(),
        [(storage.data_ptr(), storage.nbytes())],
        tmp_path / "cuda0.bin",
    )
    free_before = torch.cuda.mem_get_info()[0]
    assert pool.span.release() >= weights.numel() * 2
    assert torch.cuda.mem_get_info()[0] > free_before  # the memory really went back
    report = load_image(pool.span, image, tmp_path / "cuda0.bin")
    assert report.verify_mode == "device"
    assert torch.equal(weights.cpu(), before)
    assert int(scratch.count_nonzero()) == 0  # marked unsaved: zeros
    out.zero_()
    graph.replay()
    assert out.item() == expected
    assert check_image(pool.span, image) is None


def _init(spec: str, dest: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "snapfn.handler.cli", "init", "--function", spec]
    done = subprocess.run(
        [*argv, "--snapshot", str(dest), "--device", "cuda"],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, **env},
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _answer(spec: str, snapshot: Path | None, cache: Path):
    from snapfn.handler.function.runtime import WorkerRuntime
    from snapfn.handler.function.target import ServeTarget
    from snapfn.handler.llm.init_config import InitConfig

    config = InitConfig(device="cuda", cache_dir=cache)
    target = ServeTarget(kind="function", function=spec, snapshot_dir=snapshot, init_config=config)
    rt = WorkerRuntime(target)
    rt.start(background=False)
    try:
        assert rt.startup.ok, rt.readiness.reason
        return rt.invoke(EXAMPLES[spec]), rt.startup
    finally:
        rt.close()


@pytest.mark.usefixtures("criu_config")
@pytest.mark.parametrize("spec", EXAMPLES)
def test_each_example_restores_bit_for_bit_from_both_tiers(spec, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    cache = tmp_path / "cache"
    env = {"SNAPFN_CACHE_DIR": str(cache)}
    if spec.startswith("examples.cuda_graph"):  # 2.1 GB of weights: what the image must not hold
        env.update(GRAPH_MLP_WIDTH="8192", GRAPH_MLP_LAYERS="16")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    process, portable = tmp_path / "process", tmp_path / "portable"
    _init(spec, process, env)
    _init(spec, portable, {**env, "SNAPFN_CRIU": "/nonexistent"})
    cold, _ = _answer(spec, None, cache)
    assert_informative(spec, cold)
    manifest = read_manifest(process)
    assert manifest["tier"] == "process", manifest["startup"]["fallbacks"]
    meta = manifest["process"]
    worker = meta["worker"]
    assert worker["pool_bytes"] > 0 and meta["regions"]
    if spec.startswith("examples.cuda_graph"):
        # the pool stays out of the image: what the CUDA checkpoint added to the worker's host
        # memory is far less than the weights
        stages = manifest["startup"]["stages"]
        ck = next(s for s in stages if s["name"] == "checkpoint")["figures"]
        grown = ck["private_bytes_after_cuda_checkpoint"] - ck["private_bytes_host"]
        assert grown < worker["pool_bytes"], (grown, worker)  # the pool is not in it
        # only what is outside it (and the checkpoint's own few MB of host state)
        assert grown <= worker["image_device_bytes"] + (64 << 20), (grown, worker)
    got, startup = _answer(spec, process, cache)
    assert startup.tier == "process" and not startup.fallbacks
    assert startup.stage("worker.device_memory").figures["by"] in ("restorer", "worker")
    assert got == cold
    got, startup = _answer(spec, portable, cache)
    assert startup.tier == "portable" and got == cold
    assert startup.stage("init_hooks").figures["compiled_files"] == 0
    if spec.startswith("examples.cuda_graph"):
        assert got["graph"] is True  # the captured graph replayed after the restore


SMALL_GRAPH = {"GRAPH_MLP_WIDTH": "4096", "GRAPH_MLP_LAYERS": "4"}  # 0.13 GB in the pool


@pytest.mark.usefixtures("criu_config")
def test_a_snapshot_made_for_another_driver_restores_at_tier_0_without_its_caches(
    tmp_path, monkeypatch
):
    """Cache-only compat fields differ (another driver and GPU name): tier 1 is refused at the
    gate, tier 0 drops the caches, and the answer is the cold init's."""
    import json

    monkeypatch.chdir(REPO)
    spec, cache = "examples.cuda_graph:handler", tmp_path / "cache"
    env = {**SMALL_GRAPH, "SNAPFN_CACHE_DIR": str(cache)}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    _init(spec, tmp_path / "snap", env)
    cold, _ = _answer(spec, None, cache)
    manifest_path = tmp_path / "snap" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["compat"].update(driver_version="1.0.0", gpu_name="another GPU")
    manifest_path.write_text(json.dumps(manifest))
    got, startup = _answer(spec, tmp_path / "snap", cache)
    steps = [(f["from"], f["to"], f["step"]) for f in startup.fallbacks]
    assert steps == [
        ("process", "portable", "gate"),
        ("portable", "portable, caches dropped", "validate"),
    ], startup.fallbacks
    assert got == cold


@pytest.mark.usefixtures("criu_config")
def test_two_gpu_workers_with_a_namespace_each_restore_at_once(tmp_path, monkeypatch):
    """SNAPFN_PROCESS_PID_NAMESPACE=isolated: each worker its own pid, mount and network
    namespace, so that two copies of one GPU image (which holds an abstract unix socket)
    restore side by side, both to tier 1, both answering the cold init's bits."""
    from concurrent.futures import ThreadPoolExecutor

    from snapfn.snapshot.process import worker_process

    if not worker_process.pid_namespace_works(extra=worker_process.NAMESPACE_FLAGS["isolated"]):
        pytest.skip("unshare --pid --fork --mount-proc --net does not work here")
    monkeypatch.chdir(REPO)
    spec, cache = "examples.cuda_graph:handler", tmp_path / "cache"
    env = {
        **SMALL_GRAPH,
        "SNAPFN_CACHE_DIR": str(cache),
        "SNAPFN_PROCESS_PID_NAMESPACE": "isolated",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    _init(spec, tmp_path / "snap", env)
    assert read_manifest(tmp_path / "snap")["tier"] == "process"
    cold, _ = _answer(spec, None, cache)
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda _: _answer(spec, tmp_path / "snap", cache), range(2)))
    for got, startup in runs:
        assert startup.tier == "process" and not startup.fallbacks, startup.fallbacks
        assert got == cold
