"""The `snapfn` command's conventions (`handler/cli.py`): `--version`, every option's default in
its help, one line and no traceback for a user's error."""

from __future__ import annotations

import argparse
import re

import pytest

from snapfn.handler.cli import build_parser, main
from snapfn.handler.version import snapfn_version


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"snapfn {snapfn_version()}"
    assert snapfn_version() not in ("", "unknown")


def test_every_option_of_every_command_shows_its_default():
    for name, parser in subparsers(build_parser()).items():
        for action in parser._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            shown = parser._get_formatter()._format_action(action)
            assert "default" in shown.lower(), f"snapfn {name}: {shown!r}"


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
