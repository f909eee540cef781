"""The `snapfn` command. Each subcommand's module owns its arguments and its run function.

Heavy modules (torch, transformers) are imported inside the run functions, never here, so
`snapfn --help` is instant and nothing touches CUDA before a subcommand asks for it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from snapfn.snapshot.errors import SnapfnError

EXIT_USAGE = 2


def _subcommands() -> dict[str, tuple[str, Callable, Callable]]:
    from . import queue, serve
    from .llm import bench, generate, make_model, snapshot_cli

    return {
        "init": (
            "run the init phase and write a portable snapshot",
            snapshot_cli.add_init_arguments,
            snapshot_cli.run_init,
        ),
        "inspect": (
            "print a snapshot's startup manifest (and plot its waterfall)",
            snapshot_cli.add_inspect_arguments,
            snapshot_cli.run_inspect,
        ),
        "generate": (
            "generate text with a model (default: the embedded model)",
            generate.add_arguments,
            generate.run,
        ),
        "serve": (
            "serve HTTP (OpenAI-compatible + /invoke) under gunicorn",
            serve.add_arguments,
            serve.run,
        ),
        "worker": (
            "consume an SQS queue of batch jobs",
            queue.add_arguments,
            queue.run,
        ),
        "bench": (
            "measure cold-start modes side by side (HF, safetensors, cold init, restores)",
            bench.add_arguments,
            bench.run,
        ),
        "make-model": (
            "write a synthetic checkpoint in the Hugging Face layout",
            make_model.add_arguments,
            make_model.run,
        ),
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="snapfn", description="Serverless GPU functions with snapshot-restore."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, add_arguments, run) in _subcommands().items():
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
