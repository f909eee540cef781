"""Triton's start-up work done ahead (kernels/triton/warm.py): in the zygote before fork, on a
side thread of a fresh restore; never initialising CUDA."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from snapfn.handler.llm.kernels.triton import warm
from snapfn.handler.llm.recipes.function import ZYGOTE_PRELOAD


def test_the_switch_reads_on_and_off_and_refuses_anything_else():
    assert warm.enabled({}) and warm.enabled({warm.VARIABLE: "on"})
    assert not warm.enabled({warm.VARIABLE: "off"})
    assert warm.warm_compiler({warm.VARIABLE: "off"}) == {"skipped": "SNAPFN_WARM_COMPILER=off"}
    with pytest.raises(ValueError, match="'on' or 'off', got '1'"):
        warm.enabled({warm.VARIABLE: "1"})


def test_without_triton_it_says_so(monkeypatch):
    monkeypatch.setattr(warm.importlib.util, "find_spec", lambda name: None)
    assert warm.warm_compiler({}) == {"skipped": "triton is not installed"}


PRELOAD_CHECK = """
import json, sys
from snapfn.snapshot.zygote.fork_safety import fork_safety_problem, preload
for entry in sys.argv[1:]:
    preload(entry)
import torch
from snapfn.handler.llm.kernels.triton.warm import warm_compiler
print(json.dumps({"problem": fork_safety_problem(), "cuda": torch.cuda.is_initialized(),
                  "again": warm_compiler()}))
"""


def preloaded(entries) -> dict:
    """A fresh interpreter's state after preloading `entries` as a zygote does."""
    out = subprocess.run(
        [sys.executable, "-c", PRELOAD_CHECK, *entries],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(out.stdout.splitlines()[-1])


def test_the_zygote_preload_leaves_a_process_that_can_fork():
    """Every ZYGOTE_PRELOAD entry, the compiler warm's call included: no CUDA, no thread."""
    state = preloaded(ZYGOTE_PRELOAD)
    assert state["problem"] is None and state["cuda"] is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none here)")
def test_cuda_the_warm_hashes_every_kernel_before_cuda_and_kernels_run_after():
    state = preloaded(["snapfn.handler.llm.kernels.triton.warm:warm_compiler"])
    assert state["problem"] is None and state["cuda"] is False
    assert state["again"]["kernels_hashed"] >= 10  # the call repeated, from its caches
    from snapfn.handler.llm.kernels.torch_ref import TorchBackend
    from snapfn.handler.llm.kernels.triton.backend import TritonBackend

    warm.warm_compiler()
    x = torch.randn(3, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, device="cuda", dtype=torch.bfloat16)
    got = TritonBackend().rms_norm(x, w, 1e-5)
    torch.testing.assert_close(got, TorchBackend().rms_norm(x, w, 1e-5))
