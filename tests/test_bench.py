"""`snapfn bench` on CPU: every mode runs in its own process and agrees on the first token."""

from __future__ import annotations

import json
import subprocess
import sys

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
        "safetensors,cold_init,restore,restore_zygote",
        "--decode-batches",
        "1",
        "--decode-tokens",
        "4",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    modes = report["modes"]
    assert set(modes) == {"safetensors", "cold_init", "restore", "restore_zygote"}
    tokens = {m: r["token"] for m, r in modes.items()}
    assert len(set(tokens.values())) == 1, tokens  # same first token whichever way it started
    assert modes["restore"]["logprob"] == modes["cold_init"]["logprob"]
    for mode in ("restore", "restore_zygote"):
        assert modes[mode]["startup"]["kind"] == "restore" and not modes[mode]["fallbacks"]
    assert report["floors"]["weight_bytes"] > 0 and report["floors"]["disk_floor_s"] > 0
    assert modes["cold_init"]["decode"]["batch1_ms_per_step"] > 0
    assert (tmp_path / "w.png").stat().st_size > 0
    assert "restore_zygote" in proc.stdout
