"""The memory plan: profile once, then allocate the KV pool once (SGLang / vLLM's rule).

On CUDA, `profile_memory` runs one dummy forward of the largest prefill the scheduler allows
(`max_num_batched_tokens` tokens) through a throw-away KV pool, reads the peak, and gives the
KV pool what is left of `mem_fraction_static` of the GPU after weights and that peak:

    kv_bytes = total * mem_fraction_static - weights_bytes - peak_activation_bytes
    num_pages = kv_bytes // bytes_per_page

On CPU there is nothing to profile; the pool gets a fixed byte budget. The plan is recorded in
the snapshot and a restore allocates straight from it.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass
from typing import Any

import torch

from snapfn.handler.llm.engine.batch import ForwardBatch
from snapfn.handler.llm.engine.kv_pool import KVPool, bytes_per_page
from snapfn.handler.llm.models.base import CausalLM
from snapfn.snapshot.errors import InitFailed


@dataclass(frozen=True)
class MemoryPlan:
    num_pages: int
    page_size: int
    bytes_per_page: int
    kv_bytes: int
    weights_bytes: int
    peak_activation_bytes: int
    total_bytes: int
    mem_fraction_static: float
    source: str  # "profiled" (CUDA) or "fixed budget" (CPU)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MemoryPlan:
        return cls(**data)


def weights_bytes(model: CausalLM) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def step_weights(model: CausalLM, batch: int) -> tuple[int, float]:
    """What one forward step over `batch` requests touches of the weights, for rooflines: the
    bytes read and the parameters multiplied per token. Left out: an untied embedding table (a
    row per token) and the MTP layers (not run by a step). Routed experts count by the share a
    uniform router touches: `1 - (1 - k/E)^batch` of a layer's experts are read, and `k/E` of
    them multiply each token."""
    cfg = model.config
    routed_read = routed_used = 1.0
    if cfg.moe is not None:
        share = cfg.moe.num_experts_per_tok / cfg.moe.n_routed_experts
        routed_read, routed_used = 1 - (1 - share) ** batch, share
    read, params = 0.0, 0.0
    for name, p in model.named_parameters():
        if name.startswith("mtp.") or ("embed_tokens" in name and not cfg.tie_word_embeddings):
            continue
        routed = ".mlp.experts." in f".{name}"
        read += p.numel() * p.element_size() * (routed_read if routed else 1.0)
        params += p.numel() * (routed_used if routed else 1.0)
    return int(read), params


def dummy_prefill(model: CausalLM, kv: KVPool, num_tokens: int, pages: list[int]) -> torch.Tensor:
    """One forward of `num_tokens` prompt tokens (id 0) cached in `pages`, as one prompt, or as
    several when that is longer than the model's positions: each prompt then holds the most
    whole pages that fit, as a chunk the scheduler batches would, and they use `pages` in turn.
    (A single prompt past the positions indexed beyond the RoPE table: a device-side assert on
    CUDA for a model of fewer positions than `max_num_batched_tokens`.)"""
    size, positions = kv.page_size, model.config.max_position_embeddings
    longest = positions // size * size or positions
    lengths = [min(longest, num_tokens - start) for start in range(0, num_tokens, longest)]
    counts = [kv.pages_for(n) for n in lengths]
    if sum(counts) > len(pages):
        raise ValueError(f"dummy_prefill: {len(pages)} pages cannot hold prompts of {lengths}")
    firsts = itertools.accumulate(counts, initial=0)
    tables = [pages[first : first + n] for first, n in zip(firsts, counts, strict=False)]
    batch = ForwardBatch.build(
        [[0] * n for n in lengths], [0] * len(lengths), tables, size, model.device
    )
    return model(batch, kv)


@torch.inference_mode()
def profile_memory(
    model: CausalLM, page_size: int, max_tokens: int, mem_fraction: float, cpu_kv_bytes: int
) -> MemoryPlan:
    specs = model.kv_buffer_specs()
    per_page = bytes_per_page(specs, page_size, model.dtype)
    w_bytes = weights_bytes(model)
    if model.device.type != "cuda":
        pages = max(1, cpu_kv_bytes // per_page)
        return MemoryPlan(
            pages, page_size, per_page, pages * per_page, w_bytes, 0, 0, 0.0, "fixed budget"
        )
    torch.cuda.synchronize(model.device)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(model.device)
    torch.cuda.reset_peak_memory_stats(model.device)
    num = -(-max_tokens // page_size)
    scratch = KVPool(specs, num, page_size, model.dtype, model.device)
    dummy_prefill(model, scratch, max_tokens, list(range(num)))
    torch.cuda.synchronize(model.device)
    peak = torch.cuda.max_memory_allocated(model.device) - base - scratch.num_bytes
    del scratch
    torch.cuda.empty_cache()
    _, total = torch.cuda.mem_get_info(model.device)
    kv_bytes = int(total * mem_fraction) - w_bytes - peak
    if kv_bytes < per_page * 2:
        raise InitFailed(
            f"no memory left for the KV pool: {total / 2**30:.1f} GiB x mem_fraction_static {mem_fraction} "
            f"- weights {w_bytes / 2**30:.1f} GiB - activations {peak / 2**30:.2f} GiB; "
            "raise mem_fraction_static or lower max_num_batched_tokens"
        )
    pages = kv_bytes // per_page
    return MemoryPlan(
        pages, page_size, per_page, pages * per_page, w_bytes, peak, total, mem_fraction, "profiled"
    )
