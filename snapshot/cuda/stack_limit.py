"""The CUDA stack limit, lowered for a checkpoint and set back after each restore.

    limit = StackLimit()
    figures = limit.lower()      before the checkpoint, in the worker (torch made the context)
    limit.restore()              after the CUDA restore, before any kernel runs

A context keeps local memory for the largest stack its kernels used (1 KiB a thread by default:
0.2 GB on the H200, probe bench/probes/context_memory.py), and the CUDA checkpoint copies that
memory into the process image (1.77 → 1.57 GB for the 8B llama). SNAPFN_PROCESS_STACK_BYTES
(default 256; 0 keeps the limit) is what the checkpoint sees. Restored graphs failed
("unspecified launch failure", H200) when the limit stayed low, so `restore` sets the old one
back first thing.
"""

from __future__ import annotations

import os

DEFAULT_STACK_BYTES = 256


class StackLimit:
    def __init__(self) -> None:
        self.before = 0  # the limit the checkpoint lowered, if it did

    def lower(self) -> dict[str, int]:
        """Lower the current context's limit; the figures ({} when it was left alone)."""
        want = int(os.environ.get("SNAPFN_PROCESS_STACK_BYTES", str(DEFAULT_STACK_BYTES)))
        if want <= 0:
            return {}
        import torch
        from cuda.bindings import driver as cu  # NOTE: no cuInit here: torch made the context

        limit = cu.CUlimit.CU_LIMIT_STACK_SIZE
        err, before = cu.cuCtxGetLimit(limit)
        if int(err) != 0 or int(before) <= want:
            return {}
        free = torch.cuda.mem_get_info()[0]
        if int(cu.cuCtxSetLimit(limit, want)[0]) != 0:
            return {}
        self.before = int(before)
        return {"stack_bytes": want, "stack_freed_bytes": torch.cuda.mem_get_info()[0] - free}

    def restore(self) -> None:
        if not self.before:
            return
        from cuda.bindings import driver as cu

        from snapfn.snapshot.cuda.driver import ok

        limit = cu.CUlimit.CU_LIMIT_STACK_SIZE
        ok(cu.cuCtxSetLimit(limit, self.before), "cuCtxSetLimit (the stack limit back)")
