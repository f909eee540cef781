"""Decode-sized projections (device probe): `triton_gemv.gemv`, config by config and autotuned,
against what the engine runs without it (cuBLAS's `F.linear`, or for FP8 weights the Triton
`fp8_block_linear`, with the Triton `add_rms_norm` before it and `silu_mul` after it where the
fused kernel takes them on), on the shapes of the 8B llama and the GLM-5-shaped model (its bf16
`lm_head`, its FP8 projections: `glm5.fp8.*`).

python3 bench/probes/gemv_probe.py [--rows 1] [--reps 40] [--only llama8b.o,...]
    [--splits auto,1,4] [--configs all|fp8]
python3 bench/probes/gemv_probe.py --summarise OUT.jsonl   # each shape's 4 fastest configs
python3 bench/probes/gemv_probe.py --moe 32,256 --rows 1,2,4   # routed experts, moe_gemv vs fused
python3 bench/probes/gemv_probe.py --rows 1,2,4 --fp8-splits 1,auto,2,4,8 --only glm5.fp8.o,...

Each variant is timed as a CUDA graph of `reps` calls (the engine replays its decode steps as
graphs), cycling over enough copies of the weight that none is still in L2 when it is read
again. Prints one JSON object per (shape, rows): the unfused sequence's microseconds per call
and, at the rows `gemv` takes (`GEMV_MAX_ROWS`), the tuned kernel's and their bandwidths
(weight bytes / time), each config's microseconds, and the largest difference from the
unfused sequence relative to its largest value. `--splits` times each config and the tuned
kernel at each K split count (`auto`: `triton_gemv.split_count`'s; labels get `/sN`);
`--configs fp8` times only the configs the engine's tuner tries, `fp8-wide` those and the
sweep's tiles of 8K weights or more. `--fp8-splits 1,auto,2,4,8` times, instead of the GEMV,
the FP8 shapes' unfused sequence at each K split of `fp8_block_linear` (`unfused_by_fp8_splits`:
microseconds and the largest difference from the unsplit run). `--moe` prints one object per
(experts, rows) instead (`probe_moe`). NOTE: the output recorded in
commit 22ad861 comes from a version that ran SwiGLU as a silu_mul launch after the product by
default: its `tuned_us` is that form, `tuned_fused_swiglu_us` SwiGLU in the kernel; the
gemv-probe-rows.jsonl of bench/results/2026-12-02-h200-mtp-l16-e32-gemv-rows, from commit
40d5608, whose `gemv` took 2-4 rows in a kernel of their own (not kept: see GEMV_MAX_ROWS).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton
from graph_timing import graph_us

from snapfn.handler.llm.kernels.triton import gemv as triton_gemv
from snapfn.handler.llm.kernels.triton import kernels as triton_kernels
from snapfn.handler.llm.weights.quant import quantize_fp8_block

# (name, weight rows, K, kind): kind "add_norm" = add + RMSNorm before, "swiglu" = and SwiGLU
# after; "fp8_norm": an FP8 weight with RMSNorm (no residual) before
SHAPES = [
    ("llama8b.qkv", 6144, 4096, "add_norm"),
    ("llama8b.o", 4096, 4096, "plain"),
    ("llama8b.gate_up", 28672, 4096, "swiglu"),
    ("llama8b.down", 4096, 14336, "plain"),
    ("llama8b.lm_head", 128256, 4096, "plain"),
    ("glm5.lm_head", 154880, 6144, "plain"),
    # the GLM-5-shaped model's FP8 projections of a decode step
    ("glm5.fp8.q_a", 2048, 6144, "fp8"),
    # q_a | kv_a | indexer wk stacked, each on its own 128-row blocks
    ("glm5.fp8.qkv_a", 2048 + 640 + 128, 6144, "fp8"),
    ("glm5.fp8.q_b", 16384, 2048, "fp8"),
    ("glm5.fp8.kv_a", 576, 6144, "fp8"),
    ("glm5.fp8.o", 6144, 16384, "fp8"),
    ("glm5.fp8.indexer_wq_b", 4096, 2048, "fp8"),
    # q_b | wq_b stacked, q_a_layernorm inside: the norm with no residual
    ("glm5.fp8.q_b_wq_b", 16384 + 4096, 2048, "fp8_norm"),
    ("glm5.fp8.gate_up", 24576, 6144, "fp8_swiglu"),  # the dense layer's, with the norm
    ("glm5.fp8.down", 6144, 12288, "fp8"),
    ("glm5.fp8.shared_gate_up", 4096, 6144, "fp8"),  # the shared expert's (no norm)
    ("glm5.fp8.shared_down", 6144, 2048, "fp8"),
    # few output columns over a long K: where K splits pay
    ("glm5.fp8.indexer_wk", 128, 6144, "fp8"),
    ("glm5.fp32.weights_proj", 32, 6144, "fp32"),  # the indexer's, a float32 module
    ("glm5.fp32.router", 256, 6144, "fp32"),
]
L2_BYTES = 60 << 20
# the sweep at one row: the autotuned configs and more around them
SWEEP = triton_gemv.GEMV_ALL_CONFIGS + [
    triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w)
    for bn, bk, w in (
        (1, 2048, 4),
        (1, 4096, 8),
        (2, 256, 1),
        (4, 256, 2),
        (8, 256, 4),
        (16, 256, 8),
        (16, 1024, 8),
        (2, 4096, 8),
        # wider tiles for FP8 weights (a byte per weight: more bytes in flight per program);
        # none of these won a GLM-5 FP8 shape (bench/results/2026-11-30-h200-gemv-probe-glm5-fp8)
        (4, 1024, 4),
        (8, 1024, 8),
        (8, 2048, 8),
        (4, 2048, 8),
        (16, 2048, 8),
        (32, 512, 8),
        # with the accumulator summed in 16-element runs (`triton_kernels.lane_sums`), wide FP8
        # tiles fit in half the registers
        (8, 2048, 4),
        (16, 1024, 4),
    )
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="1")
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--only", default="", help="comma-separated shape names")
    parser.add_argument("--splits", default="auto", help="comma-separated K splits or auto")
    parser.add_argument("--configs", default="all", choices=("all", "fp8", "fp8-wide"))
    parser.add_argument(
        "--fp8-splits",
        default="",
        metavar="LIST",
        help="instead of the GEMV: the FP8 shapes' unfused sequence with `fp8_block_linear` at "
        "each K split (counts or auto, comma-separated)",
    )
    parser.add_argument(
        "--moe",
        default="",
        metavar="EXPERTS",
        help="instead: GLM-5's routed FP8 experts (comma-separated counts, top 8) at each of "
        "--rows, `moe_gemv` against `fused_moe`",
    )
    parser.add_argument(
        "--summarise",
        metavar="JSONL",
        help="print each shape's 4 fastest configs from an earlier run",
    )
    args = parser.parse_args()
    if args.summarise:
        summarise(args.summarise)
        return
    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    if args.moe:
        for experts in [int(e) for e in args.moe.split(",")]:
            for m in [int(r) for r in args.rows.split(",")]:
                print(json.dumps(probe_moe(experts, m, args.reps, dev)), flush=True)
        return
    for name, rows_w, k, kind in SHAPES:
        if args.only and name not in args.only.split(","):
            continue
        fp8, wdt = kind.startswith("fp8"), torch.float32 if kind == "fp32" else dt
        copies = max(2, -(-4 * L2_BYTES // (rows_w * k * (1 if fp8 else wdt.itemsize))))
        weights = [torch.randn(rows_w, k, device=dev, dtype=wdt) / k**0.5 for _ in range(copies)]
        scales = [None] * copies
        if fp8:  # block-quantized, as make-model writes them
            pairs = [quantize_fp8_block(w) for w in weights]
            weights, scales = [q for q, _ in pairs], [s for _, s in pairs]
        norm_w = torch.rand(k, device=dev, dtype=dt) + 0.5
        for m in [int(r) for r in args.rows.split(",")]:
            row = {"shape": name, "n": rows_w, "k": k, "kind": kind, "rows": m}
            row.update(probe(weights, scales, norm_w, kind, m, args))
            print(json.dumps(row), flush=True)
        del weights
        torch.cuda.empty_cache()


def probe_moe(num_experts: int, m: int, reps: int, dev: torch.device) -> dict:
    """GLM-5's routed experts (hidden 6144, intermediate 2048, FP8, top 8 of `num_experts`) for
    `m` tokens: `moe_gemv` (tuned) against `fused_moe`, over 16 routings drawn at random (each
    token its own 8 experts; tokens may share some), and the experts' distinct bytes read."""
    from snapfn.handler.llm.kernels.base import ExpertWeights
    from snapfn.handler.llm.kernels.triton import moe as triton_moe

    hidden, inter, topk = 6144, 2048, 8
    gate, up = (quantize_fp8_block(torch.randn(num_experts, inter, hidden, device=dev) / 80)
                for _ in "gu")  # fmt: skip
    down = quantize_fp8_block(torch.randn(num_experts, hidden, inter, device=dev) / 45)
    experts = ExpertWeights(gate[0], up[0], down[0], gate[1], up[1], down[1])
    x = torch.randn(m, hidden, device=dev, dtype=torch.bfloat16)
    routings = [
        torch.stack([torch.randperm(num_experts, device=dev)[:topk] for _ in range(m)])
        for _ in range(16)
    ]
    weights = torch.rand(m, topk, device=dev)
    distinct = sum(len(set(r.flatten().tolist())) for r in routings) / len(routings)
    expert_bytes = 3 * hidden * inter
    row = {"shape": f"glm5.moe.e{num_experts}", "rows": m, "distinct_experts": distinct}
    ref = triton_moe.fused_moe(x, experts, routings[0], weights).float()
    got = triton_moe.moe_gemv(x, experts, routings[0], weights).float()
    row["max_rel_err"] = round(((got - ref).abs().max() / ref.abs().max()).item(), 5)
    for label, fn in (("fused_moe", triton_moe.fused_moe), ("moe_gemv", triton_moe.moe_gemv)):
        us = graph_us(lambda i, f=fn: f(x, experts, routings[i], weights), reps, len(routings))
        row[f"{label}_us"] = round(us, 2)
        row[f"{label}_tbps"] = round(distinct * expert_bytes / us / 1e6, 3)
    row["speedup"] = round(row["fused_moe_us"] / row["moe_gemv_us"], 3)
    return row


