"""A small process-snapshot host for the tier-1 tests: state worth keeping, weights kept out.

It holds a "weights" tensor in a releasable CPU region (released before the snapshot, streamed
back from a file after each restore, like the LLM's), a counter and a random draw made at init,
and answers:  {"op": "state"} → its state;  {"op": "add", "n"} → counter += n.
`args["fail_at"]` injects a failure at "init", "before_snapshot" or "after_restore".
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Any

import torch

from snapfn.snapshot.vmm import Arena, allocate_region

WEIGHT_ELEMS = 1 << 20  # 4 MiB of float32


class CounterHost:
    uses_cuda = False

    def __init__(self, args: dict[str, Any]) -> None:
        self.args = args
        self.counter = 0
        self.region = self.weights = None
        self.init_draw = None

    def init(self) -> dict[str, Any]:
        self._maybe_fail("init")
        self.region = allocate_region(WEIGHT_ELEMS * 4, "cpu")
        self.weights = Arena(self.region).take((WEIGHT_ELEMS,), torch.float32)
        self.weights.copy_(torch.arange(WEIGHT_ELEMS, dtype=torch.float32))
        Path(self.args["weights_file"]).write_bytes(self.weights.numpy().tobytes())
        self.init_draw = random.random()
        self.counter = int(self.args.get("start", 0))
        return {"function": "counter", "pid": os.getpid(), "draw": self.init_draw}

    def before_snapshot(self) -> list[str]:
        self._maybe_fail("before_snapshot")
        self.region.release()
        return ["release_weights"]

    def after_restore(self, resume: dict[str, Any]) -> dict[str, Any]:
        self._maybe_fail("after_restore")
        start = time.time()
        zero_after_restore = float(self.weights.sum())
        self.region.remap()
        data = Path(resume["weights_file"]).read_bytes()
        self.weights.copy_(torch.frombuffer(bytearray(data), dtype=torch.float32))
        figures = {"zero_after_restore": zero_after_restore, "bytes": len(data)}
        seconds = time.time() - start
        stage = {"name": "stream_weights", "start_s": 0.0, "seconds": seconds, "figures": figures}
        return {"t0": start, "stages": [stage]}

    def handle(self, message: dict[str, Any], send) -> None:
        if message["op"] == "add":
            self.counter += int(message["n"])
        if message["op"] not in ("add", "state"):
            raise ValueError(f"unknown op {message['op']!r}")
        send(
            {
                "id": message["id"],
                "event": "result",
                "counter": self.counter,
                "init_draw": self.init_draw,
                "draw": random.random(),
                "weights_sum": float(self.weights.double().sum()),
                "resident_bytes": self.region.resident_bytes(),
            }
        )

    def close(self) -> None:
        pass

    def _maybe_fail(self, step: str) -> None:
        if self.args.get("fail_at") == step:
            raise RuntimeError(f"injected failure at {step}")


def make(args: dict[str, Any]) -> CounterHost:
    return CounterHost(args)
