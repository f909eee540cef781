"""`snapfn tune`: time every autotuned kernel's configs for a model on this GPU, and merge the
winners into a tuned table that later inits and restores read without timing anything.

    snapfn tune --model /models/llama --out tuned.json        # then SNAPFN_TUNED_CONFIGS=tuned.json
    snapfn tune --out handler/llm/kernels/triton/tuned/nvidia-h200.json   # the shipped table

It runs the model's cold init (every stage: the memory profile's prefill, the warmup's
shapes, each graph bucket) with SNAPFN_KERNEL_TUNING=init, writes no snapshot, and merges each
(kernel, key) it chose into `--out` (kernels/triton/tuning.py: the table's format; a key already
there is replaced). A table is for one GPU model: `--out` defaults to `tuned-<gpu>.json`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from snapfn.handler.llm.recipes.cli import add_init_config_arguments, init_config_from_args
from snapfn.snapshot.errors import BadRequest


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", type=Path, default=None, help="HF model folder (default: the embedded model)"
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="the table to merge the choices into (default: tuned-<gpu>.json here)",
    )
    add_init_config_arguments(p)


def run(args: argparse.Namespace) -> int:
    from snapfn.handler.llm.embedded import embedded_model_dir
    from snapfn.handler.llm.kernels.triton import tuning
    from snapfn.handler.llm.recipes.function import LLMFunction
    from snapfn.snapshot.runtime import cold_init, summary

    config = init_config_from_args(args)
    if not config.device.startswith("cuda"):
        raise BadRequest("snapfn tune times kernels on a GPU: pass --device cuda")
    if config.world_size > 1:
        raise BadRequest("snapfn tune runs one rank: leave out --tp-size and --ep-size")
    model_dir = args.model or embedded_model_dir()
    fn = LLMFunction(config, model_dir, kernel_tuning=tuning.KernelTuning("init"))
    startup = cold_init(fn)
    print(summary(startup, stages=False), file=sys.stderr)
    gpu = _gpu_name(config.device)
    out = args.out or Path(f"tuned-{tuning.gpu_slug(gpu)}.json")
    chosen = [c for c in tuning.recorded_choices() if c["source"] in ("tuned", "shipped")]
    total = tuning.write_table(out, chosen, _about(gpu, model_dir))
    print(f"{len(chosen)} kernel choices for {model_dir.name} merged into {out} ({total} in all)")
    return 0


def _gpu_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name(torch.device(device))


def _about(gpu: str, model_dir: Path) -> dict:
    import triton

    return {"gpu": gpu, "triton": triton.__version__, "made_by": "snapfn tune"}
