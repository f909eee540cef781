"""Kernel tuning (handler/llm/kernels/triton/tuning.py): which config an autotuned kernel runs.

The choice order (pinned, shipped, tuned or default), the tables' format, and the refusals run
here in-process; `TunedKernel` itself runs under triton's interpreter in a subprocess, where
a probe kernel writes the block size it ran with, so the choice is what the kernel did."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from snapfn.handler.llm.kernels.triton import tuning
from snapfn.snapshot.errors import BadRequest, BadSnapshot

IDS = ["BLOCK=16,w4,s3", "BLOCK=32,w4,s3", "BLOCK=64,w4,s3"]


@pytest.fixture(autouse=True)
def fresh_state():
    tuning.use_tuning(tuning.KernelTuning())
    tuning.forget_choices()
    yield
    tuning.use_tuning(tuning.KernelTuning())
    tuning.forget_choices()


def test_config_id_names_values_in_order_then_warps_and_stages():
    assert tuning.config_id({"BLOCK_N": 8, "BLOCK_K": 512}, 4, 3) == "BLOCK_K=512,BLOCK_N=8,w4,s3"
    assert tuning.config_id({}, 2, 1) == "w2,s1"
    assert tuning.gpu_slug("NVIDIA H200") == "nvidia-h200"
    assert tuning.gpu_slug("NVIDIA GeForce RTX 4090 (laptop)") == "nvidia-geforce-rtx-4090-laptop"


def test_default_mode_takes_the_first_config_and_times_nothing():
    assert tuning.choose("_probe", "(64,)", IDS, "cpu") == (IDS[0], "default")


def test_init_mode_asks_for_timing():
    tuning.use_tuning(tuning.KernelTuning("init"))
    assert tuning.choose("_probe", "(64,)", IDS, "cpu") == (None, "tuned")


def test_a_table_file_is_used_for_its_keys_and_a_pin_wins_over_it(tmp_path):
    table = tmp_path / "t.json"
    tuning.write_table(table, [{"kernel": "_probe", "key": "(64,)", "config": IDS[2]}], {})
    tuning.use_tuning(tuning.KernelTuning("shipped", (table,)))
    assert tuning.choose("_probe", "(64,)", IDS, "cpu") == (IDS[2], "shipped")
    assert tuning.choose("_probe", "(128,)", IDS, "cpu") == (IDS[0], "default")
    tuning.pin_choices([{"kernel": "_probe", "key": "(64,)", "config": IDS[1]}])
    assert tuning.choose("_probe", "(64,)", IDS, "cpu") == (IDS[1], "pinned")


def test_init_mode_times_what_a_table_has_but_keeps_a_pin(tmp_path):
    table = tmp_path / "t.json"
    tuning.write_table(table, [{"kernel": "_probe", "key": "(64,)", "config": IDS[2]}], {})
    tuning.use_tuning(tuning.KernelTuning("init", (table,)))
    assert tuning.choose("_probe", "(64,)", IDS, "cpu") == (None, "tuned")
    tuning.pin_choices([{"kernel": "_probe", "key": "(64,)", "config": IDS[1]}])
    assert tuning.choose("_probe", "(64,)", IDS, "cpu") == (IDS[1], "pinned")


def test_a_shipped_config_the_pruning_dropped_falls_to_the_default(tmp_path):
    table = tmp_path / "t.json"
    tuning.write_table(table, [{"kernel": "_probe", "key": "(64,)", "config": IDS[2]}], {})
    tuning.use_tuning(tuning.KernelTuning("shipped", (table,)))
    assert tuning.choose("_probe", "(64,)", IDS[:2], "cpu") == (IDS[0], "default")


def test_a_pin_naming_an_undeclared_config_is_refused():
    tuning.pin_choices([{"kernel": "_probe", "key": "(64,)", "config": "BLOCK=4096,w32,s9"}])
    with pytest.raises(BadSnapshot, match="is not one of its configs"):
        tuning.choose("_probe", "(64,)", IDS, "cpu")


def test_write_table_merges_and_the_new_choice_wins(tmp_path):
    table = tmp_path / "t.json"
    first = [
        {"kernel": "_probe", "key": "(64,)", "config": IDS[0]},
        {"kernel": "_probe", "key": "(128,)", "config": IDS[1]},
    ]
    assert tuning.write_table(table, first, {"gpu": "cpu"}) == 2
    again = [{"kernel": "_probe", "key": "(64,)", "config": IDS[2]}]
    assert tuning.write_table(table, again, {"gpu": "cpu"}) == 2
    data = json.loads(table.read_text())
    assert data["gpu"] == "cpu"
    assert data["kernels"] == {"_probe": {"(128,)": IDS[1], "(64,)": IDS[2]}}


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        "[]",
        '{"kernels": []}',
        '{"kernels": {"_probe": {"(64,)": 4}}}',
        '{"kernels": {"bad name": {"(64,)": "w4,s3"}}}',
        '{"gpu": "x"}',
    ],
)
def test_a_table_that_is_not_one_is_refused_naming_the_file(tmp_path, text):
    table = tmp_path / "t.json"
    table.write_text(text)
    with pytest.raises(BadRequest, match="t.json: not a table of kernel configs"):
        tuning.read_table(table)


def test_the_mode_comes_from_the_environment_and_a_wrong_one_is_refused(tmp_path):
    got = tuning.KernelTuning.from_env({"SNAPFN_TUNED_CONFIGS": f"{tmp_path}/a.json:b.json"})
    assert got.mode == "shipped" and [p.name for p in got.table_files] == ["a.json", "b.json"]
    assert tuning.KernelTuning.from_env({"SNAPFN_KERNEL_TUNING": "init"}).times_configs
    with pytest.raises(BadRequest, match="SNAPFN_KERNEL_TUNING must be one of shipped, init"):
        tuning.KernelTuning.from_env({"SNAPFN_KERNEL_TUNING": "always"})


def test_choices_are_recorded_and_counted():
    tuning.record("_probe", "(64,)", IDS[0], "default")
    tuning.record("_probe", "(128,)", IDS[1], "pinned")
    assert tuning.choice_counts() == {"pinned": 1, "default": 1}
    assert [c["key"] for c in tuning.recorded_choices()] == ["(128,)", "(64,)"]
    assert tuning.parse_choices(tuning.recorded_choices())[0] == {
        "kernel": "_probe",
        "key": "(128,)",
        "config": IDS[1],
    }


INTERPRETED = textwrap.dedent(
    """
    import json, sys
    import torch, triton, triton.language as tl
    from snapfn.handler.llm.kernels.triton import tuning
    from snapfn.handler.llm.kernels.triton.kernels import autotuned

    @triton.jit
    def _probe_kernel(out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, tl.full([BLOCK], BLOCK, tl.int32), mask=offs < n)

    configs = [triton.Config({"BLOCK": b}, num_warps=4, num_stages=3) for b in (16, 32, 64)]
    probe = autotuned(_probe_kernel, configs, key=["n"], default=1)

    def ran(n):
        out = torch.zeros(8, dtype=torch.int32)
        probe[(1,)](out, n)
        return int(out[0])

    table = sys.argv[1]
    tuning.use_tuning(tuning.KernelTuning("shipped", (table,)))
    tuning.pin_choices([{"kernel": "_probe_kernel", "key": "(6, 'torch.int32')",
                         "config": "BLOCK=16,w4,s3"}])
    runs = {"default": ran(8), "shipped": ran(7), "pinned": ran(6), "again": ran(8)}
    tuning.pin_choices([{"kernel": "_probe_kernel", "key": "(5, 'torch.int32')",
                         "config": "BLOCK=128,w4,s3"}])
    try:
        ran(5)
        runs["refused"] = None
    except Exception as exc:
        runs["refused"] = type(exc).__name__
    print(json.dumps({"runs": runs, "choices": tuning.recorded_choices()}))
    """
)


def test_the_interpreted_kernel_runs_the_chosen_config(tmp_path):
    table = tmp_path / "t.json"
    shipped = [{"kernel": "_probe_kernel", "key": "(7, 'torch.int32')", "config": IDS[2]}]
    tuning.write_table(table, shipped, {})
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", INTERPRETED, str(table)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    # the default is configs[1] (32), the table says 64 for n=7, the pin 16 for n=6
    assert got["runs"] == {
        "default": 32,
        "shipped": 64,
        "pinned": 16,
        "again": 32,
        "refused": "BadSnapshot",
    }
    sources = {c["key"]: c["source"] for c in got["choices"]}
    assert sources == {
        "(8, 'torch.int32')": "default",
        "(7, 'torch.int32')": "shipped",
        "(6, 'torch.int32')": "pinned",
    }


def test_a_snapshot_carries_the_inits_choices_and_a_restore_pins_them(
    llama_with_tokenizer, tmp_path
):
    """On CPU no kernel chooses anything; the choices a CUDA init would have recorded are
    recorded by hand, so what travels is what the section writes and the restore reads."""
    from snapfn.handler.llm.init_config import InitConfig
    from snapfn.handler.llm.recipes.function import LLMFunction
    from snapfn.snapshot.portable.format import read_manifest
    from snapfn.snapshot.runtime import init_and_snapshot, restore

    def make() -> LLMFunction:
        config = InitConfig(
            page_size=4,
            max_num_batched_tokens=64,
            kv_cache_bytes_cpu=1 << 20,
            cache_dir=tmp_path / "cache",
        )
        return LLMFunction(config, llama_with_tokenizer)

    tuning.record("_gemv_kernel", "(4096, 14336)", "BLOCK_K=512,BLOCK_N=8,w4,s1", "shipped")
    tuning.record("_rms_norm_kernel", "(4096, False)", "w4,s3", "default")
    startup = init_and_snapshot(make(), tmp_path / "snap", log=None)
    assert startup.stage("health_check").figures["kernel_choices"] == {"shipped": 1, "default": 1}
    section = read_manifest(tmp_path / "snap")["llm"]
    assert [c["kernel"] for c in section["kernel_choices"]] == ["_gemv_kernel", "_rms_norm_kernel"]
    tuning.forget_choices()
    _, restored = restore(make, tmp_path / "snap", log=None)
    assert restored.tier == "portable"
    assert restored.stage("restore_caches").figures["pinned_kernel_choices"] == 2
    assert tuning.choose("_rms_norm_kernel", "(4096, False)", ["w1,s3", "w4,s3"], "x") == (
        "w4,s3",
        "pinned",
    )
