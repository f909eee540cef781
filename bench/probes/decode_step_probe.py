"""Decode attention and greedy picks (device probe): what runs between a decode step's GEMVs.

python3 bench/probes/decode_step_probe.py [--batches 1,8,32,64] [--contexts 40,512,4096]

Attention: flashinfer's decode wrapper in its CUDA-graph mode (what `FlashInferBackend` replays)
against the Triton split-KV kernel (`triton_attention`), both through `FlashInferBackend`'s
`paged_attention` with a page-table row as wide as the graphs' (`--width` pages), the 8B llama's
heads (32 query, 8 KV, head dim 128, bf16). Each is timed as a CUDA graph of one call per
"layer", each layer its own cache (as many layers as keep the caches out of L2, up to 32).
Picks: `sampler.greedy_picks` (torch) against `triton_sampling.greedy_picks` over a 128,256
vocabulary. Prints one JSON object per line.
"""

from __future__ import annotations

import argparse
import json

import torch
from graph_timing import graph_us

from snapfn.handler.llm.engine.batch import ForwardBatch
from snapfn.handler.llm.engine.sampler import greedy_picks
from snapfn.handler.llm.kernels.flashinfer.backend import FlashInferBackend
from snapfn.handler.llm.kernels.triton import sampling as triton_sampling

HQ, HKV, D, PAGE = 32, 8, 128, 16
L2_BYTES = 60 << 20


def attention(batch_size: int, context: int, width: int) -> dict:
    dev = torch.device("cuda")
    pages_each = -(-context // PAGE)
    kv_bytes = batch_size * pages_each * PAGE * HKV * D * 2 * 2
    layers = max(2, min(32, -(-4 * L2_BYTES // kv_bytes)))
    num_pages = batch_size * pages_each + 1
    caches = [
        (
            torch.randn(num_pages, PAGE, HKV, D, device=dev, dtype=torch.bfloat16),
            torch.randn(num_pages, PAGE, HKV, D, device=dev, dtype=torch.bfloat16),
        )
        for _ in range(layers)
    ]
    tables = [
        list(range(1 + r * pages_each, 1 + (r + 1) * pages_each)) + [0] * (width - pages_each)
        for r in range(batch_size)
    ]
    batch = ForwardBatch.build([[1]] * batch_size, [context - 1] * batch_size, tables, PAGE, dev)
    q = torch.randn(batch_size, HQ, D, device=dev, dtype=torch.bfloat16)
    row = {"what": "attention", "batch": batch_size, "context": context, "layers": layers}
    outs = {}
    for name in ("flashinfer", "triton"):
        backend = FlashInferBackend(decode_attention=name)
        backend.begin_forward(batch, graph=True)

        def call(i, backend=backend):
            k, v = caches[i % layers]
            return backend.paged_attention(q, k, v, batch, D**-0.5)

        outs[name] = call(0).float()
        row[f"{name}_us"] = round(graph_us(call, layers), 2)
    row["max_diff"] = round((outs["flashinfer"] - outs["triton"]).abs().max().item(), 5)
    row["triton_speedup"] = round(row["flashinfer_us"] / row["triton_us"], 3)
    return row


def picks(batch_size: int, vocab: int = 128256) -> dict:
    logits = torch.randn(batch_size, vocab, device="cuda") * 3
    want_tokens, want = greedy_picks(logits)
    got_tokens, got = triton_sampling.greedy_picks(logits)
    return {
        "what": "greedy_picks",
        "batch": batch_size,
        "torch_us": round(graph_us(lambda i: greedy_picks(logits), 8), 2),
        "triton_us": round(graph_us(lambda i: triton_sampling.greedy_picks(logits), 8), 2),
        "tokens_equal": bool(torch.equal(want_tokens, got_tokens)),
        "logprob_diff": (want[:, 1] - got[:, 1]).abs().max().item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--contexts", default="40,512,4096")
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    for b in batches:
        print(json.dumps(picks(b)), flush=True)
    for b in batches:
        for context in [int(c) for c in args.contexts.split(",")]:
            print(json.dumps(attention(b, context, args.width)), flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
