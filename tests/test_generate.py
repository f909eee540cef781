"""`snapfn generate`: JSON output equals the engine's, from a model folder or a snapshot."""

from __future__ import annotations

import json

from snapfn.handler.cli import main
from snapfn.handler.llm.build import EngineOptions, build_engine
from snapfn.handler.llm.embedded import embedded_model_dir
from snapfn.handler.llm.engine.request import SamplingParams


def run_json(capsys, *argv: str) -> dict:
    assert main(["generate", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_generate_json_equals_engine(capsys):
    out = run_json(capsys, "--prompt-ids", "5,6,7", "--max-new-tokens", "6", "--ignore-eos")
    engine = build_engine(embedded_model_dir(), EngineOptions()).engine
    ref = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=6, ignore_eos=True))[0]
    assert out["token_ids"] == list(ref.token_ids)
    assert out["logprobs"] == list(ref.logprobs)
    assert out["text"] == engine.tokenizer.decode(list(ref.token_ids))


def test_generate_from_snapshot_equals_cold(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    snap = str(tmp_path / "snap")
    assert main(["init", "--snapshot", snap, "--max-num-batched-tokens", "64"]) == 0
    capsys.readouterr()
    cold = run_json(capsys, "--prompt", "ROMEO:", "--max-new-tokens", "8")
    assert (
        main(
            [
                "generate",
                "--json",
                "--snapshot",
                snap,
                "--prompt",
                "ROMEO:",
                "--max-new-tokens",
                "8",
            ]
        )
        == 0
    )
    out, err = capsys.readouterr()
    restored = json.loads(out.strip().splitlines()[-1])
    assert restored == cold
    stage_lines = [line for line in err.splitlines() if "stream_weights" in line]
    assert len(stage_lines) == 1, err  # each stage printed once, as it ran
    assert "restore (portable) ok in" in err
    assert any(c.isalpha() for c in cold["text"])


def test_bad_arguments_exit_2_with_a_reason(capsys):
    assert main(["generate", "--prompt-ids", "1,x"]) == 2
    assert "--prompt-ids must be comma-separated integers" in capsys.readouterr().err
