"""Where a CUDA context's device memory goes (device probe): used memory after each step.

python3 bench/probes/context_memory.py      (on a GPU machine)
"""

from __future__ import annotations

import json

import torch
from cuda.bindings import driver as cu

GB = 1e9
steps: list[tuple[str, float]] = []


def used(step: str) -> None:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    steps.append((step, round((total - free) / GB, 3)))


def limits() -> dict[str, int]:
    names = ("STACK_SIZE", "PRINTF_FIFO_SIZE", "MALLOC_HEAP_SIZE")
    return {n: int(cu.cuCtxGetLimit(getattr(cu.CUlimit, f"CU_LIMIT_{n}"))[1]) for n in names}


torch.zeros(1, device="cuda")
used("context + torch.zeros(1)")
before = limits()
a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
(a @ a).sum().item()
used("+ bf16 matmul (cuBLAS handle, workspace)")
x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
torch.nn.functional.scaled_dot_product_attention(x[None, None], x[None, None], x[None, None])
torch.softmax(x.float(), -1).sum().item()
used("+ sdpa, softmax")
del a, x
torch._C._cuda_clearCublasWorkspaces()
torch.cuda.empty_cache()
used("after clearing cuBLAS workspaces + empty_cache")
after_kernels = limits()
for size in (1024, 256):
    cu.cuCtxSetLimit(cu.CUlimit.CU_LIMIT_STACK_SIZE, size)
    used(f"stack size limit set to {size}")
print(
    json.dumps({"limits_at_start": before, "limits_after_kernels": after_kernels, "steps": steps})
)
