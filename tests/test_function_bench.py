"""handler/function/bench.py: `snapfn bench --function` runs a function's cold start and both
restores side by side, each in a fresh process, and says whether they answered the same bits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.usefixtures("criu_config")
def test_function_bench_reports_each_mode_against_the_cold_start(tmp_path):
    out = tmp_path / "bench.json"
    argv = [sys.executable, "-m", "snapfn.handler.cli", "bench", "--device", "cpu"]
    argv += ["--function", "examples.cuda_graph:handler", "--event", '{"seed": 4}']
    argv += ["--workdir", str(tmp_path / "work"), "--out", str(out), "--concurrency", "1,2,4"]
    done = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    modes = report["modes"]
    assert set(modes) == {"cold", "restore_portable", "restore_process"}
    assert modes["cold"]["startup"]["tier"] == "cold"
    assert modes["restore_portable"]["startup"]["tier"] == "portable"
    assert modes["restore_process"]["startup"]["tier"] == "process"
    for r in modes.values():
        assert 0 < r["ready_s"] <= r["first_answer_s"], r
    assert report["ratios"]["answers_equal"] is True
    assert report["event"] == {"seed": 4} and report["snapshot"]["tier"] == "process"
    assert "restore_process_speedup_vs_cold" in report["ratios"]
    assert "restore_process" in done.stdout and "answers_equal: True" in done.stdout
    concurrent = report["concurrent"]  # one image restored 1, 2 and 4 times at once
    assert sorted(concurrent) == ["1", "2", "4"]
    for n, c in concurrent.items():
        assert c["tiers"] == ["process"] * int(n) and c["answers_equal"] is True, c
        assert all(0 < f <= c["slowest_s"] for f in c["first_answer_s"])
    assert "4 restores at once" in done.stdout


def child(code: str) -> list[str]:
    return [sys.executable, "-c", code]


@pytest.mark.parametrize(
    ("code", "says"),
    [
        (
            "raise ValueError('the snapshot holds no image')",
            "ValueError: the snapshot holds no image",
        ),
        (
            'import sys; print(\'BENCH_ERROR {"error": "tier 1 refused: no criu"}\'); sys.exit(1)',
            "tier 1 refused: no criu",
        ),
        ("import sys; sys.exit('cold: no model here')", "cold: no model here"),
        ("import os; os._exit(9)", "no output"),
        ("print('BENCH_RESULT {not json')", "not JSON"),
    ],
)
def test_a_failed_mode_has_a_one_line_reason(code, says):
    from snapfn.handler.function.bench import run_mode_process

    result = run_mode_process("cold", child(code), timeout_s=60)
    assert says in result["error"] and "\n" not in result["error"]
    assert "?" not in result["error"]


def test_a_mode_past_its_timeout_says_so():
    from snapfn.handler.function.bench import run_mode_process

    result = run_mode_process("restore", child("import time; time.sleep(30)"), timeout_s=0.5)
    assert result == {"mode": "restore", "error": "no result within --timeout-s 0.5 s"}


def test_the_report_shows_the_reason():
    from snapfn.handler.llm.bench.cli import _brief, format_report

    failed = {"mode": "restore", "error": "BadSnapshot: chunk 3 (exit 1)"}
    report = {
        "model": "m",
        "device": "cpu",
        "machine": "x",
        "floors": {},
        "modes": {"restore": failed, "steady": {"mode": "steady"}},
        "ratios": {},
    }
    assert "BadSnapshot: chunk 3 (exit 1)" in format_report(report)
    assert "?" not in _brief({"mode": "steady"}) and _brief(failed) == failed["error"]


def test_keeper_runs_by_default_on_cuda_only_and_as_asked():
    from argparse import Namespace

    from snapfn.handler.function.bench import keeper_hold

    assert keeper_hold(Namespace(keeper="auto", device="cuda:0")) == "page-cache"
    assert keeper_hold(Namespace(keeper="auto", device="cpu")) is None
    assert keeper_hold(Namespace(keeper="copy", device="cuda")) == "copy"
    assert keeper_hold(Namespace(keeper="none", device="cuda")) is None


def test_a_keeper_that_cannot_start_stops_the_bench_with_its_reason(tmp_path):
    from snapfn.handler.function.bench import running_keeper

    (tmp_path / "snapshot").mkdir()  # no manifest: the keeper refuses it and exits
    keeper = running_keeper("page-cache", tmp_path / "snapshot", tmp_path / "keeper", 60)
    with pytest.raises(SystemExit, match="the keeper did not start: .*manifest"), keeper:
        pass
    assert (tmp_path / "keeper").stat().st_mode & 0o777 == 0o700
