"""Helpers for parity tests against Hugging Face transformers (a test dependency)."""

from __future__ import annotations

import torch

from snapfn.handler.llm.build import EngineOptions, build_engine
from snapfn.handler.llm.engine.batch import ForwardBatch
from snapfn.handler.llm.engine.engine import SchedulerConfig
from snapfn.handler.llm.engine.request import SamplingParams


def our_engine(model_dir, page_size=4, num_pages=256, max_tokens=2048, dtype="float32", **sched):
    opts = EngineOptions(
        dtype=dtype,
        num_pages=num_pages,
        scheduler=SchedulerConfig(page_size=page_size, max_num_batched_tokens=max_tokens, **sched),
    )
    return build_engine(model_dir, opts).engine


def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def our_prefill_logits(engine, ids: list[int], chunk: int) -> torch.Tensor:
    """Logits at every position, computed chunk by chunk through the paged cache."""
    pages = engine.kv.allocator.allocate(engine.kv.pages_for(len(ids)))
    out = []
    try:
        for start in range(0, len(ids), chunk):
            piece = ids[start : start + chunk]
            batch = ForwardBatch.build(
                [piece], [start], [pages], engine.kv.page_size, "cpu", all_logits=True
            )
            out.append(engine.model(batch, engine.kv))
    finally:
        engine.kv.allocator.free(pages)
    return torch.cat(out)


@torch.inference_mode()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


@torch.inference_mode()
def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    x = torch.tensor([ids])
    out = model.generate(
        x,
        attention_mask=torch.ones_like(x),  # token 0 in a prompt is not padding
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    return out[0, len(ids) :].tolist()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def random_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
