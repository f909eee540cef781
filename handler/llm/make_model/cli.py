"""The `snapfn make-model` subcommand: arguments, defaults, and `run`.

Importing this module stays cheap (no torch): `handler/cli.py` imports it to build its parser.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, fields
from pathlib import Path

from snapfn.handler.llm.make_model.presets import (
    DEFAULT_PRESET_OF_ARCH,
    PRESETS,
    get_preset,
    list_archs,
    list_presets,
    with_experts,
)
from snapfn.handler.llm.make_model.safetensors_writer import DEFAULT_MAX_SHARD_BYTES
from snapfn.snapshot.errors import BadRequest

DTYPE_CHOICES = ("bf16", "fp8", "fp32")  # == hf_layout.STORAGE_DTYPES (that module is cheap too)
_SIZE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "ki": 2**10, "mi": 2**20, "gi": 2**30}


@dataclass(frozen=True)
class MakeModelArgs:
    """Options of `snapfn make-model`; the CLI's defaults come from here."""

    out: Path | None = None
    arch: str | None = None  # a model_type; picks its default preset when --preset is absent
    preset: str | None = None
    dtype: str = "bf16"
    seed: int = 0
    num_layers: int | None = None
    experts: int | None = None
    device: str = "cpu"
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    force: bool = False
    list_presets: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> MakeModelArgs:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    def preset_name(self) -> str:
        """--preset, else --arch's default preset; they must agree when both are given."""
        if self.preset is None:
            return DEFAULT_PRESET_OF_ARCH[self.arch or "llama"]
        model_type = get_preset(self.preset).model_type
        if self.arch is not None and self.arch != model_type:
            raise BadRequest(
                f"preset {self.preset!r} is a {model_type} model, not --arch {self.arch}"
            )
        return self.preset


def parse_size(text: str) -> int:
    """Bytes from '4GiB', '500MB', '65536' (SI and binary units, case-insensitive)."""
    match = re.fullmatch(r"\s*(\d+)\s*([kmg]i?)?b?\s*", text.lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4GiB, 500MB, 65536)")
    return int(match.group(1)) * _SIZE_UNITS[match.group(2) or ""]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = MakeModelArgs()
    parser.add_argument(
        "--out",
        type=Path,
        default=d.out,
        help="model dir to create (required unless --list-presets)",
    )
    parser.add_argument(
        "--arch",
        choices=list_archs(),
        default=d.arch,
        help="model_type; without --preset it picks that model's preset (default: the preset's"
        " model_type, llama without --preset)",
    )
    llama_preset = DEFAULT_PRESET_OF_ARCH["llama"]
    others = ", ".join(f"{a}: {p}" for a, p in DEFAULT_PRESET_OF_ARCH.items() if a != "llama")
    parser.add_argument(
        "--preset",
        choices=list_presets(),
        default=d.preset,
        help="the model's shape, listed with its sizes by --list-presets (default:"
        f" {llama_preset}; with --arch, that model's: {others})",
    )
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default=d.dtype)
    parser.add_argument("--seed", type=int, default=d.seed, help="the weights' RNG seed")
    parser.add_argument("--num-layers", type=int, default=d.num_layers, help="override depth")
    parser.add_argument(
        "--experts", type=int, default=d.experts, help="override routed experts per MoE layer"
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default=d.device, help="RNG device")
    parser.add_argument(
        "--max-shard-bytes", type=parse_size, default=d.max_shard_bytes, help="e.g. 4GiB"
    )
    parser.add_argument("--force", action="store_true", help="replace a non-empty --out")
    parser.add_argument(
        "--list-presets", action="store_true", help="print presets and their sizes, then exit"
    )


def run(args: argparse.Namespace) -> int:
    """Run the subcommand; prints the model dir on stdout. Raises `SnapfnError` on bad input."""
    from snapfn.handler.llm.make_model.hf_layout import (
        checkpoint_bytes,  # cheap; kept here beside its only use
    )

    opts = MakeModelArgs.from_args(args)
    if opts.list_presets:
        for name, preset in PRESETS.items():
            sizes = "  ".join(f"{d} {_human(checkpoint_bytes(preset, d))}" for d in DTYPE_CHOICES)
            print(f"{name:14s} {preset.model_type:12s} {sizes}")
        return 0
    if opts.out is None:
        raise BadRequest("make-model needs --out DIR")
    name = opts.preset_name()
    preset = with_experts(get_preset(name), opts.experts)
    total = checkpoint_bytes(preset, opts.dtype, opts.num_layers)
    print(
        f"make-model: {name} {opts.dtype}: {total} bytes ({total / 2**30:.2f} GiB)", file=sys.stderr
    )
    # NOTE: torch is imported only now (seconds of start-up the parser should not pay).
    from snapfn.handler.llm.make_model.build import make_model

    out = make_model(
        name,
        opts.out,
        dtype=opts.dtype,
        seed=opts.seed,
        num_layers=opts.num_layers,
        experts=opts.experts,
        device=opts.device,
        max_shard_bytes=opts.max_shard_bytes,
        overwrite=opts.force,
    )
    print(out)
    return 0


def _human(num_bytes: int) -> str:
    return f"{num_bytes / 1e9:8.2f} GB" if num_bytes >= 1e9 else f"{num_bytes / 1e6:8.2f} MB"
