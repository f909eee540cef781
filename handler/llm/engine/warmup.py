"""Warmup: run every shape the engine will use once, so JIT compilation, autotuning and lazy
kernel loading happen during init, not in the first request.

Decode shapes are the graph buckets (one token per request, all reading the scratch page);
prefill shapes are the configured chunk sizes. Nothing here touches a real request's pages.
"""

from __future__ import annotations

import torch

from snapfn.handler.llm.engine.batch import ForwardBatch
from snapfn.handler.llm.engine.kv_pool import KVPool
from snapfn.handler.llm.engine.memory import dummy_prefill
from snapfn.handler.llm.models.base import CausalLM


def scratch_decode_batch(kv: KVPool, batch_size: int, device: torch.device) -> ForwardBatch:
    """`batch_size` one-token requests that read and write only the KV pool's scratch page."""
    page = kv.scratch_page
    return ForwardBatch.build(
        [[0]] * batch_size, [0] * batch_size, [[page]] * batch_size, kv.page_size, device
    )


@torch.inference_mode()
def warmup(
    model: CausalLM, kv: KVPool, decode_batches: list[int], chunk_sizes: tuple[int, ...]
) -> dict:
    shapes = []
    for b in decode_batches:
        model(scratch_decode_batch(kv, b, model.device), kv)
        shapes.append(f"decode{b}")
    for n in chunk_sizes:
        pages = kv.allocator.allocate(kv.pages_for(n))
        if pages is None:
            continue  # a chunk larger than the whole pool can never be scheduled
        try:
            dummy_prefill(model, kv, n, pages)
        finally:
            kv.allocator.free(pages)
        shapes.append(f"prefill{n}")
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    return {"shapes": len(shapes), "shape_list": shapes}
