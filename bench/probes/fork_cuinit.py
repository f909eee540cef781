"""What a process forked from a zygote pays for CUDA's driver init and context, against a fresh
process, and what the zygote could do before forking to make it cheaper.

python3 bench/probes/fork_cuinit.py [--rounds 3]

Each case times, in the process that makes it, `dlopen("libcuda.so.1")`, `cuInit(0)` and
`cuDevicePrimaryCtxRetain` through ctypes (snapshot/cuda/early_context.py's calls):
  fresh          a fresh interpreter that imported torch first (nothing forked)
  fresh_bare     a fresh interpreter, before importing anything
  fork           forked from a parent that imported torch (a zygote's child)
  fork_dlopen    the same, the parent having dlopen'ed libcuda.so.1 (not initialised) first
  fork_frozen    the same as fork, the parent's objects frozen out of the collector first
Prints one JSON object: per case, each round's seconds per step.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import time

CASES = ("fresh", "fresh_bare", "fork", "fork_dlopen", "fork_frozen")


def time_driver(lib=None) -> dict[str, float]:
    """dlopen (unless `lib`), cuInit and the primary context's retain, each timed."""
    t0 = time.perf_counter()
    cu = lib if lib is not None else ctypes.CDLL("libcuda.so.1")
    t1 = time.perf_counter()
    assert cu.cuInit(0) == 0
    dev = ctypes.c_int()
    assert cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
    t2 = time.perf_counter()
    ctx = ctypes.c_void_p()
    assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
    t3 = time.perf_counter()
    return {"dlopen_s": t1 - t0, "cuinit_s": t2 - t1, "context_s": t3 - t2, "total_s": t3 - t0}


def in_child(prepare) -> dict[str, float]:
    """Fork; the child times the driver and sends the figures back through a pipe."""
    lib = prepare()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            os.write(w, json.dumps(time_driver(lib)).encode())
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(data)


CHILD = """
import json, sys
sys.path.insert(0, {here!r})
from fork_cuinit import time_driver
{imports}
print(json.dumps(time_driver()))
"""


def fresh(imports: str) -> dict[str, float]:
    code = CHILD.format(here=os.path.dirname(os.path.abspath(__file__)), imports=imports)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    results: dict[str, list] = {case: [] for case in CASES}
    for _ in range(args.rounds):
        results["fresh"].append(fresh("import torch"))
        results["fresh_bare"].append(fresh(""))
        # each forked case from its own parent: a fresh interpreter that imports torch first
        for case in ("fork", "fork_dlopen", "fork_frozen"):
            out = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--parent", case],
                capture_output=True,
                text=True,
                check=True,
            )
            results[case].append(json.loads(out.stdout.splitlines()[-1]))
    summary = {
        case: {k: round(min(r[k] for r in runs), 4) for k in runs[0]}
        for case, runs in results.items()
    }
    print(json.dumps({"min_over_rounds": summary, "rounds": results}, indent=1))


def parent(case: str) -> None:
    import torch  # noqa: F401  (the zygote's heavy import)

    def prepare():
        if case == "fork_dlopen":
            return ctypes.CDLL("libcuda.so.1")
        if case == "fork_frozen":
            gc.collect()
            gc.freeze()
        return None

    print(json.dumps(in_child(prepare)))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--parent":
        parent(sys.argv[2])
    else:
        main()
