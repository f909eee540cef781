"""`snapfn bench` on CPU: every mode runs in its own process and agrees on the first token."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest


@pytest.mark.slow
def test_bench_modes_agree_and_report_floors(llama_with_tokenizer, tmp_path):
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable,
        "-m",
        "snapfn.handler.cli",
        "bench",
        "--model",
        str(llama_with_tokenizer),
        "--workdir",
        str(tmp_path / "work"),
        "--out",
        str(out),
        "--plot",
        str(tmp_path / "w.png"),
        "--modes",
        "safetensors,cold_init,restore,restore_zygote,restore_drifted,restore_cold_snapshot",
        "--decode-batches",
        "1",
        "--decode-tokens",
        "4",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    modes = report["modes"]
    cold = modes.pop("restore_cold_snapshot")  # the snapshot's files dropped, nothing else
    if "skipped" in cold:  # a file system that keeps its pages (tmpfs, some overlays)
        assert cold["skipped"] == "the page cache could not be dropped on this machine"
    else:
        assert cold["token"] == modes["cold_init"]["token"] and not cold["fallbacks"]
        assert cold["logprob"] == modes["cold_init"]["logprob"]
        assert report["ratios"]["restore_cold_snapshot_first_token_vs_disk_floor"] > 0
    assert set(modes) == {
        "safetensors",
        "cold_init",
        "restore",
        "restore_zygote",
        "restore_drifted",
    }
    tokens = {m: r["token"] for m, r in modes.items()}
    assert len(set(tokens.values())) == 1, tokens  # same first token whichever way it started
    assert modes["restore"]["logprob"] == modes["cold_init"]["logprob"]
    for mode in ("restore", "restore_zygote"):
        assert modes[mode]["startup"]["kind"] == "restore" and not modes[mode]["fallbacks"]
    drifted = modes["restore_drifted"]  # another GPU, driver and torch: tier 0 without caches
    assert drifted["logprob"] == modes["cold_init"]["logprob"]
    assert [f["to"] for f in drifted["fallbacks"]] == ["portable, caches dropped"]
    stages = {s["name"]: s for s in drifted["startup"]["stages"]}
    assert stages["validate"]["figures"]["caches"].startswith("dropped: ")
    assert (
        json.loads((tmp_path / "work" / "snapshot" / "manifest.json").read_text())["compat"][
            "torch"
        ]
        != "0.0.1"
    )  # the copy's edit left the snapshot itself alone
    assert report["floors"]["weight_bytes"] > 0 and report["floors"]["disk_floor_s"] > 0
    assert modes["cold_init"]["decode"]["batch1_ms_per_step"] > 0
    assert (tmp_path / "w.png").stat().st_size > 0
    assert "restore_zygote" in proc.stdout


@pytest.mark.slow
@pytest.mark.usefixtures("criu_config")
def test_tier1_from_a_fresh_process_and_from_a_zygote_give_the_cold_init_token(
    llama_with_tokenizer, tmp_path
):
    """Both tier-1 modes restore the same process image; the zygote's child starts its restore
    with the restore's modules imported already (ZYGOTE_PRELOAD)."""
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "snapfn.handler.cli", "bench", "--model"]
    cmd += [str(llama_with_tokenizer), "--workdir", str(tmp_path / "work"), "--out", str(out)]
    cmd += ["--modes", "cold_init,init_process,restore_process,restore_process_zygote"]
    cmd += ["--decode-batches", "1", "--decode-tokens", "4"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    modes = report["modes"]
    for mode in ("restore_process", "restore_process_zygote"):
        assert modes[mode]["startup"]["tier"] == "process", modes[mode]
        assert not modes[mode]["startup"]["fallbacks"]
        assert report["ratios"][f"{mode}_token_equals_cold_init"] is True
        assert modes[mode]["torch_imported"] is (mode == "restore_process_zygote")
    assert modes["restore_process_zygote"]["zygote_preload_s"] > 0
    assert "restore_process_zygote" in proc.stdout


def test_a_zygote_mode_that_fails_says_why(tmp_path):
    """A restore forked from the zygote reports its exception's line, as a fresh process's."""
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "snapfn.handler.cli", "bench", "--workdir", str(tmp_path)]
    cmd += ["--modes", "restore_process_zygote", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    error = json.loads(out.read_text())["modes"]["restore_process_zygote"]["error"]
    assert error.startswith("snapfn.snapshot.process.snapshot.ProcessRestoreFailed: ")
    assert "no snapshot directory there" in error


def test_steady_mode_reports_decode_and_prefill_beside_their_rooflines(llama_with_tokenizer):
    from snapfn.handler.llm.bench.child import MODES, parse_args
    from snapfn.handler.llm.bench.cli import format_report

    args = parse_args(
        ["steady", "--model", str(llama_with_tokenizer), "--t0", "0", "--decode-batches", "1,4"]
        + ["--decode-tokens", "4", "--prefill-tokens", "64"]
    )
    result = {"mode": "steady", **MODES["steady"](args)}
    assert set(result["decode"]) == {"batch1", "batch4"}
    for figures in result["decode"].values():
        # the roofline is the same weight bytes over the measured bandwidth at every batch size
        assert figures["roofline_ms"] == result["decode"]["batch1"]["roofline_ms"] > 0
        # both figures are rounded to 3 decimals: a tiny model's roofline loses digits there
        slack = 0.02 + 0.0005 / figures["roofline_ms"] + 0.0005 / max(figures["ms"], 1e-3)
        assert figures["x"] == pytest.approx(figures["ms"] / figures["roofline_ms"], rel=slack)
    prefill = result["prefill"]
    assert prefill["tokens"] == 64 and prefill["tokens_per_s"] > 0
    ratio = prefill["roofline_tokens_per_s"] / prefill["tokens_per_s"]
    assert prefill["x"] == pytest.approx(ratio, rel=0.02)
    assert result["memory_gbps"] > 0 and result["matmul_tflops"] > 0
    assert result["backend"] == "torch"
    # no graphs on CPU: the short prompts' eager figures alone
    assert [f["tokens"] for f in result["short_prefill"]] == [8, 32, 64]
    assert all(f["eager_ms"] > 0 and "rows_ms" not in f for f in result["short_prefill"])
    report = {
        "model": "m",
        "device": "cpu",
        "machine": "x",
        "floors": {},
        "modes": {"steady": result},
        "ratios": {},
    }
    assert "roofline" in format_report(report)
    assert "short prompt, one token: 8 tok " in format_report(report)


def test_decode_batches_are_distinct_prompts_within_the_vocabulary():
    from snapfn.handler.llm.bench.child import PROMPT_IDS, distinct_prompts

    prompts = distinct_prompts(32, vocab=1000)
    assert len({tuple(p) for p in prompts}) == 32  # every row its own: MoE rows route apart
    assert all(len(p) == len(PROMPT_IDS) and min(p) >= 0 and max(p) < 1000 for p in prompts)
    assert prompts[0] == PROMPT_IDS


def test_ms_per_step_is_the_difference_and_never_zero_when_noise_swamps_it(capsys):
    from snapfn.handler.llm.bench.child import _ms_per_step

    # 8 tokens in 0.9 s, 4 in 0.5 s: 4 steady steps took 0.4 s
    assert _ms_per_step(lambda n: {8: 0.9, 4: 0.5}[n], 4) == pytest.approx(100.0)
    assert capsys.readouterr().err == ""
    # noise: the long generation was no slower than the short one (a CI run once reported 0.0)
    assert _ms_per_step(lambda n: 0.4, 4) == pytest.approx(0.4 / 8 * 1e3)
    assert "timing noise" in capsys.readouterr().err


def test_each_restore_is_reported_against_its_floor():
    from snapfn.handler.llm.bench.cli import floor_ratios

    results = {
        "restore": {"first_token_s": 3.0},
        "restore_process": {"first_token_s": 0.6},
        "restore_process_zygote": {"first_token_s": 0.45},
        "restore_cold": {"first_token_s": 12.0},
        "restore_cold_snapshot": {"first_token_s": 11.0},
        "cold_init": {"first_token_s": 40.0},
    }
    floors = {"h2d_floor_s": 0.3, "disk_floor_s": 10.0}
    assert floor_ratios(results, floors) == {
        "restore_first_token_vs_h2d_floor": 10.0,
        "restore_process_first_token_vs_h2d_floor": 2.0,
        "restore_process_zygote_first_token_vs_h2d_floor": 1.5,
        "restore_cold_first_token_vs_disk_floor": 1.2,
        "restore_cold_snapshot_first_token_vs_disk_floor": 1.1,
    }
    assert floor_ratios(results, {}) == {}


def _stream_stages(wait_s: float, own_s: float, overlapped: bool) -> dict[str, Any]:
    stream = {"name": "stream_weights", "seconds": wait_s}
    stream["figures"] = {"elapsed_s": own_s, "gbps": round(16.2 / own_s, 1)}
    beside = [{"name": "start_stream", "seconds": 0.02, "figures": {}}] if overlapped else []
    return {"startup": {"stages": [*beside, stream]}, "first_token_s": 1.0}


def test_the_weights_stream_is_its_own_seconds_and_the_join_its_wait():
    from snapfn.handler.llm.bench.cli import format_report, ratios

    results = {
        "restore": _stream_stages(wait_s=0.0001, own_s=0.334, overlapped=True),
        "restore_cold": _stream_stages(wait_s=2.5, own_s=2.4, overlapped=False),
    }
    floors = {"weight_bytes": 16_200_000_000, "h2d_gbps": 55.0, "disk_gbps": 1.5}
    floors |= {"h2d_floor_s": 0.167, "disk_floor_s": 1.2}
    got = ratios(results, floors)
    assert got["restore_stream_vs_h2d_floor"] == 2.0
    assert got["restore_cold_stream_vs_disk_floor"] == 2.0
    report = {"model": "m", "device": "cuda", "machine": "x", "floors": floors, "modes": results}
    table = format_report({**report, "ratios": got})
    assert "stream 0.334 s (48.5 GB/s), waited 0.000 s" in table
    assert "stream 2.400 s (6.8 GB/s)" in table and table.count("waited") == 1


def test_a_plot_no_mode_can_fill_says_why_it_was_not_written(tmp_path, capsys):
    import argparse

    from snapfn.handler.llm.bench.cli import _write_outputs

    plot = tmp_path / "waterfall.png"
    report = {"model": "m", "modes": {"steady": {"mode": "steady", "decode": {}}}}
    _write_outputs(argparse.Namespace(out=None, plot=plot), report)
    assert not plot.exists()
    assert f"snapfn bench: {plot} not written: no mode of this run" in capsys.readouterr().err


def test_a_restore_mode_with_no_snapshot_to_restore_says_what_to_add(tmp_path, capsys):
    from snapfn.handler.cli import main

    out = tmp_path / "bench.json"
    argv = ["bench", "--modes", "restore_drifted,restore_s3", "--workdir", str(tmp_path)]
    assert main(argv + ["--out", str(out)]) == 0
    modes = json.loads(out.read_text())["modes"]
    for mode in ("restore_drifted", "restore_s3"):
        assert modes[mode]["skipped"] == (
            "no snapshot in the workdir: add cold_init to --modes, before this mode"
        )
    assert "add cold_init to --modes" in capsys.readouterr().out


def test_the_prefix_mode_times_a_hit_against_a_miss(tmp_path):
    out = tmp_path / "prefix.json"
    done = subprocess.run(
        [sys.executable, "-m", "snapfn.handler.cli", "bench", "--modes", "prefix"]
        + ["--workdir", str(tmp_path / "work"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())["modes"]["prefix"]
    assert result["hit_tokens_equal_miss_tokens"] is True
    # every hit found the shared prefix's full pages (the embedded model's pages: 16 tokens)
    assert all(t == result["prefix_tokens"] // 16 * 16 for t in result["hit_cached_tokens"])
    assert result["miss_cached_tokens"] == [0] * len(result["miss_cached_tokens"])


def test_the_mtp_mode_times_each_draft_count_and_drafts_of_known_acceptance(tmp_path):
    model = tmp_path / "glm"
    made = subprocess.run(
        [sys.executable, "-m", "snapfn.handler.cli", "make-model", "--preset", "glm-tiny"]
        + ["--out", str(model)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert made.returncode == 0, made.stderr[-2000:]
    out = tmp_path / "mtp.json"
    done = subprocess.run(
        [sys.executable, "-m", "snapfn.handler.cli", "bench", "--model", str(model)]
        + ["--modes", "mtp", "--decode-tokens", "16", "--workdir", str(tmp_path / "work")]
        + ["--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())["modes"]["mtp"]
    runs = {**result["by_k"], **result["known"]}
    assert all(run["tokens_equal_k0"] for run in runs.values())  # greedy: plain decode's tokens
    assert set(result["by_k"]) == {"k0", "k1", "k2", "k3"} and result["graphs"] is False
    assert all(run["tokens_equal_own"] for run in result["known"].values())
    assert result["k0_batch4_first_difference"] is None  # float32 on CPU: the same bits
    right, half = result["known"]["k3_wrong_0.0"], result["known"]["k3_wrong_0.5"]
    assert right["acceptance_rate"] == 1.0 and right["tokens_per_step"] > 3
    assert (
        0 < half["acceptance_rate"] < 1 and 1 < half["tokens_per_step"] < right["tokens_per_step"]
    )
