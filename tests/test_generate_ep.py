"""`snapfn generate --ep-size 2` under torchrun: two CPU processes over gloo, each holding half
of glm-tiny's routed experts, print what one process holding them all prints, with either
exchange; launched without torchrun's environment, or with a mismatched world, it is refused
with the command to run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from snapfn.handler.cli import main
from snapfn.handler.llm.make_model.build import make_model

ARGS = ["--prompt-ids", "5,17,3,9,12", "--max-new-tokens", "6", "--ignore-eos", "--json"]
ARGS += ["--dtype", "float32"]


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory):
    return make_model("glm-tiny", tmp_path_factory.mktemp("ep-cli") / "glm", dtype="bf16", seed=11)


@pytest.fixture(scope="module")
def one_rank(glm_dir):
    out = subprocess.run(
        [sys.executable, "-m", "snapfn.handler.cli", "generate", "--model", str(glm_dir), *ARGS],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("dispatch", ["replicated", "all_to_all"])
def test_two_ranks_under_torchrun_print_what_one_rank_prints(glm_dir, one_rank, dispatch):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    argv = ["--nproc-per-node", "2", "-m", "snapfn.handler.cli", "generate"]
    argv += ["--model", str(glm_dir), "--ep-size", "2", "--ep-dispatch", dispatch, *ARGS]
    out = subprocess.run([*torchrun, *argv], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, out.stdout  # rank 0 alone prints
    got = json.loads(lines[0])
    assert got["token_ids"] == one_rank["token_ids"]
    assert got["logprobs"] == pytest.approx(
        one_rank["logprobs"], abs=1e-4
    )  # summed in another order
    assert f"(ep 2, {dispatch})" in out.stderr
    for rank, held in ((0, "0-3"), (1, "4-7")):  # glm-tiny: 8 routed experts a layer
        assert f"ep rank {rank} of 2: routed experts {held} of each MoE layer's 8" in out.stderr


def test_a_model_without_experts_is_refused_on_every_rank():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    argv = ["--nproc-per-node", "2", "-m", "snapfn.handler.cli", "generate", "--ep-size", "2"]
    out = subprocess.run(
        [*torchrun, *argv, "--prompt-ids", "1,2"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode != 0
    assert out.stderr.count("has no routed experts to split") == 2, out.stderr[-3000:]


def test_a_world_of_another_size_is_refused(capsys, monkeypatch, glm_dir):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert main(["generate", "--model", str(glm_dir), "--ep-size", "2", *ARGS]) == 2
    assert "--ep-size 2 needs 2 ranks but WORLD_SIZE=4" in capsys.readouterr().err


def test_a_snapshot_of_ranks_under_torchrun_is_refused(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = ["generate", "--snapshot", str(tmp_path / "snap"), "--ep-size", "2", *ARGS]
    assert main(argv) == 2
    assert "--snapshot with --tp-size/--ep-size under torchrun" in capsys.readouterr().err
