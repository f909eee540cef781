"""Tier-0 snapshots of two CPU ranks (tensor parallel over gloo): `snapfn init --tp-size 2`
writes one weights file per rank; a two-rank restore streams each rank's own and answers what
one rank's cold init does; a corrupt rank-1 file fails the restore on every rank, which fall
back together and rewrite the snapshot; another rank count is refused at validation with the
reason. Tier 1 (real criu): a process image of each rank restores, its communicators made
again, and answers the same; a bad image of one rank falls back to tier 0 on every rank."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from snapfn.handler.function.runtime import WorkerRuntime
from snapfn.handler.function.target import ServeTarget
from snapfn.handler.llm.init_config import InitConfig
from snapfn.handler.llm.recipes.section import check_section
from snapfn.snapshot.errors import BadSnapshot
from snapfn.snapshot.portable.format import read_manifest, validate_snapshot
from snapfn.snapshot.stages import Readiness

pytestmark = pytest.mark.slow
EVENT = {"prompt_ids": [5, 17, 3, 9, 12], "max_tokens": 8}


def _env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    return {**env, "SNAPFN_CACHE_DIR": str(tmp / "cache"), "OMP_NUM_THREADS": "1"}


def _init(model: Path, dest: Path, *extra: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "snapfn.handler.cli", "init", "--model", str(model)]
    return subprocess.run(
        [*argv, "--snapshot", str(dest), *extra],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(dest.parent),
    )


def _answer(snapshot: Path | None, tp: int, model: Path | None = None):
    config = InitConfig(tp_size=tp, cache_dir=(snapshot or model).parent / "cache")
    runtime = WorkerRuntime(ServeTarget(model_dir=model, snapshot_dir=snapshot, init_config=config))
    runtime.start(background=False)
    try:
        assert runtime.wait_ready(120) is Readiness.UP, runtime.readiness.reason
        return runtime.invoke(dict(EVENT))["token_ids"], runtime.startup
    finally:
        runtime.close()


@pytest.fixture(scope="module")
def two_rank_snapshot(tiny_llama_dir, tmp_path_factory):
    dest = tmp_path_factory.mktemp("tp-snap") / "snap"
    done = _init(tiny_llama_dir, dest, "--tp-size", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    return dest


@pytest.fixture(scope="module")
def one_rank_answer(tiny_llama_dir):
    return _answer(None, 1, tiny_llama_dir)[0]


def test_init_writes_a_weights_file_per_rank_and_lists_each_ranks_layout(two_rank_snapshot):
    manifest = validate_snapshot(two_rank_snapshot, verify="full")
    assert {"weights/rank0.bin", "weights/rank1.bin"} <= set(manifest["files"])
    section = manifest["llm"]
    assert section["parallel"] == {"tp_size": 2, "ep_size": 1, "ep_dispatch": "replicated"}
    assert manifest["compat"]["world_size"] == 2
    (warmup,) = [s for s in manifest["startup"]["stages"] if s["name"] == "warmup"]
    assert set(warmup["figures"]["collectives"]) == {
        "tp_all_reduce_s", "vocab_all_gather_s", "cpu_broadcast_s"
    }  # fmt: skip
    hashes = [r["model_content_hash"] for r in section["ranks"]]
    assert hashes[0] == section["model_content_hash"] and hashes[0] != hashes[1]


def test_two_ranks_restore_their_own_files_and_answer_like_one_rank(
    two_rank_snapshot, one_rank_answer
):
    ids, startup = _answer(two_rank_snapshot, 2)
    assert startup.tier == "portable" and not startup.fallbacks, startup.fallbacks
    names = [s.name for s in startup.stages]
    assert names.index("stream_weights") < names.index("ranks_agree") < names.index("kv_pool")
    assert ids == one_rank_answer


def test_a_corrupt_rank_file_makes_every_rank_fall_back_and_rewrite(
    two_rank_snapshot, one_rank_answer, tmp_path
):
    snap = shutil.copytree(two_rank_snapshot, tmp_path / "snap")
    with open(snap / "weights" / "rank1.bin", "r+b") as f:
        f.seek(4096)
        f.write(b"\x55" * 64)
    ids, startup = _answer(snap, 2)
    assert startup.tier == "cold (fallback)"
    (fallback,) = startup.fallbacks
    assert fallback["step"] == "ranks_agree" and "rank 1 could not restore" in fallback["reason"]
    assert "rank1.bin" in fallback["reason"] and ids == one_rank_answer
    validate_snapshot(snap, verify="full")  # rewritten whole by both ranks
    again, startup = _answer(snap, 2)
    assert startup.tier == "portable" and not startup.fallbacks and again == one_rank_answer


def test_another_rank_count_is_refused_at_validation(two_rank_snapshot, tiny_llama_dir, tmp_path):
    snap = shutil.copytree(two_rank_snapshot, tmp_path / "snap")
    ids, startup = _answer(snap, 1, tiny_llama_dir)
    (fallback,) = startup.fallbacks
    assert fallback["step"] == "validate" and "world_size" in fallback["reason"]
    assert read_manifest(snap)["compat"]["world_size"] == 1  # rewritten for one rank


def test_another_split_of_the_same_ranks_is_refused(two_rank_snapshot):
    manifest = read_manifest(two_rank_snapshot)
    config = InitConfig(tp_size=2)
    check_section(manifest["llm"], manifest["files"], config, 1, manifest["llm"]["parallel"])
    other = {"tp_size": 1, "ep_size": 2, "ep_dispatch": "replicated"}
    with pytest.raises(BadSnapshot, match=r"made for tp 2 x ep 1 .*this restore runs tp 1 x ep 2"):
        check_section(manifest["llm"], manifest["files"], config, 1, other)
    edited = json.loads(json.dumps(manifest["llm"]))
    edited["ranks"] = edited["ranks"][:1]
    with pytest.raises(BadSnapshot, match="ranks is not a list of 2 rank entries"):
        check_section(edited, manifest["files"], config, 1, manifest["llm"]["parallel"])


def test_a_process_snapshot_of_several_cuda_ranks_is_refused(tiny_llama_dir, tmp_path):
    from snapfn.handler.llm.recipes.process_ranks import init_process_ranks
    from snapfn.snapshot.errors import BadRequest

    config = InitConfig(device="cuda", tp_size=2, tier="process", cache_dir=tmp_path / "c")
    with pytest.raises(BadRequest, match="runs on CPU ranks only"):
        init_process_ranks(config, tiny_llama_dir, tmp_path / "snap", log=None)
    assert not (tmp_path / "snap").exists()


# ---- tier 1: a process image of each rank (real criu) ----------------------------------------
def _workers() -> set[int]:
    """The pids of process-snapshot workers running now."""
    found = set()
    for proc in Path("/proc").iterdir():
        try:
            if (
                proc.name.isdigit()
                and b"snapfn.snapshot.process.worker" in (proc / "cmdline").read_bytes()
            ):
                found.add(int(proc.name))
        except OSError:
            continue
    return found


@pytest.fixture(scope="module")
def two_rank_process_snapshot(tiny_llama_dir, tmp_path_factory, criu_config):
    dest = tmp_path_factory.mktemp("tp-process") / "snap"
    done = _init(tiny_llama_dir, dest, "--tp-size", "2", "--tier", "process")
    assert done.returncode == 0, done.stderr[-3000:]
    return dest


def test_a_process_image_of_each_rank_restores_with_its_communicators(
    two_rank_process_snapshot, one_rank_answer
):
    manifest = validate_snapshot(two_rank_process_snapshot, verify="full")
    assert manifest["tier"] == "process"
    assert [m["images"] for m in [manifest["process"], *manifest["process_ranks"]]] == [
        "process",
        "process-rank1",
    ]
    assert "close_communicators" in manifest["process"]["hooks"]
    before = _workers()
    ids, startup = _answer(two_rank_process_snapshot, 2)
    assert startup.tier == "process" and not startup.fallbacks, startup.fallbacks
    names = [s.name for s in startup.stages]
    assert names.index("worker.communicators") < names.index("worker.stream_weights")
    assert ids == one_rank_answer
    deadline = time.monotonic() + 20
    while _workers() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _workers() == before  # both ranks' workers stopped with the runtime


def test_a_bad_rank_image_falls_back_to_tier_0_on_every_rank(
    two_rank_process_snapshot, one_rank_answer, tmp_path
):
    snap = shutil.copytree(two_rank_process_snapshot, tmp_path / "snap")
    manifest = json.loads((snap / "manifest.json").read_text())
    manifest["process_ranks"][0]["inherit"]["ctl"] = "socket:[1]"  # rank 1's image only
    (snap / "manifest.json").write_text(json.dumps(manifest))
    ids, startup = _answer(snap, 2)
    assert startup.tier == "portable", startup.fallbacks
    (fallback,) = startup.fallbacks
    assert fallback["from"] == "process" and "rank 1" in fallback["reason"]
    assert ids == one_rank_answer


@pytest.mark.parametrize("tier", ["portable", "process"])
def test_generate_restores_a_snapshot_of_two_ranks(tier, request, one_rank_answer):
    fixture = "two_rank_snapshot" if tier == "portable" else "two_rank_process_snapshot"
    snap = request.getfixturevalue(fixture)
    argv = [sys.executable, "-m", "snapfn.handler.cli", "generate", "--snapshot", str(snap)]
    argv += ["--tp-size", "2", "--prompt-ids", "5,17,3,9,12", "--max-new-tokens", "8", "--json"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=_env(snap.parent))
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["token_ids"] == one_rank_answer
    assert f"({tier}) on cpu" in done.stderr


RANK_EDITS = {
    "rank 1's plan off by a page": lambda m: m["llm"]["ranks"][1]["memory_plan"].update(
        num_pages=m["llm"]["ranks"][1]["memory_plan"]["num_pages"] + 1
    ),
    "rank 1's entry a string": lambda m: m["llm"]["ranks"].__setitem__(1, "rank1"),
    "one rank entry": lambda m: m["llm"].update(ranks=m["llm"]["ranks"][:1]),
    "rank 1's layout rank 0's": lambda m: m["llm"]["ranks"][1].update(
        layout=m["llm"]["ranks"][0]["layout"]
    ),
    "rank1.bin unlisted": lambda m: m["files"].pop("weights/rank1.bin"),
}


@pytest.mark.parametrize("case", sorted(RANK_EDITS))
def test_an_edited_rank_entry_is_refused_on_every_rank(
    two_rank_snapshot, one_rank_answer, tmp_path, case
):
    snap = shutil.copytree(two_rank_snapshot, tmp_path / "snap")
    manifest = json.loads((snap / "manifest.json").read_text())
    RANK_EDITS[case](manifest)
    (snap / "manifest.json").write_text(json.dumps(manifest))
    if case in NO_RECORDED_SOURCE:  # a rank's content hash went with its entry
        with pytest.raises(AssertionError, match="rank 1: its manifest records no content hash"):
            _answer(snap, 2)
        return
    ids, startup = _answer(snap, 2)
    assert startup.tier == "cold (fallback)", startup.fallbacks
    assert startup.fallbacks[0]["to"] == "cold" and ids == one_rank_answer


NO_RECORDED_SOURCE = {"rank 1's entry a string", "one rank entry"}


def test_an_edited_rank_entry_with_the_model_named_falls_back_on_every_rank(
    two_rank_snapshot, one_rank_answer, tiny_llama_dir, tmp_path
):
    snap = shutil.copytree(two_rank_snapshot, tmp_path / "snap")
    manifest = json.loads((snap / "manifest.json").read_text())
    RANK_EDITS["one rank entry"](manifest)
    (snap / "manifest.json").write_text(json.dumps(manifest))
    ids, startup = _answer(snap, 2, tiny_llama_dir)
    assert startup.tier == "cold (fallback)" and ids == one_rank_answer


def test_inspect_names_the_ranks_and_their_images(two_rank_process_snapshot):
    from snapfn.handler.llm.recipes.cli import format_table, load_startup

    text = format_table(*load_startup(two_rank_process_snapshot))
    assert "ranks: tp 2 x ep 1 (replicated), each its own weights: weights/rank0.bin, " in text
    assert "a process image per rank: process, process-rank1" in text
    assert "restore chain here: tier 1 (process image)" in text
