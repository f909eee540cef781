"""The `snapfn` command. Each subcommand's module owns its arguments and its run function.

Heavy modules (torch, transformers) are imported inside the run functions, never here, so
`snapfn --help` is instant and nothing touches CUDA before a subcommand asks for it.

Conventions every subcommand gets here: `snapfn --version`; each option's help ends with its
default (`DefaultsShown`: the value, on/off for a switch, "not set" where the option has none
and something else decides); a user's error is one line on stderr, never a traceback: a
`SnapfnError` (exit 2, its code named) or an `OSError` on a path the user gave (exit 1).
"""

from __future__ import annotations

import argparse
import copy
import importlib
import sys
from collections.abc import Callable

from snapfn.handler.version import snapfn_version
from snapfn.snapshot.errors import SnapfnError

EXIT_USAGE = 2
EXIT_OS_ERROR = 1


# name → (help, module, add_arguments attribute, run attribute); modules import lazily
SUBCOMMANDS: dict[str, tuple[str, str, str, str]] = {
    "init": (
        "run the init phase and write a portable snapshot",
        "snapfn.handler.llm.recipes.cli",
        "add_init_arguments",
        "run_init",
    ),
    "inspect": (
        "print a snapshot's startup manifest (and plot its waterfall)",
        "snapfn.handler.llm.recipes.cli",
        "add_inspect_arguments",
        "run_inspect",
    ),
    "generate": (
        "generate text with a model (default: the embedded model)",
        "snapfn.handler.llm.generate",
        "add_arguments",
        "run",
    ),
    "serve": (
        "serve HTTP (OpenAI-compatible + /invoke) under gunicorn; --idle-timeout scales to zero",
        "snapfn.handler.http.serve",
        "add_arguments",
        "run",
    ),
    "worker": (
        "consume an SQS queue of batch jobs",
        "snapfn.handler.queue.cli",
        "add_arguments",
        "run",
    ),
    "bench": (
        "measure cold-start modes side by side (HF, safetensors, cold init, restores)",
        "snapfn.handler.llm.bench.cli",
        "add_arguments",
        "run",
    ),
    "doctor": (
        "report whether this machine can run each snapshot tier, and why not",
        "snapfn.snapshot.process.doctor",
        "add_arguments",
        "run",
    ),
    "push": (
        "upload a snapshot to s3://bucket/prefix (verified first, manifest last)",
        "snapfn.snapshot.store.cli",
        "add_push_arguments",
        "run_push",
    ),
    "pull": (
        "fetch a snapshot from s3://bucket/prefix (verified, resumable, published atomically)",
        "snapfn.snapshot.store.cli",
        "add_pull_arguments",
        "run_pull",
    ),
    "pin": (
        "keep a process snapshot's weights in pinned host memory for faster tier-1 restores here",
        "snapfn.snapshot.keeper.daemon",
        "add_pin_arguments",
        "run",
    ),
    "keeper": (
        "serve this machine's tier-1 restores from a warm CUDA driver (and pinned weights)",
        "snapfn.snapshot.keeper.daemon",
        "add_keeper_arguments",
        "run",
    ),
    "make-model": (
        "write a synthetic checkpoint in the Hugging Face layout",
        "snapfn.handler.llm.make_model.cli",
        "add_arguments",
        "run",
    ),
}


def _load(name: str, module: str, add: str, run: str) -> tuple[Callable, Callable]:
    """The subcommand's functions; a missing optional dependency disables only that command."""
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        missing = exc.name or str(exc)

        def unavailable(args: argparse.Namespace) -> int:
            print(
                f"snapfn {name}: needs the Python package {missing!r}; pip install it",
                file=sys.stderr,
            )
            return EXIT_USAGE

        return (lambda p: p.add_argument("rest", nargs=argparse.REMAINDER)), unavailable
    return getattr(mod, add), getattr(mod, run)


class DefaultsShown(argparse.HelpFormatter):
    """Help that ends each option's text with its default, unless the text says it already."""

    def _format_action(self, action: argparse.Action) -> str:
        if action.option_strings and not action.help and action.help is not argparse.SUPPRESS:
            action = copy.copy(action)
            action.help = self._default_note(action).lstrip()
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or "default" in text.lower():
            return text
        return text + self._default_note(action)

    @staticmethod
    def _default_note(action: argparse.Action) -> str:
        if isinstance(action, argparse._HelpAction | argparse._VersionAction):
            return ""
        default = action.default
        if isinstance(action, argparse._StoreTrueAction):
            shown = "on" if default else "off"
        elif isinstance(action, argparse._StoreFalseAction):
            shown = "off" if default is False else "on"
        elif default is None or default == [] or default is argparse.SUPPRESS:
            shown = "not set"
        else:
            shown = str(default)
        return f" (default: {shown.replace('%', '%%')})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="snapfn",
        description="Serverless GPU functions with snapshot-restore.",
        formatter_class=DefaultsShown,
    )
    parser.add_argument("--version", action="version", version=f"snapfn {snapfn_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, module, add, run_name) in SUBCOMMANDS.items():
        add_arguments, run = _load(name, module, add, run_name)
        p = sub.add_parser(
            name, help=help_text, description=help_text, formatter_class=DefaultsShown
        )
        add_arguments(p)
        p.set_defaults(run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        return args.run(args)
    except SnapfnError as exc:
        print(f"snapfn {args.command}: error [{exc.code}]: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:  # a path the user gave: missing, unreadable, full
        print(f"snapfn {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_OS_ERROR
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
