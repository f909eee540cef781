"""Load checkpoint tensors into a model, with the coverage check.

The coverage check makes "runs on wrong or missing weights" impossible:
- every tensor in the checkpoint is consumed by the model or matches its `not_loaded` list;
- every FP8 weight has its `weight_scale_inv` and every scale has its FP8 weight;
- every tensor's dtype class (fp8 or not) and shape match the parameter it fills;
- every parameter (every expert row of stacked experts, every part of a fused projection) was
  filled exactly once.
Any violation raises `CheckpointError` naming the tensors.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from snapfn.handler.llm.models.base import CausalLM, WeightTarget
from snapfn.handler.llm.weights.checkpoint import Checkpoint, _names
from snapfn.handler.llm.weights.quant import FP8_DTYPE
from snapfn.handler.llm.weights.sharding import placement_for, shard_slice_bounds
from snapfn.snapshot.errors import CheckpointError

FP8_SAFETENSORS_DTYPES = {"F8_E4M3"}
SCALE_SUFFIX = "_scale_inv"


@dataclass
class LoadReport:
    num_tensors: int = 0
    num_bytes: int = 0
    seconds: float = 0.0
    not_loaded: list[str] = field(default_factory=list)
    other_rank: list[str] = field(default_factory=list)

    @property
    def gb_per_s(self) -> float:
        return self.num_bytes / 1e9 / self.seconds if self.seconds else 0.0


def check_fp8_pairs(ckpt: Checkpoint) -> None:
    """Every FP8 weight has a scale beside it and every scale belongs to an FP8 weight."""
    fp8 = {n for n, t in ckpt.tensors.items() if t.dtype in FP8_SAFETENSORS_DTYPES}
    scales = {n for n in ckpt.tensors if n.endswith(SCALE_SUFFIX)}
    no_scale = sorted(n for n in fp8 if n + SCALE_SUFFIX not in ckpt.tensors)
    orphan = sorted(n for n in scales if n.removesuffix(SCALE_SUFFIX) not in fp8)
    if no_scale:
        raise CheckpointError(f"FP8 weights without weight_scale_inv: {_names(no_scale)}")
    if orphan:
        raise CheckpointError(f"weight_scale_inv without an FP8 weight: {_names(orphan)}")


def plan_targets(model: CausalLM, ckpt: Checkpoint) -> tuple[dict[str, WeightTarget], list[str]]:
    """Map every checkpoint tensor to a parameter; the rest must be on the not-loaded list or
    hold no element (transformers writes a module of size 0 as empty tensors: GLM's shared
    experts with `n_shared_experts=0`), which no computation can read."""
    targets, skipped, unexpected = {}, [], []
    for name in sorted(ckpt.tensors):
        target = model.map_weight(name)
        if target is not None:
            targets[name] = target
        elif model.is_not_loaded(name) or 0 in ckpt.tensors[name].shape:
            skipped.append(name)
        else:
            unexpected.append(name)
    dense_fp8 = [n.removesuffix(SCALE_SUFFIX) for n in unexpected if n.endswith(SCALE_SUFFIX)]
    dense_fp8 = [n for n in dense_fp8 if n in targets]
    if dense_fp8:
        raise CheckpointError(
            f"FP8 in the checkpoint but dense in the model: {_names(dense_fp8)} "
            "(check quantization_config.modules_to_not_convert)"
        )
    if unexpected:
        raise CheckpointError(f"checkpoint tensors the model does not use: {_names(unexpected)}")
    return targets, skipped


def load_weights(model: CausalLM, ckpt: Checkpoint, batch_bytes: int = 1 << 30) -> LoadReport:
    """Fill every parameter of `model` from `ckpt`, checking coverage. Returns figures."""
    start = time.perf_counter()
    check_fp8_pairs(ckpt)
    targets, skipped = plan_targets(model, ckpt)
    report = LoadReport(not_loaded=skipped)
    filled: set[tuple[str, int | None, tuple[int, int] | None]] = set()
    params = dict(model.named_parameters())
    parallel = model.parallel.tp_size * model.parallel.ep_size > 1
    for names in _batches(targets, ckpt, batch_bytes):
        bounds = None
        if parallel:  # a rank reads its slices only, and not the experts of other ranks
            bounds = {n: _slice(model, ckpt, n) for n in names}
            report.other_rank += [n for n in names if bounds[n] is None]
            names = [n for n in names if bounds[n] is not None]
        for name, tensor in ckpt.read(names, bounds=bounds).items():
            _fill(params, name, tensor, targets[name], filled, report, model.config.arch)
    _check_all_filled(params, filled, model.fused_targets())
    report.seconds = time.perf_counter() - start
    return report


def _batches(
    targets: dict[str, WeightTarget], ckpt: Checkpoint, batch_bytes: int
) -> Iterable[list[str]]:
    batch, size = [], 0
    for name in targets:
        info = ckpt.tensors[name]
        batch.append(name)
        size += torch.Size(info.shape).numel() * 4
        if size >= batch_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _slice(model: CausalLM, ckpt: Checkpoint, name: str) -> tuple | None:
    """This rank's bounds of checkpoint tensor `name` (None: another ep rank's expert)."""
    info = ckpt.tensors[name]
    moe = model.config.moe
    return shard_slice_bounds(
        info.shape,
        placement_for(model.config.arch, name),
        model.parallel,
        name=name,
        fp8=info.dtype in FP8_SAFETENSORS_DTYPES,
        num_experts=moe.n_routed_experts if moe else None,
        num_kv_heads=model.config.num_kv_heads,
    )


def _fill(params, name, local, target, filled, report, arch: str) -> None:
    """`local` (this rank's part of checkpoint tensor `name`, as read) into its target."""
    param = params.get(target.param)
    if param is None:
        raise CheckpointError(
            f"{name}: maps to parameter {target.param}, which the model does not have"
        )
    dest = target.dest(param.data)
    if local.shape[0] < dest.shape[0] and placement_for(arch, name).kind == "vocab":
        with torch.no_grad():  # the last rank's short block of the vocabulary: zero padding
            dest[local.shape[0] :].zero_()
        dest = dest[: local.shape[0]]
    _check_compatible(name, local, dest)
    key = (target.param, target.index, target.rows)
    if key in filled:
        raise CheckpointError(f"{name}: parameter {_part(key)} filled twice")
    dest.copy_(local)
    filled.add(key)
    report.num_tensors += 1
    report.num_bytes += local.numel() * local.element_size()


def _check_compatible(name: str, src: torch.Tensor, dest: torch.Tensor) -> None:
    if tuple(src.shape) != tuple(dest.shape):
        raise CheckpointError(
            f"{name}: shape {tuple(src.shape)} does not match the model's {tuple(dest.shape)}"
        )
    if (src.dtype == FP8_DTYPE) != (dest.dtype == FP8_DTYPE):
        kind = "FP8" if src.dtype == FP8_DTYPE else str(src.dtype)
        want = "FP8" if dest.dtype == FP8_DTYPE else "a dense dtype"
        raise CheckpointError(
            f"{name}: checkpoint holds {kind} but the model expects {want} "
            "(check quantization_config.modules_to_not_convert)"
        )


def _part(key: tuple[str, int | None, tuple[int, int] | None]) -> str:
    param, index, rows = key
    return (
        param
        + ("" if index is None else f"[{index}]")
        + ("" if rows is None else f"[{rows[0]}:{rows[1]}]")
    )


def _check_all_filled(
    params: dict[str, torch.nn.Parameter],
    filled: set[tuple[str, int | None, tuple[int, int] | None]],
    fused: dict[str, WeightTarget],
) -> None:
    """Every parameter filled: whole, every expert row, or (fused projections, `fused`:
    checkpoint name -> target) every part, a missing part named as the checkpoint names it."""
    whole = {p for p, i, r in filled if i is None and r is None}
    experts: dict[str, set[int]] = {}
    for p, i, _ in filled:
        if i is not None:
            experts.setdefault(p, set()).add(i)
    parts: dict[str, list[tuple[str, WeightTarget]]] = {}
    for name, target in fused.items():
        parts.setdefault(target.param, []).append((name, target))
    missing = []
    for pname, param in params.items():
        if pname in whole:
            continue
        if pname in parts:
            missing += [n for n, t in parts[pname] if (t.param, t.index, t.rows) not in filled]
            continue
        got = experts.get(pname, set())
        missing += (
            [pname] if not got else [f"{pname}[{i}]" for i in range(param.shape[0]) if i not in got]
        )
    if missing:
        raise CheckpointError(
            f"model parameters not filled by the checkpoint: {_names(sorted(missing))}"
        )
