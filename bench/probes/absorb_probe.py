"""MLA's absorbed products at GLM-5's widths (device probe): `triton_absorb` over the FP8 `kv_b`
as stored, config by config and autotuned, against what the engine runs without it
(`torch_ref.absorb_query` / `expand_output`: two bmms over a dense bf16 copy of `kv_b`).

python3 bench/probes/absorb_probe.py [--tokens 1,2,4,8,16] [--reps 40]

One layer's products per call (64 heads, `W_k` 192 rows and `W_v` 256 rows a head over a rank of
512: `kv_b` 14.7 MB in FP8, 29.4 MB dense bf16), each variant timed as a CUDA graph of `reps`
calls (`graph_timing.graph_us`) cycling over enough copies of `kv_b` that none is still in L2
when it is read again. Prints one JSON object per token count: the bmms' and the tuned
kernels' microseconds (both products together) and bandwidth (the bytes each reads of its
`kv_b` / time), each config's microseconds per product, and the kernels' largest difference
from the float32 products relative to their largest value.
"""

from __future__ import annotations

import argparse
import json

import torch
from graph_timing import graph_us

from snapfn.handler.llm.kernels.torch_ref import absorb_query, expand_output
from snapfn.handler.llm.kernels.triton import absorb as triton_absorb
from snapfn.handler.llm.weights.quant import dequantize_fp8_block, quantize_fp8_block

HEADS, NOPE, ROPE, RANK, DV = 64, 192, 64, 512, 256  # GLM-5's MLA
L2_BYTES = 60 << 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", default="1,2,4,8,16")
    parser.add_argument("--reps", type=int, default=40)
    args = parser.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    rows = HEADS * (NOPE + DV)
    copies = max(2, -(-4 * L2_BYTES // (rows * RANK)))  # of the FP8 kv_b; the dense twice as big
    fp8 = [quantize_fp8_block(torch.randn(rows, RANK, device=dev) / 16) for _ in range(copies)]
    dense = [dequantize_fp8_block(q, s, torch.bfloat16) for q, s in fp8]
    for tokens in [int(t) for t in args.tokens.split(",")]:
        q = torch.randn(tokens, HEADS, NOPE + ROPE, device=dev, dtype=torch.bfloat16)
        o = torch.randn(tokens, HEADS, RANK, device=dev, dtype=torch.bfloat16)
        row = {"tokens": tokens, "heads": HEADS, "nope": NOPE, "rank": RANK, "dv": DV}
        row.update(probe(q, o, fp8, dense, args.reps))
        print(json.dumps(row), flush=True)


def probe(q, o, fp8, dense, reps: int) -> dict:
    copies = len(fp8)

    def bmms(i: int) -> None:
        _, _, w_v = absorb_query(q, dense[i], RANK, ROPE)
        expand_output(o, w_v)

    def kernels(i: int) -> None:
        weight, scale = fp8[i]
        triton_absorb.absorb_query(q, weight, scale, ROPE)
        triton_absorb.expand_output(o, weight, scale, NOPE)

    bmm_us = graph_us(bmms, reps, copies)
    tuned_us = graph_us(kernels, reps, copies)
    out = {
        "bmm_us": round(bmm_us, 2),
        "bmm_tbps": round(dense[0].numel() * 2 / bmm_us / 1e6, 2),
        "tuned_us": round(tuned_us, 2),
        "tuned_tbps": round(fp8[0][0].numel() / tuned_us / 1e6, 2),
        "configs": configs(q, o, fp8, reps),
    }
    return out | {"tuned_rel_err": rel_err(q, o, *fp8[0])}


def configs(q, o, fp8, reps: int) -> dict:
    """Each product's configs alone, forced (the untuned kernel): microseconds per call."""
    products = {
        "absorb": (triton_absorb._absorb_tuned, lambda i, c: triton_absorb.absorb_query(q, *fp8[i], ROPE, c)),
        "expand": (triton_absorb._expand_tuned, lambda i, c: triton_absorb.expand_output(o, *fp8[i], NOPE, c)),
    }  # fmt: skip
    timed = {}
    for name, (tuned, run) in products.items():
        for config in tuned.configs:
            label = f"{name}:" + "x".join(str(v) for v in config.kwargs.values())
            label += f"w{config.num_warps}"
            us = graph_us(lambda i, c=config, r=run: r(i, c), reps, len(fp8))
            timed[label] = round(us, 2)
    return timed


def rel_err(q, o, weight, scale) -> float:
    """The tuned kernels' largest difference from float32 products over the float32 kv_b,
    relative to the products' largest value."""
    w = dequantize_fp8_block(weight, scale, torch.float32)
    want_q, _, w_v = absorb_query(q.float(), w, RANK, ROPE)
    want_o = expand_output(o.float(), w_v)
    got_q = triton_absorb.absorb_query(q, weight, scale, ROPE).float()
    got_o = triton_absorb.expand_output(o, weight, scale, NOPE).float()
    errs = [
        (got - want).abs().max() / want.abs().max()
        for got, want in ((got_q, want_q), (got_o, want_o))
    ]
    return round(max(errs).item(), 5)


if __name__ == "__main__":
    main()