def summarise(path: str) -> None:
    """One line per shape of a probe's output: its timings and its 4 fastest configs."""
    with open(path) as lines:
        rows = [json.loads(line) for line in lines]
    for row in rows:
        timed = {k: v[0] for k, v in row["configs"].items() if isinstance(v, list)}
        best = sorted(timed.items(), key=lambda kv: kv[1])[:4]
        times = {k: row[k] for k in ("unfused_us", "tuned_us", "tuned_tbps")}
        print(row["shape"], times, best)


def probe(weights: list, scales: list, norm_w: torch.Tensor, kind: str, m: int, args) -> dict:
    """One shape at `m` rows: the unfused sequence, each config and the tuned kernel at each
    split count of `args.splits`."""
    reps = args.reps
    rows_w, k = weights[0].shape
    nbytes, copies = rows_w * k * weights[0].element_size(), len(weights)
    x = torch.randn(m, k, device=norm_w.device, dtype=norm_w.dtype)
    res = torch.randn_like(x)
    normed = kind in ("add_norm", "swiglu", "fp8_swiglu", "fp8_norm")
    residual = None if kind == "fp8_norm" else res
    swiglu = kind.endswith("swiglu")
    fused = dict(norm_weight=norm_w, eps=1e-5, residual=residual) if normed else {}

    def unfused(i, fp8_splits=1):
        h = x
        if normed and residual is None:
            h = triton_kernels.rms_norm(x, norm_w, 1e-5)
        elif normed:
            h, _ = triton_kernels.add_rms_norm(x, res, norm_w, 1e-5)
        if scales[i] is None:
            y = F.linear(h.to(weights[i].dtype), weights[i])
        else:
            y = triton_kernels.fp8_block_linear(h, weights[i], scales[i], splits=fp8_splits)
        return triton_kernels.silu_mul(y) if swiglu else y

    def ours(i, config=None, splits=None):
        return triton_gemv.gemv(
            x,
            weights[i],
            swiglu=swiglu,
            weight_scale_inv=scales[i],
            config=config,
            splits=splits,
            **fused,
        )[0]

    ref = unfused(0).float()
    scale = ref.abs().max().item()
    row = {"unfused_us": round(graph_us(unfused, reps, copies), 2)}
    if args.fp8_splits and scales[0] is not None:  # the FP8 tile kernel's K splits alone
        row["fp8_auto_splits"] = triton_kernels.fp8_split_count(m, rows_w, k, x.device)
        by = {}
        for splits in [s if s == "auto" else int(s) for s in args.fp8_splits.split(",")]:
            got = unfused(0, splits).float()
            err = round((got - ref).abs().max().item() / scale, 5)
            us = graph_us(lambda i, s=splits: unfused(i, s), reps, copies)
            by[str(splits)] = [round(us, 2), err]
        row["unfused_by_fp8_splits"] = by
        row["fp8_tbps_by_splits"] = {s: round(nbytes / v[0] / 1e6, 3) for s, v in by.items()}
        return row
    auto = triton_gemv.split_count(rows_w // (2 if swiglu else 1), k, weights[0].dtype, x.device)
    row["auto_splits"] = auto
    if m > triton_gemv.GEMV_MAX_ROWS:  # the unfused sequence alone: what such a step runs
        return row
    sweep = SWEEP if m == 1 else triton_gemv.GEMV_ALL_CONFIGS
    if args.configs == "fp8":
        sweep = triton_gemv.GEMV_FP8_CONFIGS
    elif args.configs == "fp8-wide":  # and the sweep's tiles of 8K weights or more
        wide = [c for c in SWEEP if c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"] >= 8192]
        sweep = triton_gemv.GEMV_FP8_CONFIGS + [
            c for c in wide if c not in triton_gemv.GEMV_FP8_CONFIGS
        ]
    configs, tuned = {}, {}
    for splits in [auto if s == "auto" else int(s) for s in args.splits.split(",")]:
        tag = "" if splits == 1 else f"/s{splits}"
        for config in sweep:
            kw = config.kwargs
            label = f"{kw['BLOCK_N']}x{kw['BLOCK_K']}w{config.num_warps}{tag}"
            try:
                err = (ours(0, config, splits).float() - ref).abs().max().item() / scale
                us = graph_us(lambda i, c=config, s=splits: ours(i, c, s), reps, copies)
                configs[label] = [round(us, 2), round(err, 5)]
            except Exception as exc:  # a config that does not compile or fit: say why
                configs[label] = repr(exc)[:200]
        ours(0, splits=splits)  # autotune, outside the capture
        tuned[splits] = round(graph_us(lambda i, s=splits: ours(i, splits=s), reps, copies), 2)
    row["tuned_by_splits"] = tuned
    row["tuned_us"] = tuned.get(auto, min(tuned.values()))
    row["tuned_err"] = round((ours(0).float() - ref).abs().max().item() / scale, 5)
    row["unfused_tbps"] = round(nbytes / row["unfused_us"] / 1e6, 3)
    row["tuned_tbps"] = round(nbytes / row["tuned_us"] / 1e6, 3)
    row["speedup"] = round(row["unfused_us"] / row["tuned_us"], 3)
    row["configs"] = configs
    return row


if __name__ == "__main__":
    main()
