"""A small process-snapshot host for the tier-1 tests: state worth keeping, weights kept out.

It holds a "weights" tensor in a releasable CPU region (released before the snapshot, streamed
back from a file after each restore, like the LLM's), a counter and a random draw made at init,
and answers:  {"op": "state"} → its state;  {"op": "add", "n"} → counter += n;
{"op": "heap", "value"} → whether `args["heap_mb"]` of random bytes made at init are unchanged,
then the first byte of each of its pages set to `value`.
`args["fail_at"]` injects a failure at "init", "before_snapshot" or "after_restore".
`args["abstract_socket"]`: a unix socket bound to that abstract name at init and kept (what the
CUDA driver holds in a GPU worker: two copies restored in one network namespace collide on it).
"""

from __future__ import annotations

import hashlib
import os
import random
import time
from pathlib import Path
from typing import Any

import torch

from snapfn.snapshot.cuda.regions import Arena, allocate_region

WEIGHT_ELEMS = 1 << 20  # 4 MiB of float32 by default (args["weight_mb"])


class CounterHost:
    def __init__(self, args: dict[str, Any]) -> None:
        self.args = args
        self.uses_cuda = bool(args.get("claim_cuda"))  # injection: pretend to hold a GPU
        self.counter = 0
        self.region = self.weights = None
        self.init_draw = None
        self.heap, self.heap_sha = bytearray(), ""

    def init(self) -> dict[str, Any]:
        self._maybe_fail("init")
        request_prefix()  # the engine's request module is loaded (and registered) at init
        elems = int(self.args.get("weight_mb", 4)) << 18
        self.region = allocate_region(elems * 4, "cpu")
        self.weights = Arena(self.region).take((elems,), torch.float32)
        self.weights.copy_(torch.arange(elems, dtype=torch.float32))
        Path(self.args["weights_file"]).write_bytes(self.weights.numpy().tobytes())
        self.init_draw = random.random()
        self.heap = bytearray(os.urandom(int(self.args.get("heap_mb", 0)) << 20))
        self.heap_sha = hashlib.sha256(self.heap).hexdigest()
        self.counter = int(self.args.get("start", 0))
        if self.args.get("abstract_socket"):
            import socket

            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.bind("\0" + self.args["abstract_socket"])
            self.sock.listen(1)
        from snapfn.snapshot.portable.compat import compat_key
        from snapfn.snapshot.stages import StartupManifest

        startup = StartupManifest(kind="init", tier="cold", ok=True)
        return {
            "function": "counter",
            "startup": startup.to_json(),
            "compat": compat_key("cpu", 1),
            "section": {"pid": os.getpid(), "draw": self.init_draw},
        }

    def before_snapshot(self) -> list[str]:
        self._maybe_fail("before_snapshot")
        if not self.args.get("keep_weights"):
            self.region.release()
        return ["release_weights"]

    def after_restore(self, resume: dict[str, Any]) -> dict[str, Any]:
        self._maybe_fail("after_restore")
        time.sleep(float(resume.get("sleep_s", 0)))
        start = time.time()
        zero_after_restore = float(self.weights.sum())
        self.region.remap()
        data = Path(self.args["weights_file"]).read_bytes()
        self.weights.copy_(torch.frombuffer(bytearray(data), dtype=torch.float32))
        figures = {"zero_after_restore": zero_after_restore, "bytes": len(data)}
        seconds = time.time() - start
        stage = {"name": "stream_weights", "start_s": 0.0, "seconds": seconds, "figures": figures}
        return {"t0": start, "stages": [stage]}

    def handle(self, message: dict[str, Any], send) -> None:
        if message["op"] == "add":
            self.counter += int(message["n"])
        if message["op"] == "heap":
            unchanged = hashlib.sha256(self.heap).hexdigest() == self.heap_sha
            self.heap[::4096] = bytes([int(message["value"])]) * len(self.heap[::4096])
            heap = {"address": _address(self.heap), "unchanged": unchanged}
            send({"id": message["id"], "event": "result", **heap, "first": self.heap[0]})
            return
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
                "request_prefix": request_prefix(),
            }
        )

    def close(self) -> None:
        pass

    def _maybe_fail(self, step: str) -> None:
        if self.args.get("fail_at") == step:
            raise RuntimeError(f"injected failure at {step}")


def _address(buffer: bytearray) -> int:
    import ctypes

    return ctypes.addressof((ctypes.c_char * len(buffer)).from_buffer(buffer))


def request_prefix() -> str:
    from snapfn.handler.llm.engine import request

    return request.Request([1], request.SamplingParams()).request_id.rsplit("-", 1)[0]


def make(args: dict[str, Any]) -> CounterHost:
    return CounterHost(args)


def perturbed_llm(args: dict[str, Any]):
    """The built-in LLM host whose restored weights differ from the init's (final norm scaled
    after streaming): the replay check must catch it."""
    from snapfn.handler.llm.recipes.process_host import LLMProcessHost

    class PerturbedLLMHost(LLMProcessHost):
        def _stream(self, figures, path, ring):
            super()._stream(figures, path, ring)
            dict(self.fn.model.named_parameters())["model.norm.weight"].data *= 1.5

    return PerturbedLLMHost(args)
