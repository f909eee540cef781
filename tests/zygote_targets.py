"""Worker targets for tests/test_zygote.py, preloaded by the zygotes it starts.

Each is `target(args, channel)`; none imports torch, so a zygote that did not preload it stays
light.
"""

from __future__ import annotations

import os
import random
import sys
import time


def report(args, channel):
    """Send what a worker sees right after fork: preloaded modules, CUDA state, its identity."""
    torch = sys.modules.get("torch")
    channel.send(
        {
            "since_request_s": time.monotonic() - args["t_request"],
            "torch_loaded": torch is not None,
            "cuda_initialized": torch is not None and torch.cuda.is_initialized(),
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "sid": os.getsid(0),
            "random": random.random(),
            "env": os.environ.get("ZYGOTE_TEST_FLAG"),
        }
    )


PRELOADED_CALLS = []  # what `preload_call` appended: a preload entry's call, made before fork


def preload_call():
    PRELOADED_CALLS.append(os.getpid())


def preloaded_calls(args, channel):
    """Send what the zygote's `zygote_targets:preload_call` entry left behind."""
    channel.send({"calls": PRELOADED_CALLS, "ppid": os.getppid()})


def echo(args, channel):
    """Send back every message until the requester closes its end, then a count."""
    count = 0
    while (message := channel.recv()) is not None:
        channel.send({"echo": message, "tag": args.get("tag")})
        count += 1
    print(f"echoed {count}", flush=True)


def fail(args, channel):
    raise ValueError(f"boom {args['n']}")


def exit_with(args, channel):
    sys.exit(args["code"])


def sleep(args, channel):
    """Say it started, then sleep `seconds` (forever by default)."""
    channel.send({"started": os.getpid()})
    time.sleep(args.get("seconds", 3600))


def use_cuda(args, channel):
    """Initialise CUDA after fork and compute on the GPU (GPU tests only)."""
    import torch

    torch.set_num_threads(1)
    x = torch.arange(4.0, device="cuda")
    channel.send({"sum": float((x * 2).sum()), "cuda_initialized": torch.cuda.is_initialized()})
