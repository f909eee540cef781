"""Build a ready engine from a model folder: the cold-start recipe in named steps.

    read_config → build_model → load_weights (+coverage) → allocate_kv → load_tokenizer → Engine

The init phase (snapshot/) times each of these as a stage; here they are plain functions.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from snapfn.handler.llm.config import DTYPES, ModelConfig
from snapfn.handler.llm.engine.engine import Engine, SchedulerConfig
from snapfn.handler.llm.engine.kv_pool import KVPool, bytes_per_page
from snapfn.handler.llm.kernels import get_backend
from snapfn.handler.llm.models import model_class
from snapfn.handler.llm.models.base import CausalLM
from snapfn.handler.llm.parallel import ParallelConfig
from snapfn.handler.llm.tokenizer import load_tokenizer, stop_token_ids
from snapfn.handler.llm.weights.checkpoint import Checkpoint
from snapfn.handler.llm.weights.loader import LoadReport, load_weights
from snapfn.snapshot.errors import BadRequest


@dataclass(frozen=True)
class EngineOptions:
    """How to run a model. `num_pages=None` sizes the pool from `kv_cache_bytes`."""

    device: str = "cpu"
    dtype: str = "auto"  # "auto": the checkpoint's dtype on GPUs, float32 on CPU
    backend: str = "auto"
    num_pages: int | None = None
    kv_cache_bytes: int = 256 << 20
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


def resolve_dtype(config: ModelConfig, requested: str, device: str = "cpu") -> torch.dtype:
    """The compute dtype. "auto": the checkpoint's, except float32 on CPU, where bf16/fp16
    matmuls run several times slower than float32 on CPUs without bf16 units."""
    if requested == "auto":
        return torch.float32 if torch.device(device).type == "cpu" else config.dtype
    if requested not in DTYPES:
        raise BadRequest(f"dtype {requested!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[requested]


def as_held(config: ModelConfig, names: Iterable[str]) -> ModelConfig:
    """`config` for the tensors `names` hold (a checkpoint's, or a restore layout's parameters):
    as many MTP layers as they hold, where config.json declares more
    (`glm_moe_dsa.mtp_layers_held`), and an `lm_head` of its own where config.json ties it to
    the embedding but they hold one (transformers then loads it: "will NOT tie"; where the two
    are equal, as tied, the logits are the same)."""
    names = set(names)
    if config.tie_word_embeddings and "lm_head.weight" in names:
        config = replace(config, tie_word_embeddings=False)
    if not config.num_mtp_layers:
        return config
    from snapfn.handler.llm.models.glm_moe_dsa import mtp_layers_held

    held = mtp_layers_held(config, names)
    return config if held == config.num_mtp_layers else replace(config, num_mtp_layers=held)


def build_model(config: ModelConfig, opts: EngineOptions) -> CausalLM:
    backend = get_backend(opts.backend, opts.device)
    dtype = resolve_dtype(config, opts.dtype, opts.device)
    cls = model_class(config.arch)
    model = cls(config, backend, dtype=dtype, device=opts.device, parallel=opts.parallel)
    if opts.scheduler.speculative_tokens:
        model.use_draft_layers()  # their KV is cached: before the pool is planned
    return model


def plan_num_pages(model: CausalLM, opts: EngineOptions) -> int:
    if opts.num_pages is not None:
        return opts.num_pages
    per_page = bytes_per_page(model.kv_buffer_specs(), opts.scheduler.page_size, model.dtype)
    return max(1, opts.kv_cache_bytes // per_page)


def allocate_kv(model: CausalLM, num_pages: int, page_size: int, alloc=None) -> KVPool:
    specs = model.kv_buffer_specs()
    return KVPool(specs, num_pages, page_size, model.dtype, model.device, alloc)


@dataclass
class LoadedEngine:
    engine: Engine
    config: ModelConfig
    load_report: LoadReport


def build_engine(model_dir: Path | str, opts: EngineOptions | None = None) -> LoadedEngine:
    opts = opts or EngineOptions()
    model_dir = Path(model_dir)
    ckpt = Checkpoint.open(model_dir)
    config = as_held(ModelConfig.from_dir(model_dir), ckpt.tensors)
    model = build_model(config, opts)
    report = load_weights(model, ckpt)
    kv = allocate_kv(model, plan_num_pages(model, opts), opts.scheduler.page_size)
    tokenizer = load_tokenizer(model_dir)
    engine = Engine(model, kv, opts.scheduler, tokenizer, stop_token_ids(model_dir, tokenizer))
    return LoadedEngine(engine, config, report)
