"""The `snapfn` command's conventions (`handler/cli.py`): `--version`, every option's default in
its help, one line and no traceback for a user's error; and `snapfn inspect`
(`handler/llm/recipes/cli.py`) on whatever a manifest or a JSON file given to it holds."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from snapfn.handler.cli import build_parser, main
from snapfn.handler.version import snapfn_version

from snapshot_samples import write_snapshot


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"snapfn {snapfn_version()}"
    assert snapfn_version() not in ("", "unknown")


def test_every_option_of_every_command_shows_its_default_or_that_it_is_required():
    for name, parser in subparsers(build_parser()).items():
        for action in parser._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            shown = parser._get_formatter()._format_action(action).lower()
            said = "(required" in shown if action.required else "default" in shown
            assert said or "required unless" in shown, f"snapfn {name}: {shown!r}"


@pytest.mark.parametrize(
    ("command", "option", "says"),
    [
        ("init", "--snapshot", "(required)"),
        ("worker", "--queue-url", "(required)"),
        ("pin", "--snapshot", "(required)"),
        ("make-model", "--out", "(required unless --list-presets)"),
        ("make-model", "--preset", "(default: tiny; with --arch, that model's: "),
        ("make-model", "--arch", "(default: the preset's model_type, llama without --preset)"),
    ],
)
def test_a_required_or_defaulted_option_never_reads_not_set(command, option, says):
    parser = subparsers(build_parser())[command]
    (action,) = [a for a in parser._actions if option in a.option_strings]
    shown = " ".join(parser._get_formatter()._format_action(action).split())
    assert says in shown and "not set" not in shown, shown


def test_output_cut_short_by_its_reader_ends_quietly():
    """`snapfn make-model --list-presets | head -1`: no error line, SIGPIPE's status."""
    import subprocess
    import sys

    argv = [sys.executable, "-m", "snapfn.handler.cli", "make-model", "--list-presets"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # the reader gone before the command writes
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 141 and err == ""


def test_a_switch_reads_on_or_off_and_an_unset_option_not_set():
    text = " ".join(subparsers(build_parser())["generate"].format_help().split())
    assert "--chat wrap the prompt in the model's chat template (default: off)" in text
    assert "(default: not set)" in text and "(default: None)" not in text


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["generate", "--temperature", "2.5"], "temperature must be in [0, 2]"),
        (["generate", "--device", "cuda:x"], "--device must be cpu or cuda[:N]"),
        (["generate", "--device", "cuda:7"], "--device cuda:7"),
        (["generate", "--repetition-penalty", "0"], "repetition_penalty"),
    ],
)
def test_user_errors_are_one_line_exit_2(capsys, argv, says):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_an_os_error_on_a_users_path_is_one_line(capsys, monkeypatch):
    def missing(args):
        raise FileNotFoundError(2, "No such file or directory", "/no/such/file")

    parser = build_parser()
    monkeypatch.setattr("snapfn.handler.cli.build_parser", lambda: parser)
    subparsers(parser)["inspect"].set_defaults(run=missing)
    assert main(["inspect", "/no/such/file"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("snapfn inspect: error:") and "/no/such/file" in err
    assert "Traceback" not in err


def test_device_check_counts_the_gpus_shown_and_the_torch_build(monkeypatch):
    from snapfn.handler import cli
    from snapfn.snapshot.errors import BadRequest

    monkeypatch.setattr(cli, "_torch_has_cuda", lambda: True)
    cli.check_device("cpu", {})
    cli.check_device("cuda", {"CUDA_VISIBLE_DEVICES": "3"})
    cli.check_device("cuda:1", {"CUDA_VISIBLE_DEVICES": "0,1"})
    for device, environ, says in [
        ("cuda:2", {"CUDA_VISIBLE_DEVICES": "0,1"}, "this machine has 2 CUDA GPU(s)"),
        ("cuda", {"CUDA_VISIBLE_DEVICES": ""}, "no usable CUDA GPU (none shown)"),
        ("gpu", {}, "cpu or cuda[:N]"),
    ]:
        with pytest.raises(BadRequest, match=re.escape(says)):
            cli.check_device(device, environ)
    monkeypatch.setattr(cli, "_torch_has_cuda", lambda: False)
    with pytest.raises(BadRequest, match="built without CUDA"):
        cli.check_device("cuda", {"CUDA_VISIBLE_DEVICES": "0"})
    cli.check_device("cuda", {"CUDA_VISIBLE_DEVICES": "0"}, torch_runs_it=False)  # a function


# ---- snapfn inspect --------------------------------------------------------------------------
STARTUP = {
    "kind": "init",
    "tier": "cold",
    "total_s": 1.5,
    "ok": True,
    "stages": [{"name": "load_weights", "start_s": 0.25, "seconds": 0.5, "figures": {"bytes": 7}}],
    "fallbacks": [{"from": "portable", "to": "cold", "step": "load_weights", "reason": "bit flip"}],
}
LLM = {
    "memory_plan": {
        "num_pages": 8,
        "page_size": 16,
        "kv_bytes": 2 << 20,
        "weights_bytes": 3 << 20,
        "source": "fixed budget",
    },
    "graph_buckets": [1, 2, 4],
    "compile_caches": [],
}


def inspected_snapshot(path: Path, edit=None) -> Path:
    """A sample snapshot with a startup manifest and an llm section, its manifest then edited."""
    write_snapshot(path, startup=STARTUP, llm=LLM)
    manifest = json.loads((path / "manifest.json").read_text())
    if edit is not None:
        edit(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


def test_inspect_shows_the_startup_manifest(tmp_path, capsys):
    assert main(["inspect", str(inspected_snapshot(tmp_path / "snap"))]) == 0
    out = capsys.readouterr().out
    assert "init (cold): 1.500 s, ok=True\n" in out
    assert "load_weights          0.250     0.500  bytes=7\n" in out
    assert "fallback portable -> cold at load_weights: bit flip\n" in out
    assert "memory plan: 8 pages x 16 tokens (2.0 MiB KV, 3.0 MiB weights, fixed budget)\n" in out
    assert "graph buckets: [1, 2, 4]\n" in out and "restore chain here: " in out


@pytest.mark.parametrize(
    ("edit", "shows"),
    [
        (lambda m: m["startup"].pop("fallbacks"), "fallbacks: (absent)\n"),
        (lambda m: m["startup"].update(total_s="fast"), "init (cold): (absent) s, ok=True\n"),
        (lambda m: m["startup"].update(stages={}), "stages: (absent)\n"),
        (
            lambda m: m["startup"]["stages"][0].update(figures=[1], seconds=None),
            "load_weights          0.250  (absent)  \n",
        ),
        (lambda m: m["startup"]["stages"].append("x"), "(absent)           (absent)  (absent)"),
        (lambda m: m["llm"].pop("memory_plan"), "memory plan: (absent)\n"),
        (lambda m: m["llm"]["memory_plan"].update(kv_bytes=10**400), "((absent) MiB KV, 3.0 MiB"),
        (lambda m: m["llm"].pop("graph_buckets"), "graph buckets: (absent)\n"),
        (lambda m: m.update(llm="x"), "llm: (absent)\n"),
        (
            lambda m: m.update(process={"worker": 1, "hooks": "h", "regions": [1]}),
            "before-snapshot hooks: (absent)\n  regions kept out of the image: 0.00 GB ((absent)",
        ),
    ],
)
def test_inspect_marks_a_field_missing_or_of_another_type_absent(tmp_path, capsys, edit, shows):
    assert main(["inspect", str(inspected_snapshot(tmp_path / "snap", edit))]) == 0
    captured = capsys.readouterr()
    assert shows in captured.out and captured.err == ""


def test_inspect_plots_the_stages_it_can_draw(tmp_path, capsys):
    pytest.importorskip("matplotlib")

    def edit(manifest):
        manifest["startup"]["stages"] += [{"name": "huge", "start_s": 1e300, "seconds": 1}, "x"]

    plot = tmp_path / "waterfall.png"
    snapshot = inspected_snapshot(tmp_path / "snap", edit)
    assert main(["inspect", str(snapshot), "--plot", str(plot)]) == 0
    assert plot.stat().st_size > 0 and capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("write", "says"),
    [
        (
            lambda p: inspected_snapshot(p, lambda m: m.pop("startup")),
            "it holds no startup manifest (a JSON object at 'startup')",
        ),
        (
            lambda p: inspected_snapshot(p, lambda m: m.update(startup="x")),
            "it holds no startup manifest (a JSON object at 'startup')",
        ),
        (lambda p: p.write_bytes(b"\xff\xfe\x00binary"), "it is not UTF-8"),
        (lambda p: p.write_text("[1, 2]"), "it is not a JSON object"),
        (lambda p: p.write_text('{"startup": 3}'), "it holds no startup manifest"),
    ],
)
def test_inspect_refuses_what_holds_no_startup_manifest_in_one_line(tmp_path, capsys, write, says):
    path = tmp_path / "given"
    write(path)
    assert main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("snapfn inspect: error [bad_snapshot]: ") and says in err
    assert len(err.strip().splitlines()) == 1


def test_inspect_reads_a_file_no_larger_than_a_manifest(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("snapfn.snapshot.portable.format.MAX_MANIFEST_BYTES", 1024)
    path = tmp_path / "startup.json"
    path.write_text(json.dumps(STARTUP).ljust(2048))
    assert main(["inspect", str(path)]) == 2
    assert "startup.json is 2048 bytes, more than the 1024 allowed" in capsys.readouterr().err
    path.write_text(json.dumps(STARTUP))
    assert main(["inspect", str(path)]) == 0
    assert "init (cold): 1.500 s, ok=True\n" in capsys.readouterr().out
