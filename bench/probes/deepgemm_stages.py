"""Probe (GPU): where does DeepGEMM's first FP8 GEMM crash? Each stage runs in its own child
process, so a segfault in one does not hide the next, with DG_JIT_DEBUG=1 (DeepGEMM prints its
JIT compile, load and launch steps) and, where SEGV_SO names a built segv_backtrace.c, that
preloaded to print the native stack.

Stages, from least to most of DeepGEMM's machinery:
- import: `import deep_gemm`, device runtime queries (arch, SM count);
- cublaslt: `cublaslt_gemm_nt` in bf16 (no JIT);
- sf_layout: `transform_sf_into_required_layout` of 1x128 fp32 activation scales (a JIT kernel);
- bf16_gemm: `bf16_gemm_nt` m=128 (a JIT GEMM, no scales);
- fp8_m128 / fp8_m1: `fp8_gemm_nt` with scales cast by deep_gemm.utils (their tests' way) and
  `disable_ue8m0_cast=True` (fp32 scales on SM90);
- grouped: `m_grouped_fp8_gemm_nt_contiguous`.

Usage: python3 bench/probes/deepgemm_stages.py [--stages a,b] [--timeout S] > log
Prints one JSON line per stage: rc, seconds, error relative to a float32 reference where it ran,
and the last lines of the child's output.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

CHILD = r"""
import sys, time, torch
stage = sys.argv[1]
t0 = time.perf_counter()
import deep_gemm
from deep_gemm.utils import per_token_cast_to_fp8, per_block_cast_to_fp8
print("imported", deep_gemm.__version__, "sms", deep_gemm.get_num_sms(), flush=True)
dev = "cuda"

def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-9))

def deq_rows(q, s):
    m, k = q.shape
    return (q.float().view(m, k // 128, 128) * s.float()[..., None]).view(m, k)

def deq_blocks(q, s):
    n, k = q.shape
    return (q.float().view(n // 128, 128, k // 128, 128) * s.float()[:, None, :, None]).view(n, k)

res = {}
if stage == "cublaslt":
    a = torch.randn(128, 1024, device=dev, dtype=torch.bfloat16)
    b = torch.randn(512, 1024, device=dev, dtype=torch.bfloat16)
    d = torch.empty(128, 512, device=dev, dtype=torch.bfloat16)
    deep_gemm.cublaslt_gemm_nt(a, b, d)
    res["err"] = rel(d, a.float() @ b.float().T)
elif stage == "sf_layout":
    x = torch.randn(128, 1024, device=dev, dtype=torch.bfloat16)
    _, s = per_token_cast_to_fp8(x, use_ue8m0=False)
    t = deep_gemm.transform_sf_into_required_layout(s, 128, 1024, (1, 128), disable_ue8m0_cast=True)
    res["shape"], res["stride"] = list(t.shape), list(t.stride())
    res["same"] = bool(torch.equal(t.contiguous(), s.contiguous()))
elif stage == "bf16_gemm":
    a = torch.randn(128, 1024, device=dev, dtype=torch.bfloat16)
    b = torch.randn(512, 1024, device=dev, dtype=torch.bfloat16)
    d = torch.empty(128, 512, device=dev, dtype=torch.bfloat16)
    deep_gemm.bf16_gemm_nt(a, b, d)
    res["err"] = rel(d, a.float() @ b.float().T)
elif stage.startswith("fp8_m"):
    m = int(stage[len("fp8_m"):])
    n, k = 4096, 7168
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
    xq, xs = per_token_cast_to_fp8(x, use_ue8m0=False)
    wq, ws = per_block_cast_to_fp8(w, use_ue8m0=False)
    print("xs", tuple(xs.shape), xs.dtype, "ws", tuple(ws.shape), ws.dtype, flush=True)
    d = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    deep_gemm.fp8_gemm_nt((xq, xs), (wq, ws), d, disable_ue8m0_cast=True)
    torch.cuda.synchronize()
    res["err"] = rel(d, deq_rows(xq, xs) @ deq_blocks(wq, ws).T)
    t1 = time.perf_counter()
    for _ in range(20):
        deep_gemm.fp8_gemm_nt((xq, xs), (wq, ws), d, disable_ue8m0_cast=True)
    torch.cuda.synchronize()
    res["us"] = round((time.perf_counter() - t1) / 20 * 1e6, 1)
elif stage == "grouped":
    align = deep_gemm.get_mk_alignment_for_contiguous_layout()
    g, n, k = 8, 4096, 2048
    counts = [align * (i % 3 + 1) for i in range(g)]
    layout = torch.cat([torch.full((c,), i, dtype=torch.int32) for i, c in enumerate(counts)]).to(dev)
    m = sum(counts)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(g, n, k, device=dev, dtype=torch.bfloat16) / k**0.5
    xq, xs = per_token_cast_to_fp8(x, use_ue8m0=False)
    parts = [per_block_cast_to_fp8(w[i], use_ue8m0=False) for i in range(g)]
    wq = torch.stack([p[0] for p in parts]); ws = torch.stack([p[1] for p in parts])
    d = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    deep_gemm.m_grouped_fp8_gemm_nt_contiguous((xq, xs), (wq, ws), d, layout, disable_ue8m0_cast=True)
    xd = deq_rows(xq, xs)
    ref = torch.cat([xd[layout == i] @ deq_blocks(wq[i], ws[i]).T for i in range(g)])
    res["err"] = rel(d, ref)
    res["align"] = align
torch.cuda.synchronize()
res["s"] = round(time.perf_counter() - t0, 2)
print("RESULT", __import__("json").dumps(res), flush=True)
"""

STAGES = ["import", "cublaslt", "sf_layout", "bf16_gemm", "fp8_m128", "fp8_m1", "grouped"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", default=",".join(STAGES))
    ap.add_argument("--timeout", type=float, default=120)
    args = ap.parse_args()
    env = dict(os.environ, DG_JIT_DEBUG=os.environ.get("DG_JIT_DEBUG", "1"))
    if os.environ.get("SEGV_SO"):
        env["LD_PRELOAD"] = os.environ["SEGV_SO"]
    for stage in args.stages.split(","):
        t0 = time.perf_counter()
        try:
            p = subprocess.run(
                [sys.executable, "-c", CHILD, stage],
                env=env,
                capture_output=True,
                text=True,
                timeout=args.timeout,
            )
            rc, text = p.returncode, p.stdout + p.stderr
        except subprocess.TimeoutExpired as e:
            rc = "timeout"
            text = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(
                errors="replace"
            )
        result = None
        for line in text.splitlines():
            if line.startswith("RESULT "):
                result = json.loads(line[len("RESULT ") :])
        lines = [x for x in text.splitlines() if not x.startswith("RESULT ")]
        row = dict(stage=stage, rc=rc, s=round(time.perf_counter() - t0, 1), result=result)
        row["tail"] = lines[-40:] if rc != 0 else lines[-6:]
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
