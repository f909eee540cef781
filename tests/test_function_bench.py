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
    argv += ["--workdir", str(tmp_path / "work"), "--out", str(out)]
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
