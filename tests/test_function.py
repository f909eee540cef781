"""The LLM function: cold init → portable snapshot → restore, and restored == cold output."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from snapfn.handler.llm.init_config import InitConfig
from snapfn.handler.llm.recipes.function import LLMFunction
from snapfn.snapshot.portable.format import validate_snapshot
from snapfn.snapshot.runtime import init_and_snapshot, restore

from parity import greedy, our_prefill_logits, random_prompts

INIT_STAGES = [
    "runtime_env",
    "prewarm",
    "load_weights",
    "memory_profile",
    "kv_pool",
    "warmup",
    "capture_graphs",
    "tokenizer",
    "grammars",
    "health_check",
    "write_snapshot",
]
RESTORE_STAGES = [
    "runtime_env",
    "validate",
    "restore_caches",
    "build_model",
    "kv_pool",
    "start_stream",  # the weights stream while the pool is made and warmed (the default)
    "warmup",
    "stream_weights",
    "capture_graphs",
    "tokenizer",
    "grammars",
    "health_check",
]


def config(tmp_path):
    return InitConfig(
        page_size=4,
        max_num_batched_tokens=64,
        kv_cache_bytes_cpu=1 << 20,
        cache_dir=tmp_path / "cache",
        prewarm_threads=2,
        stream_threads=2,
    )


@pytest.fixture(scope="module")
def made(llama_with_tokenizer, tmp_path_factory):
    """(model dir, snapshot dir, cold function, its startup manifest)."""
    tmp = tmp_path_factory.mktemp("snap")
    fn = LLMFunction(config(tmp), llama_with_tokenizer)
    startup = init_and_snapshot(fn, tmp / "snap", log=None)
    return llama_with_tokenizer, tmp / "snap", fn, startup


def restored(made, tmp_path, snap=None):
    model_dir, snapshot, _, _ = made
    return restore(lambda: LLMFunction(config(tmp_path), model_dir), snap or snapshot, log=None)


def test_init_records_every_stage_in_order(made):
    _, snapshot, _, startup = made
    assert [s.name for s in startup.stages] == INIT_STAGES
    assert startup.ok and all(s.ok for s in startup.stages)
    assert startup.stage("load_weights").figures["bytes"] > 0
    assert startup.stage("runtime_env").figures["imports_s"] >= 0  # the stages' modules, ahead
    assert (
        startup.stage("memory_profile").figures["num_pages"]
        == (1 << 20) // startup.stage("memory_profile").figures["bytes_per_page"]
    )
    manifest = validate_snapshot(snapshot, None, verify="full")
    assert manifest["llm"]["health"]["token"] == startup.stage("health_check").figures["token"]
    assert [s["name"] for s in manifest["startup"]["stages"]] == INIT_STAGES[:-1]


def test_restore_equals_cold_init_bitwise(made, tmp_path):
    _, _, cold, _ = made
    fn, startup = restored(made, tmp_path)
    assert startup.tier == "portable" and not startup.fallbacks
    assert [s.name for s in startup.stages] == RESTORE_STAGES
    prompts = random_prompts(256, [5, 13, 9], seed=21)
    a = cold.engine.generate(prompts, greedy(12))
    b = fn.engine.generate(prompts, greedy(12))
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert [r.logprobs for r in a] == [r.logprobs for r in b]  # bitwise: same device, same kernels
    assert torch.equal(
        our_prefill_logits(cold.engine, prompts[1], 5), our_prefill_logits(fn.engine, prompts[1], 5)
    )


def test_restored_weights_equal_loaded_weights(made, tmp_path):
    _, _, cold, _ = made
    fn, _ = restored(made, tmp_path)
    ours = dict(fn.model.named_parameters())
    for name, param in cold.model.named_parameters():
        assert torch.equal(ours[name].view(torch.uint8), param.view(torch.uint8)), name


def _flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def _edit_manifest(snap, fn):
    m = json.loads((snap / "manifest.json").read_text())
    fn(m)
    (snap / "manifest.json").write_text(json.dumps(m))


def _table_out_of_bounds(m):
    layout = (
        json.loads(m["llm"]["layout"])
        if isinstance(m["llm"]["layout"], str)
        else m["llm"]["layout"]
    )
    name = next(iter(layout["tensors"]))
    layout["tensors"][name]["offset"] = 10**9
    m["llm"]["layout"] = json.dumps(layout) if isinstance(m["llm"]["layout"], str) else layout


CORRUPTIONS = {
    "weights bit flip": (lambda s: _flip(s / "weights/rank0.bin", 100), "stream_weights"),
    "weights truncated": (lambda s: (s / "weights/rank0.bin").write_bytes(b"\0" * 10), "validate"),
    "manifest not json": (lambda s: (s / "manifest.json").write_text("{not json"), "validate"),
    "manifest size edited": (
        lambda s: _edit_manifest(s, lambda m: m["files"]["model/config.json"].update(size=1)),
        "validate",
    ),
    "config file bit flip": (lambda s: _flip(s / "model/config.json", 3), "validate"),
    "missing weights": (lambda s: (s / "weights/rank0.bin").unlink(), "validate"),
    "missing manifest": (lambda s: (s / "manifest.json").unlink(), "validate"),
    "wrong format version": (
        lambda s: _edit_manifest(s, lambda m: m.update(format_version=99)),
        "validate",
    ),
    "compat key for another layout (world size)": (
        lambda s: _edit_manifest(s, lambda m: m["compat"].update(world_size=2)),
        "validate",
    ),
    "compat key for another device type": (
        lambda s: _edit_manifest(s, lambda m: m["compat"].update(device_type="cuda")),
        "validate",
    ),
    "table outside file": (lambda s: _edit_manifest(s, _table_out_of_bounds), "validate"),
    "another torch, and a replay off by more than the tolerance": (
        lambda s: _edit_manifest(
            s,
            lambda m: (
                m["compat"].update(torch="0.0.1"),
                m["llm"]["health"].update(logprob=m["llm"]["health"]["logprob"] - 0.5),
            ),
        ),
        "health_check",
    ),
    "health record edited": (
        lambda s: _edit_manifest(s, lambda m: m["llm"]["health"].update(logprob=-0.5)),
        "health_check",
    ),
}


CACHE_ONLY_DRIFT = {
    "another torch": {"torch": "0.0.1"},
    "another python": {"python": "3.0"},
    "another machine": {"machine": "aarch64"},
    "another GPU, driver and triton": {
        "gpu_name": "NVIDIA B200",
        "compute_capability": "10.0",
        "driver_version": "999.1",
        "triton": "0.0.1",
    },
}


@pytest.mark.parametrize("drift", sorted(CACHE_ONLY_DRIFT))
def test_a_key_that_differs_only_where_caches_care_restores_without_them(made, tmp_path, drift):
    """Another GPU, driver or library: tier 0 still streams the weights, drops the compile
    caches (recorded as such), measures the memory plan again and replays within tolerance."""
    _, snapshot, cold, _ = made
    snap = shutil.copytree(snapshot, tmp_path / "copy")
    field = next(iter(CACHE_ONLY_DRIFT[drift]))
    _edit_manifest(snap, lambda m: m["compat"].update(CACHE_ONLY_DRIFT[drift]))
    fn, startup = restored(made, tmp_path, snap)
    assert startup.tier == "portable" and startup.ok
    [fallback] = startup.fallbacks
    assert (fallback["from"], fallback["to"], fallback["step"]) == (
        "portable",
        "portable, caches dropped",
        "validate",
    )
    assert field in fallback["reason"] and "\n" not in fallback["reason"]
    assert (
        startup.stage("validate")
        .figures["caches"]
        .startswith(f"dropped: snapshot was made for {field}")
    )
    caches = startup.stage("restore_caches").figures
    assert caches["restored_cache_files"] == 0 and field in caches["dropped"]
    assert startup.stage("kv_pool").figures["plan"] == "measured again"
    assert "tolerant" in startup.stage("health_check").figures["replay"]
    prompts = random_prompts(256, [6], seed=23)
    assert (
        fn.engine.generate(prompts, greedy(8))[0].token_ids
        == cold.engine.generate(prompts, greedy(8))[0].token_ids
    )


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_corrupt_snapshot_is_refused_and_generation_falls_back(made, tmp_path, corruption):
    _, snapshot, cold, _ = made
    snap = shutil.copytree(snapshot, tmp_path / "copy")
    corrupt, failing_step = CORRUPTIONS[corruption]
    corrupt(snap)
    fn, startup = restored(made, tmp_path, snap)
    assert startup.tier == "cold (fallback)"
    fallback = startup.fallbacks[0]
    assert fallback["step"] == failing_step, fallback
    assert "\n" not in fallback["reason"] and fallback["reason"]
    prompts = random_prompts(256, [6], seed=22)
    assert (
        fn.engine.generate(prompts, greedy(8))[0].token_ids
        == cold.engine.generate(prompts, greedy(8))[0].token_ids
    )
    if corruption == "missing manifest":
        # a folder without a manifest may not be ours: it is never overwritten
        assert startup.fallbacks[1]["step"] == "write_snapshot"
        assert "not a snapshot" in startup.fallbacks[1]["reason"]
    else:
        assert len(startup.fallbacks) == 1
        validate_snapshot(snap, None, verify="full")  # a fresh snapshot replaced the bad one


def test_manifest_records_model_hash_and_versions(made):
    _, snapshot, _, startup = made
    manifest = validate_snapshot(snapshot, None)
    assert len(manifest["llm"]["model_content_hash"]) == 64
    assert "torch" in startup.info["versions"]


def test_any_exception_in_a_restore_stage_falls_back(made, tmp_path, monkeypatch):
    def broken(self, figures, section):
        raise TypeError("a bug, not a bad snapshot")

    monkeypatch.setattr(LLMFunction, "stage_plan_kv", broken)
    snap = shutil.copytree(made[1], tmp_path / "copy")  # the fallback rewrites it
    fn, startup = restored(made, tmp_path, snap)
    assert startup.tier == "cold (fallback)"
    assert startup.fallbacks[0]["step"] == "kv_pool"
    assert "TypeError: a bug" in startup.fallbacks[0]["reason"]
    assert fn.engine is not None


def test_compiles_counted_says_what_a_stage_added_to_the_compile_caches(tmp_path):
    from snapfn.snapshot.portable import compile_caches

    triton = compile_caches.cache_dirs(tmp_path)["triton"]
    triton.mkdir(parents=True)
    (triton / "old.cubin").write_bytes(b"x")  # there before: not this stage's
    figures: dict = {}
    with compile_caches.compiles_counted(tmp_path, figures):
        (triton / "new.cubin").write_bytes(b"y")
        (triton / "new.json").write_text("{}")
    assert figures == {"compiled_files": 2}


def test_graph_max_batch_zero_turns_decode_graphs_off_but_keeps_warm_shapes(tmp_path):
    from snapfn.handler.llm.engine.graphs import default_buckets

    fn = LLMFunction(dataclasses.replace(config(tmp_path), graph_max_batch=0), None)
    assert fn.buckets() == default_buckets(fn.config.max_running_requests)  # warmed eagerly
    fn.device = "cuda"  # the CUDA answer, without a GPU: decided before the model is looked at
    assert not fn.uses_graphs()
    fn = LLMFunction(dataclasses.replace(config(tmp_path), graph_max_batch=8), None)
    assert fn.buckets() == [1, 2, 4, 8]
