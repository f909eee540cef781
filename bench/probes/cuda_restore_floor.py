"""What the CUDA driver's checkpoint and restore cost by themselves (device probe): a child
process holding a CUDA context in a given state is locked, checkpointed, restored and unlocked
in place (no criu) three times, each call timed from this process.

python3 bench/probes/cuda_restore_floor.py      (on a GPU machine; prints one JSON object)

States, each in its own child: "context" (torch.zeros(1) on the GPU), "matmul" (+ a cuBLAS
matmul, workspaces cleared), "graph" (+ a captured 8-layer float16 graph of 4096², replayed),
"graph_stack256" (the same with the CUDA stack limit lowered to 256 bytes first, as snapfn does
before a checkpoint), "graph_1gb" (+ 1 GB of device memory held outside any pool).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

from snapfn.snapshot.cuda import checkpoint

CHILD = r"""
import sys, torch
state = sys.argv[1]
x = torch.zeros(1, device="cuda")
keep = []
if state != "context":
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    (a @ a).sum().item()
if state.startswith("graph"):
    layers = [torch.randn(4096, 4096, device="cuda", dtype=torch.float16) * 0.01 for _ in range(8)]
    inp = torch.zeros(8, 4096, device="cuda", dtype=torch.float16)
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y = inp
        for w in layers: y = y @ w
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = inp
        for w in layers: y = y @ w
    g.replay(); keep += [layers, inp, g]
if state == "graph_1gb":
    keep.append(torch.empty(1 << 30, dtype=torch.uint8, device="cuda"))
torch.cuda.synchronize()
torch._C._cuda_clearCublasWorkspaces(); torch.cuda.empty_cache()
if state == "graph_stack256":
    from cuda.bindings import driver as cu
    cu.cuCtxSetLimit(cu.CUlimit.CU_LIMIT_STACK_SIZE, 256)
free, total = torch.cuda.mem_get_info()
print((total - free), flush=True)
sys.stdin.readline()
if state.startswith("graph"):
    if state == "graph_stack256":
        cu.cuCtxSetLimit(cu.CUlimit.CU_LIMIT_STACK_SIZE, 1024)
    g.replay(); torch.cuda.synchronize()
print("ok", flush=True)
"""


def probe(state: str) -> dict:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, state],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    used = int(child.stdout.readline())
    rounds = []
    for _ in range(3):
        t = {"lock": checkpoint.lock(child.pid), "checkpoint": checkpoint.checkpoint(child.pid)}
        start = time.perf_counter()
        t["restore"] = checkpoint.restore(child.pid)
        t["unlock"] = checkpoint.unlock(child.pid)
        t["restore_and_unlock_wall"] = time.perf_counter() - start
        rounds.append({k: round(v, 4) for k, v in t.items()})
    child.stdin.write("go\n")
    child.stdin.flush()
    replay = child.stdout.readline().strip()
    child.wait(timeout=60)
    return {"device_in_use_bytes": used, "rounds": rounds, "after": replay}


if __name__ == "__main__":
    states = sys.argv[1:] or ["context", "matmul", "graph", "graph_stack256", "graph_1gb"]
    print(json.dumps({state: probe(state) for state in states}, indent=1))
