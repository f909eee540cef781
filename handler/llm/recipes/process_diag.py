"""SNAPFN_PROCESS_DIAG=1: what a tier-1 worker still holds when it is checkpointed.

    start_recording()   at the worker's start: torch records every CUDA allocation's stack
    report()            at the checkpoint: torch's live CUDA blocks (outside the released
                        regions) with the snapfn frame that made each, and the imported packages

Diagnosis only (recording costs memory, 0.4 GB more host memory in the 8B image on the H200):
it found the cuBLAS workspaces that are now freed before the checkpoint.
"""

from __future__ import annotations

import sys


def start_recording(max_entries: int = 200_000) -> None:
    import torch

    torch.cuda.memory._record_memory_history(max_entries=max_entries)


def report() -> list[str]:
    lines = [f"live block: {line}" for line in _live_blocks()]
    top = sorted({m.split(".")[0] for m in sys.modules})
    lines.append(f"{len(sys.modules)} modules from {len(top)} packages: {' '.join(top)}")
    return lines


def _live_blocks(min_bytes: int = 1 << 20, limit: int = 40) -> list[str]:
    """Torch's live CUDA blocks of at least `min_bytes`, biggest first, each with the innermost
    snapfn frame that allocated it (needs memory history recording)."""
    import torch

    found = []
    for segment in torch.cuda.memory._snapshot()["segments"]:
        for block in segment["blocks"]:
            if block["state"] != "active_allocated" or block["size"] < min_bytes:
                continue
            frames = [f for f in block.get("frames", []) if _ours(f.get("filename", ""))]
            top = frames[0] if frames else None
            where = f"{_ours(top['filename'])}:{top['line']} {top['name']}" if top else "?"
            found.append((block["size"], f"pool {segment.get('segment_pool_id')} {where}"))
    found.sort(key=lambda sw: -sw[0])
    return [f"{size / 1e6:.1f} MB {where}" for size, where in found[:limit]]


def _ours(filename: str) -> str:
    """`filename` from handler/ or snapshot/ on ('handler/llm/x.py'), else ''."""
    for root in ("/handler/", "/snapshot/"):
        if root in filename:
            return root[1:] + filename.rsplit(root, 1)[1]
    return ""
