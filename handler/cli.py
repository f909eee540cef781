"""The `snapfn` command. Each subcommand's module owns its arguments and its run function.

Heavy modules (torch, transformers) are imported inside the run functions, never here, so
`snapfn --help` is instant and nothing touches CUDA before a subcommand asks for it.

Conventions every subcommand gets here: `snapfn --version`; each option's help ends with its
default (`DefaultsShown`: the value, on/off for a switch, "not set" where the option has none
and something else decides), or says "(required)" for an option that must be given; a `--device`
this machine cannot run (`cuda` without a GPU, or with a torch built without CUDA, `cuda:N` past
its GPUs) is refused before the command runs, without importing torch or touching CUDA
(`check_device`); a user's error is one line on stderr, never a traceback: a `SnapfnError` (exit
2, its code named) or an `OSError` on a path the user gave (exit 1); output cut short by its
reader (`snapfn … | head`) ends the command quietly (exit 141, as if killed by SIGPIPE).
"""

from __future__ import annotations

import argparse
import copy
import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

from snapfn.handler.version import snapfn_version
from snapfn.snapshot.errors import BadRequest, SnapfnError

EXIT_USAGE = 2
EXIT_OS_ERROR = 1
EXIT_BROKEN_PIPE = 128 + 13  # SIGPIPE's status: stdout's reader went away
TORCH_CUDA_LINE = re.compile(r"^cuda\s*(?::[^=]+)?=\s*(.+)$", re.M)  # in torch/version.py


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
    "tune": (
        "time the Triton kernels' configs for a model on this GPU; write them as a tuned table",
        "snapfn.handler.llm.recipes.tune",
        "add_arguments",
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
    """Help that ends each option's text with its default, or "(required)" for a required
    option, unless the text says either already."""

    def _format_action(self, action: argparse.Action) -> str:
        if action.option_strings and not action.help and action.help is not argparse.SUPPRESS:
            action = copy.copy(action)
            action.help = self._default_note(action).lstrip()
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        said = text.lower()
        if not action.option_strings or "default" in said or "required" in said:
            return text
        return text + self._default_note(action)

    @staticmethod
    def _default_note(action: argparse.Action) -> str:
        if isinstance(action, argparse._HelpAction | argparse._VersionAction):
            return ""
        if action.required:
            return " (required)"
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


def check_device(device: str, environ: Mapping[str, str], torch_runs_it: bool = True) -> None:
    """BadRequest, one line, for a `--device` this machine cannot run on; neither torch nor
    CUDA is touched (the GPUs counted as the activator counts them; with `torch_runs_it`, the
    LLM's case, torch's build read from its version.py)."""
    kind, _, index = device.partition(":")
    if device == "cpu":
        return
    if kind != "cuda" or (index and not index.isdigit()):
        raise BadRequest(f"--device must be cpu or cuda[:N], not {device!r}")
    from snapfn.handler.activator.plan import visible_gpu_ids  # torch-free

    gpus = visible_gpu_ids(environ)
    if not gpus:
        raise BadRequest(f"--device {device}: this machine has no usable CUDA GPU (none shown)")
    if torch_runs_it and not _torch_has_cuda():
        raise BadRequest(
            f"--device {device}: this machine has no usable CUDA GPU (the torch installed here "
            "is built without CUDA)"
        )
    if int(index or 0) >= len(gpus):
        raise BadRequest(f"--device {device}: this machine has {len(gpus)} CUDA GPU(s)")


def _torch_has_cuda() -> bool:
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    try:
        text = (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text()
    except OSError:
        return True  # unknown: let torch say
    found = TORCH_CUDA_LINE.search(text)
    return found is None or found.group(1).strip() != "None"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.command_line = list(sys.argv[1:] if argv is None else argv)  # what ranks run again
    if not getattr(args, "run", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        if isinstance(getattr(args, "device", None), str):  # a function may not need torch's
            check_device(args.device, os.environ, getattr(args, "function", None) is None)
        code = args.run(args)
        sys.stdout.flush()  # NOTE: inside the try: a reader gone is seen here, not at exit
        return code
    except BrokenPipeError as exc:
        if not _stdout_reader_gone():
            print(f"snapfn {args.command}: error: {exc}", file=sys.stderr)
            return EXIT_OS_ERROR
        _discard_stdout()
        return EXIT_BROKEN_PIPE
    except SnapfnError as exc:
        print(f"snapfn {args.command}: error [{exc.code}]: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:  # a path the user gave: missing, unreadable, full
        print(f"snapfn {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_OS_ERROR
    except KeyboardInterrupt:
        return 130


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe or socket whose reader has closed it (poll says POLLERR)."""
    import select

    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError):  # replaced by an object with no descriptor
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def _discard_stdout() -> None:
    """stdout pointed at /dev/null, so that the interpreter's last flush has nowhere to fail."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
