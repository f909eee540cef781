"""The `snapfn` command. Each subcommand's module owns its arguments and its run function.

Heavy modules (torch, transformers) are imported inside the run functions, never here, so
`snapfn --help` is instant and nothing touches CUDA before a subcommand asks for it.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

from snapfn.snapshot.errors import SnapfnError

EXIT_USAGE = 2


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="snapfn", description="Serverless GPU functions with snapshot-restore."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, module, add, run_name) in SUBCOMMANDS.items():
        add_arguments, run = _load(name, module, add, run_name)
        p = sub.add_parser(name, help=help_text, description=help_text)
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
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
