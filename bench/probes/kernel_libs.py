"""Probe (GPU): do DeepGEMM, DeepEP and FlashInfer's MLA wrapper run here, and how fast?

Prints one JSON object: for each library whether it imports (the error where not), the first
call's time (its JIT compile), checks against a float32 reference, and per-call times.
- deep_gemm: `fp8_gemm_nt` (1x128 activation / 128x128 weight block scales) at decode and
  prefill shapes, and `m_grouped_fp8_gemm_nt_contiguous` for MoE;
- deep_ep: import only (its buffers need NVSHMEM and more than one rank);
- flashinfer MLA: `BatchMLAPagedAttentionWrapper` over a latent cache viewed with page size 1
  (`[P*S, 1, R + Dr]`, ckv and kpe as strided views of it), each query attending to its own
  top-k slots — the DSA decode — against the absorbed-MLA math in float32.

Usage: python3 bench/probes/kernel_libs.py [--out FILE]
"""

# ruff: noqa: B023  (each closure is called inside the iteration that defines it)
from __future__ import annotations

import argparse
import json
import time
import traceback

import torch

DEV = "cuda"


def timed(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return round((time.perf_counter() - t0) / reps * 1e6, 1)  # us


def first_call(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, round(time.perf_counter() - t0, 3)


def quant_rows(x):
    """[m, k] -> fp8 [m, k], fp32 scales [m, k/128] (1x128 groups)."""
    m, k = x.shape
    g = x.float().view(m, k // 128, 128)
    s = g.abs().amax(-1).clamp(min=1e-4) / 448.0
    return (g / s[..., None]).to(torch.float8_e4m3fn).view(m, k), s


def quant_blocks(w):
    """[n, k] -> fp8 [n, k], fp32 scales [n/128, k/128] (128x128 blocks)."""
    n, k = w.shape
    b = w.float().view(n // 128, 128, k // 128, 128)
    s = b.abs().amax((1, 3)).clamp(min=1e-4) / 448.0
    return (b / s[:, None, :, None]).to(torch.float8_e4m3fn).view(n, k), s


def dequant_rows(q, s):
    m, k = q.shape
    return (q.float().view(m, k // 128, 128) * s[..., None]).view(m, k)


def dequant_blocks(q, s):
    n, k = q.shape
    return (q.float().view(n // 128, 128, k // 128, 128) * s[:, None, :, None]).view(n, k)


def rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-9))


def probe_deep_gemm():
    res = {}
    t0 = time.perf_counter()
    import deep_gemm

    res["import_s"] = round(time.perf_counter() - t0, 3)
    res["version"] = getattr(deep_gemm, "__version__", None)
    res["dense"] = []
    for m, n, k in [(1, 4096, 7168), (64, 24576, 1536), (2048, 7168, 2048), (4096, 4096, 7168)]:
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) / k**0.5
        xq, xs = quant_rows(x)
        wq, ws = quant_blocks(w)
        d = torch.empty(m, n, device=DEV, dtype=torch.bfloat16)
        call = lambda: deep_gemm.fp8_gemm_nt((xq, xs), (wq, ws), d)  # noqa: E731
        _, jit_s = first_call(call)
        ref = dequant_rows(xq, xs) @ dequant_blocks(wq, ws).T
        us = timed(call)
        bf16_us = timed(lambda: x @ w.T)
        res["dense"].append(
            dict(m=m, n=n, k=k, first_s=jit_s, err=rel_err(d, ref), us=us, bf16_us=bf16_us)
        )
    # grouped (MoE): G experts, each segment's rows contiguous, aligned
    align = deep_gemm.get_m_alignment_for_contiguous_layout()
    res["m_alignment"] = align
    g, n, k = 8, 4096, 2048
    counts = [align * (i % 3 + 1) for i in range(g)]
    m = sum(counts)
    layout = torch.cat([torch.full((c,), i, dtype=torch.int32) for i, c in enumerate(counts)])
    layout = layout.to(DEV)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(g, n, k, device=DEV, dtype=torch.bfloat16) / k**0.5
    xq, xs = quant_rows(x)
    parts = [quant_blocks(w[i]) for i in range(g)]
    wq = torch.stack([p[0] for p in parts])
    ws = torch.stack([p[1] for p in parts])
    d = torch.empty(m, n, device=DEV, dtype=torch.bfloat16)
    call = lambda: deep_gemm.m_grouped_fp8_gemm_nt_contiguous((xq, xs), (wq, ws), d, layout)  # noqa: E731
    _, jit_s = first_call(call)
    xd = dequant_rows(xq, xs)
    ref = torch.cat([xd[layout == i] @ dequant_blocks(wq[i], ws[i]).T for i in range(g)])
    res["grouped"] = dict(g=g, m=m, n=n, k=k, first_s=jit_s, err=rel_err(d, ref), us=timed(call))
    return res


def probe_deep_ep():
    t0 = time.perf_counter()
    import deep_ep

    return {
        "import_s": round(time.perf_counter() - t0, 3),
        "version": getattr(deep_ep, "__version__", None),
        "has_Buffer": hasattr(deep_ep, "Buffer"),
    }


def mla_reference(q_nope, q_pe, latent, slots, lens, rank, scale):
    """Per query b: softmax over its `lens[b]` slots of (q_nope.c + q_pe.k_pe) * scale, then
    the weighted sum of c. latent [N, R + Dr] (page size 1), slots [B, topk]."""
    out = torch.empty(q_nope.shape, dtype=torch.float32, device=DEV)
    for b in range(q_nope.shape[0]):
        rows = latent[slots[b, : lens[b]].long()].float()  # [L, R + Dr]
        c, kpe = rows[:, :rank], rows[:, rank:]
        s = (q_nope[b].float() @ c.T + q_pe[b].float() @ kpe.T) * scale  # [H, L]
        out[b] = torch.softmax(s, -1) @ c
    return out


def probe_flashinfer_mla():
    import flashinfer

    res = {"version": flashinfer.__version__, "cases": []}
    heads, rank, rope, page, pages = 64, 512, 64, 16, 4096
    scale = (192 + 64) ** -0.5
    cache = torch.randn(pages, page, rank + rope, device=DEV, dtype=torch.bfloat16)
    flat = cache.view(pages * page, 1, rank + rope)
    ckv, kpe = flat[..., :rank], flat[..., rank:]
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=DEV)
    for backend in ("fa2", "fa3"):
        for bsz, seq, topk in [(1, 300, 2048), (1, 5000, 2048), (8, 5000, 2048), (32, 3000, 2048)]:
            case = dict(backend=backend, batch=bsz, seq=seq, topk=topk)
            try:
                lens = [min(seq, topk)] * bsz
                slots = torch.stack(
                    [torch.randperm(pages * page, device=DEV)[:topk] for _ in range(bsz)]
                ).int()
                kv_indptr = torch.tensor(
                    [0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32
                )
                kv_indices = torch.cat([slots[b, : lens[b]] for b in range(bsz)])
                qo_indptr = torch.arange(bsz + 1, dtype=torch.int32)
                wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(ws, backend=backend)
                q_nope = torch.randn(bsz, heads, rank, device=DEV, dtype=torch.bfloat16) / 8
                q_pe = torch.randn(bsz, heads, rope, device=DEV, dtype=torch.bfloat16)

                def plan():
                    wrapper.plan(
                        qo_indptr.to(DEV),
                        kv_indptr.to(DEV),
                        kv_indices,
                        torch.tensor(lens, dtype=torch.int32, device=DEV),
                        heads,
                        rank,
                        rope,
                        1,
                        False,
                        scale,
                        torch.bfloat16,
                        torch.bfloat16,
                    )

                _, case["first_plan_s"] = first_call(plan)
                run = lambda: wrapper.run(q_nope, q_pe, ckv, kpe)  # noqa: E731
                out, case["first_run_s"] = first_call(run)
                ref = mla_reference(q_nope, q_pe, flat[:, 0], slots, lens, rank, scale)
                case["err"] = rel_err(out, ref)
                case["us"] = timed(run)
                t0 = time.perf_counter()
                for _ in range(20):
                    plan()
                case["plan_us"] = round((time.perf_counter() - t0) / 20 * 1e6, 1)
            except Exception as exc:  # noqa: BLE001 - a probe reports every failure
                case["error"] = f"{type(exc).__name__}: {exc}"[:400]
            res["cases"].append(case)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--only", help="probe this library only (deep_gemm, deep_ep, flashinfer_mla)")
    args = ap.parse_args()
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for name, fn in [
        ("deep_gemm", probe_deep_gemm),
        ("deep_ep", probe_deep_ep),
        ("flashinfer_mla", probe_flashinfer_mla),
    ]:
        if args.only and name != args.only:
            continue
        t0 = time.perf_counter()
        try:
            report[name] = fn()
        except Exception as exc:  # noqa: BLE001
            report[name] = {
                "error": f"{type(exc).__name__}: {exc}"[:600],
                "trace": traceback.format_exc()[-1500:],
            }
        report[name]["probe_s"] = round(time.perf_counter() - t0, 1)
        print(name, json.dumps(report[name])[:3000], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
