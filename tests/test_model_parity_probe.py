"""bench/probes/model_parity.py, the benchmark models' whole-model check on the GPU, run here
on the embedded model with the torch backend on both sides: it must pass a faithful run and
catch a wrong token or logprob."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "probes"))
import model_parity  # noqa: E402

from snapfn.handler.llm.embedded import embedded_model_dir  # noqa: E402


def test_a_faithful_run_passes(capsys):
    argv = [str(embedded_model_dir()), "--backend", "torch", "--graphs", "", "--device", "cpu"]
    assert model_parity.main([*argv, "--prompts", "2", "--new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert '"ok": true' in out and '"positions": 12' in out and '"exact": 12' in out


@pytest.fixture(scope="module")
def run():
    """The reference engine, prompts, and its own greedy tokens and logprobs."""
    import argparse

    args = argparse.Namespace(model=str(embedded_model_dir()), dtype="auto", device="cpu")
    ref = model_parity.engine(args, "torch", "auto")
    prompts = [[5, 9, 200, 31, 7], [44, 2, 18]]
    params = model_parity.SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
    results = ref.generate([list(p) for p in prompts], [params] * 2)
    tokens = [list(r.token_ids) for r in results]
    logprobs = [list(r.logprobs) for r in results]
    return ref, prompts, tokens, logprobs


def test_a_bf16_run_against_a_float32_reference_reports_its_rounding(capsys):
    argv = [str(embedded_model_dir()), "--backend", "torch", "--graphs", "", "--device", "cpu"]
    argv += ["--prompts", "1", "--new-tokens", "4", "--dtype", "bfloat16"]
    argv += ["--ref-dtype", "float32", "--tie", "10", "--logprob-atol", "10"]
    assert model_parity.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["dtype"], out["ref_dtype"]) == ("bfloat16", "float32")
    assert 0 < out["largest_logprob_diff"] < 1  # bf16 rounding: not zero, not wild


def test_compare_agrees_with_the_engine_itself(run):
    ref, prompts, tokens, logprobs = run
    report = model_parity.compare(ref, prompts, tokens, logprobs, tie=0.05, logprob_atol=1e-3)
    assert report["failures"] == [] and report["exact"] == report["positions"] == 10


def test_compare_catches_a_wrong_token_and_logprob(run):
    ref, prompts, tokens, logprobs = run
    tokens = [list(t) for t in tokens]
    logprobs = [list(lp) for lp in logprobs]
    logits = model_parity.prefill_logits(ref, prompts[1] + tokens[1][:4])[-1]
    tokens[1][4] = int(logits.argmin())  # the reference's least likely token at the last step
    logprobs[0][3] -= 0.5
    report = model_parity.compare(ref, prompts, tokens, logprobs, tie=0.05, logprob_atol=0.1)
    where = sorted(f.split(":")[0] + (" token" if "nats below" in f else " logprob")
                   for f in report["failures"])  # fmt: skip
    # the swapped token also carries the old token's logprob
    assert where == ["prompt 0 step 3 logprob", "prompt 1 step 4 logprob", "prompt 1 step 4 token"]
    assert report["exact"] == 9 and report["positions"] == 10


@pytest.fixture(scope="module")
def bf16_against_float32(tmp_path_factory):
    """model_parity's output for the torch reference in bf16 against itself in float32."""
    out = tmp_path_factory.mktemp("envelope") / "ref.json"
    argv = [str(embedded_model_dir()), "--backend", "torch", "--graphs", "", "--device", "cpu"]
    argv += ["--prompts", "2", "--new-tokens", "6", "--dtype", "bfloat16"]
    argv += ["--ref-dtype", "float32", "--tie", "0.001", "--logprob-atol", "0.001"]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        model_parity.main(argv)
    out.write_text(stdout.getvalue())
    return out


def test_envelope_passes_a_path_as_faithful_as_the_reference_and_fails_one_further(
    bf16_against_float32, tmp_path, capsys
):
    import parity_envelope

    ref = json.loads(bf16_against_float32.read_text())
    assert ref["mean_logprob_diff"] > 0  # bf16 strays from float32: something to compare
    assert parity_envelope.main([str(bf16_against_float32)] * 2) == 0
    verdict = json.loads(capsys.readouterr().out)
    assert verdict["ok"] and verdict["positions"] == 12
    further = dict(ref, mean_logprob_diff=ref["mean_logprob_diff"] * 1.3)
    (tmp_path / "further.json").write_text(json.dumps(further))
    assert parity_envelope.main([str(tmp_path / "further.json"), str(bf16_against_float32)]) == 1
    assert not json.loads(capsys.readouterr().out)["ok"]


def test_envelope_refuses_runs_not_against_float32(bf16_against_float32, tmp_path, capsys):
    import parity_envelope

    same_dtype = dict(json.loads(bf16_against_float32.read_text()), ref_dtype="bfloat16")
    (tmp_path / "same.json").write_text(json.dumps(same_dtype))
    assert parity_envelope.main([str(tmp_path / "same.json"), str(bf16_against_float32)]) == 2
    assert "float32" in capsys.readouterr().err
