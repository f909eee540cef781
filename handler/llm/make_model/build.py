"""`make_model`: generate a synthetic checkpoint and publish it atomically.

Recipe: plan (tensor specs → storage entries → shards, all from shapes) → write shards into a
staging sibling dir, one tensor in memory at a time → write config, generation config,
tokenizer, index → rename the staging dir onto `out_dir`. A crash leaves only a
`.NAME.partial-PID` dir behind, never a checkpoint that looks complete.

Values: each tensor has its own generator, seeded from (`seed`, tensor name) through SHA-256,
so the same preset + seed + device give byte-identical files (CPU and CUDA generators differ).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import torch

from snapfn.handler.llm.make_model.hf_config import config_json, generation_config_json
from snapfn.handler.llm.make_model.hf_layout import (
    TensorSpec,
    modules_not_converted,
    resolve_num_layers,
    storage_units,
    tensor_specs,
)
from snapfn.handler.llm.make_model.presets import Preset, get_preset, with_experts
from snapfn.handler.llm.make_model.safetensors_writer import (
    DEFAULT_MAX_SHARD_BYTES,
    INDEX_FILE,
    ShardPlan,
    ShardWriter,
    index_json,
    plan_shards,
)
from snapfn.handler.llm.make_model.tokenizer import (
    BOS_ID,
    EOS_ID,
    EOT_ID,
    MIN_VOCAB_SIZE,
    write_tokenizer,
)
from snapfn.handler.llm.weights.quant import quantize_fp8_block
from snapfn.snapshot.errors import BadRequest

PROGRESS_MIN_BYTES = 1 << 30  # print progress for checkpoints at least this big
DEVICES = ("cpu", "cuda")


def make_model(
    preset: str,
    out_dir: Path,
    *,
    dtype: str = "bf16",
    seed: int = 0,
    num_layers: int | None = None,
    experts: int | None = None,
    device: str = "cpu",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    progress: TextIO | None = None,
) -> Path:
    """Write preset `preset` as a Hugging Face model dir at `out_dir` and return `out_dir`.

    `dtype` is "bf16", "fp32" or "fp8" (128x128 block-quantized projections); `num_layers` and
    `experts` (routed experts per MoE layer) override the preset's. Progress goes to
    `progress` (default: stderr for checkpoints of 1 GiB or more). Raises `BadRequest` for bad
    options, or when `out_dir` is non-empty and `overwrite` is false.
    """
    spec = with_experts(get_preset(preset), experts)
    layers = resolve_num_layers(spec, num_layers)
    _check_options(spec, device, max_shard_bytes)
    tensors = tensor_specs(spec, layers)
    shards = plan_shards(storage_units(tensors, dtype), max_shard_bytes)
    out_dir = Path(out_dir)
    _check_out_dir(out_dir, overwrite)
    staging = out_dir.with_name(f".{out_dir.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        total_bytes = sum(shard.nbytes for shard in shards)
        if progress is None and total_bytes >= PROGRESS_MIN_BYTES:
            progress = sys.stderr
        meter = ProgressMeter(total_bytes, progress)
        write_shards(staging, shards, tensors, dtype=dtype, seed=seed, device=device, meter=meter)
        write_metadata(staging, spec, layers, dtype, tensors, shards)
        meter.finish()
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _publish(staging, out_dir)
    return out_dir


def write_shards(
    out_dir: Path,
    shards: list[ShardPlan],
    tensors: list[TensorSpec],
    *,
    dtype: str,
    seed: int,
    device: str,
    meter: ProgressMeter,
) -> None:
    spec_of = {spec.name: spec for spec in tensors}
    for shard in shards:
        with ShardWriter(out_dir / shard.file_name, shard.layout) as writer:
            for unit in shard.units:
                for name, data in encode_tensor(spec_of[unit[0].name], dtype, seed, device):
                    meter.add(writer.write(name, data))


def encode_tensor(
    spec: TensorSpec, dtype: str, seed: int, device: str
) -> list[tuple[str, memoryview]]:
    """The stored tensors of `spec` as (name, raw bytes on the host)."""
    values = sample_tensor(spec, seed, device)  # float32 on `device`
    if dtype == "fp8" and spec.quantize:
        weight, scale_inv = quantize_fp8_block(values)
        return [
            (spec.name, _host_bytes(weight)),
            (f"{spec.name}_scale_inv", _host_bytes(scale_inv)),
        ]
    stored = torch.float32 if dtype == "fp32" or spec.fp32 else torch.bfloat16
    return [(spec.name, _host_bytes(values.to(stored)))]


def sample_tensor(spec: TensorSpec, seed: int, device: str) -> torch.Tensor:
    if spec.fill is not None:
        return torch.full(spec.shape, spec.fill, dtype=torch.float32, device=device)
    generator = torch.Generator(device=device)
    generator.manual_seed(tensor_seed(seed, spec.name))
    values = torch.randn(spec.shape, generator=generator, dtype=torch.float32, device=device)
    return values.mul_(spec.std)


def tensor_seed(seed: int, name: str) -> int:
    """A 63-bit seed from (seed, name), stable across processes (unlike `hash()`)."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def write_metadata(
    out_dir: Path,
    spec: Preset,
    num_layers: int,
    dtype: str,
    tensors: list[TensorSpec],
    shards: list[ShardPlan],
) -> None:
    """config.json, generation_config.json, tokenizer files and (multi-shard) the index."""
    config = config_json(
        spec,
        num_layers,
        dtype,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        modules_to_not_convert=modules_not_converted(tensors),
    )
    _write_json(out_dir / "config.json", config)
    _write_json(
        out_dir / "generation_config.json", generation_config_json(BOS_ID, [EOS_ID, EOT_ID])
    )
    write_tokenizer(out_dir, spec.vocab_size, spec.max_position_embeddings)
    if len(shards) > 1:
        _write_json(out_dir / INDEX_FILE, index_json(shards))


