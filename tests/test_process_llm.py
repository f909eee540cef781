"""The built-in LLM through a process snapshot (tier 1) on CPU: equal to a cold init, and a
replay mismatch or a dead worker never serves. Skips with criu's reason where criu cannot run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from snapfn.handler.llm.embedded import embedded_model_dir
from snapfn.handler.llm.engine.request import SamplingParams
from snapfn.handler.llm.init_config import InitConfig
from snapfn.handler.llm.recipes.process_host import REPLAY_TOKENS
from snapfn.snapshot.errors import BadRequest
from snapfn.snapshot.process.worker_process import ProcessConfig
from snapfn.snapshot.stages import Readiness

PROMPTS = [[1, 2, 3, 4], [9, 8, 7, 6, 5, 4, 3, 2, 1]]
GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=12, temperature=0.9, top_k=40, seed=11, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("criu_config", "tests_on_pythonpath", "worker_threads")


@pytest.fixture(scope="module")
def worker_threads():
    """The checkpointed worker computes with as many threads as this process (conftest sets
    one): CPU GEMMs split their sums by thread count, so 1 thread here against the worker's
    default of one per core differs in the last bits of a logprob."""
    import torch

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
        yield


def config(tmp: Path) -> InitConfig:
    return InitConfig(kv_cache_bytes_cpu=32 << 20, cache_dir=tmp / "cache")


@pytest.fixture(scope="module")
def tier1(tmp_path_factory):
    from snapfn.handler.llm.recipes.cli import _init_process

    tmp = tmp_path_factory.mktemp("llm1")
    startup = _init_process(config(tmp), embedded_model_dir(), tmp / "snap")
    assert startup.tier == "process", startup.fallbacks
    return tmp


@pytest.fixture(scope="module")
def cold_outputs(tier1):
    """A cold init as the process snapshot's worker does it (weights in a releasable region:
    CPU GEMMs may round differently on differently aligned weights, so both sides use one)."""
    from snapfn.handler.llm.recipes.function import LLMFunction
    from snapfn.handler.llm.service import LLMService
    from snapfn.snapshot.runtime import cold_init

    fn = LLMFunction(config(tier1), embedded_model_dir(), releasable=True)
    cold_init(fn, log=None)
    service = LLMService(fn.engine)
    try:
        return [service.generate(p, s) for p in PROMPTS for s in (GREEDY, SAMPLED)]
    finally:
        service.close()
        fn.release()


def test_tier1_restore_generates_exactly_what_a_cold_init_does(tier1, cold_outputs):
    from snapfn.handler.llm.recipes.process_restore import restore_llm

    service, startup, fn = restore_llm(tier1 / "snap", config(tier1), None, log=None)
    try:
        assert fn is None and startup.tier == "process" and not startup.fallbacks
        got = [service.generate(p, s) for p in PROMPTS for s in (GREEDY, SAMPLED)]
        for g, w in zip(got, cold_outputs, strict=True):
            assert (g.token_ids, g.logprobs, g.text) == (w.token_ids, w.logprobs, w.text)
        replay = startup.stage("worker.replay_check").figures
        assert replay["tokens"] == replay["recorded"] and len(replay["tokens"]) == REPLAY_TOKENS
        for _ in range(3):  # what a metrics scrape asks; a refused request
            assert service.kv_usage() >= 0
        with pytest.raises(BadRequest):
            service.submit([], GREEDY)
        assert service.client._waiting == {}  # one-reply requests leave nothing behind
    finally:
        service.close()


def test_the_restorer_does_not_import_torch(tier1):
    code = (
        "import sys\nfrom pathlib import Path\n"
        "from snapfn.handler.llm.init_config import InitConfig\n"
        "from snapfn.handler.llm.recipes.process_restore import restore_process\n"
        "from snapfn.handler.llm.engine.request import SamplingParams\n"
        f"s, st = restore_process(Path({str(tier1 / 'snap')!r}), InitConfig(), None)\n"
        "r = s.generate([1, 2, 3], SamplingParams(max_new_tokens=3))\n"
        "print('torch' in sys.modules, st.tier, len(r.token_ids))\ns.close()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["False", "process", "3"], done.stderr[-2000:]


def test_a_replay_mismatch_fails_closed_and_falls_back_to_tier_0(tmp_path, cold_outputs):
    from snapfn.handler.llm.recipes.process_restore import restore_llm
    from snapfn.handler.llm.recipes.snapshot_files import config_json
    from snapfn.snapshot.process.snapshot import init_process_snapshot

    args = {"model_dir": str(embedded_model_dir()), "init_config": config_json(config(tmp_path))}
    _, manifest = init_process_snapshot(
        "process_hosts:perturbed_llm",
        args,
        tmp_path / "snap",
        ProcessConfig.from_env(os.environ),
        None,
    )
    assert manifest["tier"] == "process"
    service, startup, fn = restore_llm(tmp_path / "snap", config(tmp_path), None, log=None)
    try:
        (fallback,) = startup.fallbacks
        assert (fallback["from"], fallback["to"], fallback["step"]) == (
            "process",
            "portable",
            "resume",
        )
        assert "replay check failed" in fallback["reason"]
        assert startup.tier == "portable" and fn is not None
        assert service.generate(PROMPTS[0], GREEDY).token_ids == cold_outputs[0].token_ids
    finally:
        service.close()


def test_generate_cli_restores_tier1_and_prints_the_cold_tokens(tier1, cold_outputs):
    argv = [
        sys.executable,
        "-m",
        "snapfn.handler.cli",
        "generate",
        "--snapshot",
        str(tier1 / "snap"),
    ]
    argv += ["--prompt-ids", "1,2,3,4", "--max-new-tokens", "12", "--ignore-eos", "--json"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["token_ids"] == list(cold_outputs[0].token_ids)
    assert "restore (process) ok" in done.stderr


def test_generate_restores_tier1_from_an_s3_snapshot(tier1, cold_outputs, tmp_path):
    from snapfn.snapshot.store.transfer import push

    from moto_server import fake_aws

    with fake_aws("tier1") as aws:
        push(tier1 / "snap", "s3://tier1/snap", endpoint_url=aws.endpoint_url, log=None)
        env = {**os.environ, "AWS_ENDPOINT_URL": aws.endpoint_url}
        env["SNAPFN_SNAPSHOT_CACHE"] = str(tmp_path / "cache")
        argv = [sys.executable, "-m", "snapfn.handler.cli", "generate", "--snapshot"]
        argv += ["s3://tier1/snap", "--prompt-ids", "1,2,3,4", "--max-new-tokens", "12"]
        argv += ["--ignore-eos", "--json"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["token_ids"] == list(cold_outputs[0].token_ids)
    assert "restore (process) ok" in done.stderr  # pulled first, then restored as tier 1


def test_worker_runtime_serves_tier1_and_fails_when_the_worker_dies(tier1):
    from snapfn.handler.function.runtime import WorkerRuntime
    from snapfn.handler.function.target import ServeTarget

    target = ServeTarget(kind="llm", snapshot_dir=tier1 / "snap", init_config=config(tier1))
    runtime = WorkerRuntime(target)
    runtime.start(background=False)
    try:
        assert runtime.readiness.state is Readiness.UP and runtime.startup.tier == "process"
        answer = runtime.invoke({"prompt": "Hello", "max_tokens": 5})
        assert answer["usage"]["completion_tokens"] == 5
        os.kill(runtime.llm.client.worker.pid, signal.SIGKILL)
        _wait_for(lambda: runtime.readiness.state is Readiness.FAILED)
        assert "worker process exited" in runtime.readiness.reason
    finally:
        runtime.close()


def _wait_for(condition, timeout_s: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_inspect_shows_the_process_image(tier1):
    from snapfn.handler.llm.recipes.cli import format_table, load_startup

    table = format_table(*load_startup(tier1 / "snap"))
    assert "process image (tier 1):" in table and "release_weights_and_kv" in table
    assert "checkpoint" in table  # the checkpoint stage's timing is in the startup manifest
    assert "private memory host:" in table  # the census: where the image's bytes come from
    assert "memory moved out of the image:" in table and "memory.bin" in table


def test_inspect_names_the_regions_a_restorer_makes():
    from snapfn.handler.llm.recipes.cli import _process_memory_lines

    process = {
        "private_memory": {
            "after_cuda_checkpoint": {"private_bytes": 1.5e9, "top": [["[anon]", 9e8]]}
        },
        "regions": [
            {"name": "weights", "nbytes": 16 << 30, "fill": "file"},
            {"name": "kv", "nbytes": 100 << 30, "fill": "zero"},
        ]
        + [{"name": f"graphs.{i}", "nbytes": 2 << 20, "fill": "none"} for i in range(3)],
    }
    lines = _process_memory_lines(process)
    assert lines[0] == "  private memory after_cuda_checkpoint: 1500.0 MB ([anon] 900 MB)"
    assert "weights 17.18 GB file, kv 107.37 GB zero, graphs.0 0.00 GB none, +2 more" in lines[1]


def _streamed(service, params):
    outs = list(service.submit(PROMPTS[1], params))
    return (
        [t for o in outs for t in o.new_top_logprobs],
        [lp for o in outs for lp in o.prompt_logprobs],
        [t for o in outs for t in o.prompt_top_logprobs],
    )


def test_tier1_streams_alternatives_and_prompt_logprobs_as_a_cold_init_does(tier1):
    from snapfn.handler.llm.recipes.function import LLMFunction
    from snapfn.handler.llm.recipes.process_restore import restore_llm
    from snapfn.handler.llm.service import LLMService
    from snapfn.snapshot.runtime import cold_init

    params = SamplingParams(max_new_tokens=4, ignore_eos=True, top_logprobs=3, prompt_logprobs=2)
    fn = LLMFunction(config(tier1), embedded_model_dir(), releasable=True)
    cold_init(fn, log=None)
    local = LLMService(fn.engine)
    try:
        want = _streamed(local, params)
    finally:
        local.close()
        fn.release()
    service, startup, _ = restore_llm(tier1 / "snap", config(tier1), None, log=None)
    try:
        assert startup.tier == "process"
        got = _streamed(service, params)
    finally:
        service.close()
    assert got == want
    tops, prompt, prompt_top = got
    assert len(tops) == 4 and all(len(t) == 3 for t in tops)
    assert prompt[0] is None and len(prompt) == len(PROMPTS[1])


def test_a_tier1_restore_warms_the_prefix_cache_again(tmp_path):
    """The image's cache was emptied before the checkpoint (its KV pool does not come back):
    the restored worker prefills the configured prompts again before it serves."""
    from dataclasses import replace

    from snapfn.handler.llm.recipes.cli import _init_process
    from snapfn.handler.llm.recipes.process_restore import restore_llm

    system = "Answer briefly and plainly; say when you are not sure. " * 4
    (tmp_path / "warm.json").write_text(json.dumps([system]))
    made = replace(config(tmp_path), prefix_warm=tmp_path / "warm.json")
    startup = _init_process(made, embedded_model_dir(), tmp_path / "snap")
    assert startup.tier == "process", startup.fallbacks
    service, restored, _ = restore_llm(tmp_path / "snap", config(tmp_path), None, log=None)
    try:
        assert restored.tier == "process" and not restored.fallbacks
        warmed = restored.stage("worker.prefix_warm").figures
        assert warmed["prompts"] == 1 and warmed["cached_pages"] > 0
        assert restored.stage("worker.replay_check").figures["prefix_cache_pages"] == 0
        assert service.prefix_cache_stats()["cached_pages"] == warmed["cached_pages"]
    finally:
        service.close()


def _flip(path: Path, at: float = 0.5) -> None:
    with path.open("r+b") as f:
        offset = int(path.stat().st_size * at)
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x55]))


@pytest.mark.parametrize("image", ["pages-1.img", "memory.bin", "core-1.img", "inventory.img"])
def test_a_tampered_image_file_is_refused_before_the_worker_resumes(
    tier1, tmp_path, cold_outputs, image
):
    """Every image file criu or the worker reads is hashed beside criu's restore, and the worker
    resumes only once they match: a flipped byte anywhere in them (the worker's memory, a
    thread's registers) is refused at validate, and the portable tier serves."""
    import shutil

    from snapfn.handler.llm.recipes.process_restore import restore_llm

    snap = shutil.copytree(tier1 / "snap", tmp_path / "snap")
    path = snap / "process" / image
    if not path.exists():
        pytest.skip(f"this image has no {image} (criu's layout or SNAPFN_PROCESS_MEMORY)")
    _flip(path)
    service, startup, fn = restore_llm(snap, config(tmp_path), None, log=None)
    try:
        (fallback,) = startup.fallbacks
        assert (fallback["from"], fallback["to"], fallback["step"]) == (
            "process",
            "portable",
            "validate",
        )
        assert f"process/{image}" in fallback["reason"] and "sha256 mismatch" in fallback["reason"]
        assert service.generate(PROMPTS[0], GREEDY).token_ids == cold_outputs[0].token_ids
    finally:
        service.close()


def test_an_image_of_other_snapfn_code_is_refused_in_one_line(tier1, tmp_path, cold_outputs):
    """A restored worker runs the code its image holds and the host the installed code: an
    image whose code fingerprint is not the installed one restores from its portable tier."""
    import shutil

    from snapfn.handler.llm.recipes.process_restore import restore_llm
    from snapfn.snapshot.process.code_identity import code_fingerprint

    snap = shutil.copytree(tier1 / "snap", tmp_path / "snap")
    doc = json.loads((snap / "manifest.json").read_text())
    assert doc["process"]["code"] == code_fingerprint()
    doc["process"]["code"] = "0" * 64
    (snap / "manifest.json").write_text(json.dumps(doc))
    service, startup, fn = restore_llm(snap, config(tmp_path), None, log=None)
    try:
        (fallback,) = startup.fallbacks
        assert fallback["step"] == "validate" and "other snapfn code" in fallback["reason"]
        assert "\n" not in fallback["reason"]
        assert service.generate(PROMPTS[0], GREEDY).token_ids == cold_outputs[0].token_ids
    finally:
        service.close()


def test_image_files_a_keeper_holds_are_not_hashed_again_until_one_is_written(
    tier1, tmp_path, cold_outputs, monkeypatch
):
    """A keeper that hashed the image files and holds them under read leases answers for them,
    and the restore hashes only the rest; a write to one (its open breaks the lease) makes the
    next restore hash every file itself, refuse the changed one and serve from tier 0."""
    import shutil

    from test_keeper import serving
    from test_verified_images import _write_elsewhere, lease_problem

    from snapfn.handler.llm.recipes.process_restore import restore_llm
    from snapfn.snapshot.keeper.daemon import Keeper
    from snapfn.snapshot.keeper.pinned_cache import PinnedCache
    from snapfn.snapshot.keeper.verified_images import VerifiedImages
    from snapfn.snapshot.process.snapshot import ASK_KEEPER_BYTES

    if lease_problem(tmp_path) is not None:
        pytest.skip(lease_problem(tmp_path))
    snap = shutil.copytree(tier1 / "snap", tmp_path / "snap")
    before = signal.getsignal(signal.SIGIO)
    images = VerifiedImages.install()
    address = str(tmp_path / "k" / "keeper.sock")
    stop, thread = serving(Keeper(PinnedCache("memfd"), cuda=False, images=images), address)
    monkeypatch.setenv("SNAPFN_PINNED_SOCKET", address)
    try:
        images.hold(snap)
        big = [p for p in (snap / "process").iterdir() if p.stat().st_size >= ASK_KEEPER_BYTES]
        assert big
        service, startup, _ = restore_llm(snap, config(tmp_path), None, log=None)
        try:
            assert startup.tier == "process" and not startup.fallbacks
            assert startup.stage("validate").figures["images_held_by_keeper"] == len(big)
            assert service.generate(PROMPTS[0], GREEDY).token_ids == cold_outputs[0].token_ids
        finally:
            service.close()
        biggest = max(big, key=lambda p: p.stat().st_size)
        _write_elsewhere(biggest)
        service, startup, _ = restore_llm(snap, config(tmp_path), None, log=None)
        try:
            (fallback,) = startup.fallbacks
            assert fallback["step"] == "validate" and "sha256 mismatch" in fallback["reason"]
            assert service.generate(PROMPTS[0], GREEDY).token_ids == cold_outputs[0].token_ids
        finally:
            service.close()
    finally:
        stop.set()
        thread.join(5)
        images.drop()
        signal.signal(signal.SIGIO, before)


def _edited_copy(tier1, tmp_path, edit) -> Path:
    """A copy of the tier-1 snapshot whose manifest `edit(doc, snap)` rewrote (unsigned)."""
    import shutil

    snap = shutil.copytree(tier1 / "snap", tmp_path / "snap")
    doc = json.loads((snap / "manifest.json").read_text())
    edit(doc, snap)
    (snap / "manifest.json").write_text(json.dumps(doc))
    return snap


def _move_image_file(doc: dict, snap: Path, old: str, new: str) -> None:
    (snap / new).parent.mkdir(exist_ok=True)
    os.rename(snap / old, snap / new)
    doc["files"][new] = doc["files"].pop(old)


@pytest.mark.parametrize("trick", ["another_ranks_folder", "memory_named_as_device_memory"])
def test_an_image_file_a_manifest_routes_past_hashing_is_refused(
    tier1, tmp_path, cold_outputs, trick
):
    """An unsigned manifest cannot send a changed image file to criu unhashed: not as rank 0's
    image in another rank's folder (which rank 0's validation skips), nor as the worker's
    memory file under a device memory file's name (which the streamed check covers on CUDA)."""
    from snapfn.handler.llm.recipes.process_restore import restore_llm

    def edit(doc: dict, snap: Path) -> None:
        if trick == "another_ranks_folder":
            for relpath in [p for p in doc["files"] if p.startswith("process/")]:
                _move_image_file(doc, snap, relpath, relpath.replace("process/", "process-rank1/"))
            doc["process"]["images"] = "process-rank1"
            changed = snap / "process-rank1" / "pages-1.img"
        else:
            memory = doc["process"]["memory"]
            _move_image_file(doc, snap, f"process/{memory['file']}", "process/cuda0.bin")
            memory["file"] = "cuda0.bin"
            changed = snap / "process" / "cuda0.bin"
        _flip(changed)  # its digest in the manifest no longer matches

    snap = _edited_copy(tier1, tmp_path, edit)
    if trick == "memory_named_as_device_memory" and not (snap / "process/cuda0.bin").exists():
        pytest.skip("this image keeps its memory in criu's pages (SNAPFN_PROCESS_MEMORY)")
    service, startup, _ = restore_llm(snap, config(tmp_path), None, log=None)
    try:
        (fallback,) = startup.fallbacks
        assert fallback["step"] == "validate" and "\n" not in fallback["reason"]
        assert service.generate(PROMPTS[0], GREEDY).token_ids == cold_outputs[0].token_ids
    finally:
        service.close()
