"""The runtime under failure: a killed `snapfn init` never leaves a snapshot that looks valid."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from snapfn.snapshot.errors import SnapfnError
from snapfn.snapshot.portable.format import validate_snapshot


def init_cmd(model_dir, snap, cache):
    return [
        sys.executable,
        "-m",
        "snapfn.handler.cli",
        "init",
        "--model",
        str(model_dir),
        "--snapshot",
        str(snap),
        "--cache-dir",
        str(cache),
        "--max-num-batched-tokens",
        "64",
    ]


@pytest.mark.slow
def test_killed_init_never_leaves_a_valid_looking_partial_snapshot(llama_with_tokenizer, tmp_path):
    snap, cache = tmp_path / "snap", tmp_path / "cache"
    t0 = time.perf_counter()
    subprocess.run(init_cmd(llama_with_tokenizer, snap, cache), check=True, capture_output=True)
    full_s = time.perf_counter() - t0
    reference = validate_snapshot(snap, None, verify="full")
    for i, fraction in enumerate((0.5, 0.65, 0.8, 0.95)):
        target = tmp_path / f"killed{i}"
        proc = subprocess.Popen(
            init_cmd(llama_with_tokenizer, target, cache),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(full_s * fraction)  # spread the kills over init and publish (import is ~half)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if target.exists():  # only a complete snapshot may be visible
            manifest = validate_snapshot(target, None, verify="full")
            assert manifest["files"].keys() == reference["files"].keys()
        leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(f".killed{i}")]
        if leftovers:  # a crashed writer's temp dir: never valid, removed by the next writer
            with pytest.raises(SnapfnError):
                validate_snapshot(tmp_path / leftovers[0], None)
            subprocess.run(
                init_cmd(llama_with_tokenizer, target, cache), check=True, capture_output=True
            )
            assert not [p for p in tmp_path.iterdir() if p.name.startswith(f".killed{i}.tmp")]
            validate_snapshot(target, None, verify="full")
    assert os.listdir(snap)