class ProgressMeter:
    """Reports bytes written and GB/s to `stream` (if any), at most every `interval_s`."""

    def __init__(self, total_bytes: int, stream: TextIO | None, interval_s: float = 2.0) -> None:
        self.total_bytes, self.stream, self.interval_s = total_bytes, stream, interval_s
        self.done_bytes = 0
        self.start_s = self.last_report_s = time.perf_counter()

    def add(self, nbytes: int) -> None:
        self.done_bytes += nbytes
        if time.perf_counter() - self.last_report_s >= self.interval_s:
            self._report("")

    def finish(self) -> None:
        self._report(" done")

    def _report(self, suffix: str) -> None:
        now = time.perf_counter()
        self.last_report_s = now
        if self.stream is not None:
            rate = self.done_bytes / max(now - self.start_s, 1e-9) / 1e9
            print(
                f"make-model: {self.done_bytes / 1e9:.2f}/{self.total_bytes / 1e9:.2f} GB "
                f"({rate:.2f} GB/s){suffix}",
                file=self.stream,
                flush=True,
            )


def _check_options(spec: Preset, device: str, max_shard_bytes: int) -> None:
    if device not in DEVICES:
        raise BadRequest(f"device {device!r} is not supported (choose from {', '.join(DEVICES)})")
    if device == "cuda" and not torch.cuda.is_available():
        raise BadRequest("device 'cuda' was asked for but torch sees no CUDA device")
    if max_shard_bytes < 1:
        raise BadRequest(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    if spec.vocab_size < MIN_VOCAB_SIZE:
        raise BadRequest(f"vocab_size {spec.vocab_size} is below the tokenizer's {MIN_VOCAB_SIZE}")


def _check_out_dir(out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise BadRequest(f"{out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise BadRequest(f"{out_dir} is not empty (pass overwrite / --force to replace it)")


def _publish(staging: Path, out_dir: Path) -> None:
    # NOTE: the old dir is moved aside before the new one is renamed in, so `out_dir` is always
    # either absent, the old checkpoint, or the complete new one.
    old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
    if out_dir.exists():
        os.rename(out_dir, old)
    os.rename(staging, out_dir)
    shutil.rmtree(old, ignore_errors=True)


def _host_bytes(tensor: torch.Tensor) -> memoryview:
    # fp8 and bf16 have no numpy dtype: reinterpret as bytes first.
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.cpu().numpy())


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")
