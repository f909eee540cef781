"""Triton's start-up work done ahead (kernels/triton/warm.py): in the zygote before fork, on a
side thread of a fresh restore; never initialising CUDA."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
import types

import pytest
import torch

from snapfn.handler.llm.kernels.triton import warm
from snapfn.handler.llm.recipes.function import ZYGOTE_PRELOAD
from snapfn.snapshot.portable import triton_key


def test_the_switch_reads_on_and_off_and_refuses_anything_else():
    assert warm.enabled({}) and warm.enabled({warm.VARIABLE: "on"})
    assert not warm.enabled({warm.VARIABLE: "off"})
    assert warm.warm_compiler({warm.VARIABLE: "off"}) == {"skipped": "SNAPFN_WARM_COMPILER=off"}
    with pytest.raises(ValueError, match="'on' or 'off', got '1'"):
        warm.enabled({warm.VARIABLE: "1"})


def test_without_triton_it_says_so(monkeypatch):
    monkeypatch.setattr(warm.importlib.util, "find_spec", lambda name: None)
    assert warm.warm_compiler({}) == {"skipped": "triton is not installed"}
    assert triton_key.start({}) is None


def _fake_triton(monkeypatch, key) -> None:
    """A `triton.runtime.cache` whose `triton_key` is `key`, findable as if installed."""
    for name in ("triton", "triton.runtime"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    cache = types.ModuleType("triton.runtime.cache")
    cache.triton_key = key
    monkeypatch.setitem(sys.modules, "triton.runtime.cache", cache)
    monkeypatch.setattr(triton_key.importlib.util, "find_spec", lambda name: object())


def test_the_key_thread_hashes_once_off_the_calling_thread_and_hands_over_its_failure(
    monkeypatch,
):
    calls = []
    _fake_triton(monkeypatch, lambda: calls.append(threading.current_thread().name) or "k")
    assert triton_key.start({triton_key.VARIABLE: "off"}) is None
    seconds = triton_key.start({}).result(timeout=10)
    assert calls == ["snapfn-triton-key"] and seconds >= 0

    def broken():
        raise OSError("libtriton.so: unreadable")

    _fake_triton(monkeypatch, broken)
    with pytest.raises(OSError, match="unreadable"):
        triton_key.start({}).result(timeout=10)


START_CHECK = """
import json, sys
from snapfn.snapshot.portable import compile_caches, triton_key
seen = {}
def before():
    seen["torch_before"] = "torch" in sys.modules
    seen["started"] = triton_key.start() is not None
compile_caches.prepare_deferred(__import__("pathlib").Path(sys.argv[1]), "cpu", before)
print(json.dumps({**seen, "torch_after": "torch" in sys.modules}))
"""


def test_prepare_runs_the_hook_before_torch_is_imported(tmp_path):
    """Where the key thread is started: torch not imported yet (a fresh interpreter)."""
    out = subprocess.run(
        [sys.executable, "-c", START_CHECK, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    seen = json.loads(out.stdout.splitlines()[-1])
    assert seen["torch_before"] is False and seen["torch_after"] is True
    assert seen["started"] is (importlib.util.find_spec("triton") is not None)


KEY_CHECK = """
import json, sys
from snapfn.snapshot.portable import triton_key
started = triton_key.start()
seconds = started.result()
torch_imported = "torch" in sys.modules
from snapfn.handler.llm.kernels.triton.warm import warm_compiler
print(json.dumps({"seconds": seconds, "torch": torch_imported,
                  "warm": warm_compiler(key_started=started)}))
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (not here)")
def test_triton_key_needs_no_torch_so_it_can_run_beside_torch_import():
    out = subprocess.run(
        [sys.executable, "-c", KEY_CHECK], capture_output=True, text=True, timeout=300, check=True
    )
    state = json.loads(out.stdout.splitlines()[-1])
    assert state["seconds"] is not None and state["torch"] is False
    warm_figures = state["warm"]  # joined the thread's key rather than hashing again
    assert warm_figures["triton_key_s"] == state["seconds"]
    assert warm_figures["kernels_hashed"] >= 10


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
