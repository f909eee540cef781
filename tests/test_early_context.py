"""CUDA's context made on a side thread during start-up (snapshot/cuda/early_context.py): the
GPU fields it reads for validation, its figures, its failures kept rather than raised, and the
restore's validate stage building its compat key from those fields."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest
import torch

from snapfn.snapshot import runtime
from snapfn.snapshot.cuda import early_context
from snapfn.snapshot.cuda.early_context import EarlyContext, device_index
from snapfn.snapshot.portable import compat


class FakeDriver:
    """libcuda's calls as ctypes makes them: out-parameters through byref (`._obj`)."""

    def __init__(self, fail: str | None = None, hold: threading.Event | None = None) -> None:
        self.fail, self.hold, self.calls = fail, hold, []

    def _call(self, name: str) -> int:
        self.calls.append(name)
        return 100 if name == self.fail else 0  # 100: CUDA_ERROR_NO_DEVICE

    def cuInit(self, flags):
        return self._call("cuInit")

    def cuDeviceGet(self, out, index):
        out._obj.value = index
        return self._call("cuDeviceGet")

    def cuDeviceGetName(self, buf, size, dev):
        buf.value = b"NVIDIA Test GPU"
        return self._call("cuDeviceGetName")

    def cuDeviceGetAttribute(self, out, attribute, dev):
        out._obj.value = {75: 9, 76: 0}[attribute]
        return self._call("cuDeviceGetAttribute")

    def cuDeviceTotalMem_v2(self, out, dev):
        out._obj.value = 80 << 30
        return self._call("cuDeviceTotalMem")

    def cuDriverGetVersion(self, out):
        out._obj.value = 13000
        return self._call("cuDriverGetVersion")

    def cuDevicePrimaryCtxRetain(self, out, dev):
        if self.hold is not None:
            self.hold.wait(10)
        out._obj.value = 0x1234
        return self._call("cuDevicePrimaryCtxRetain")

    def cuGetErrorName(self, result, out):
        out._obj.value = b"CUDA_ERROR_NO_DEVICE"
        return 0


def test_the_device_index_of_cuda_names():
    assert device_index("cuda") == 0 and device_index("cuda:3") == 3


def test_it_reads_the_fields_then_makes_the_context():
    cu = FakeDriver()
    early = EarlyContext.start("cuda:1", load=lambda: cu)
    figures = early.wait()
    assert early.gpu_fields(1) == {
        "gpu_name": "NVIDIA Test GPU",
        "compute_capability": "9.0",
        "gpu_total_memory_bytes": 80 << 30,
        "cuda_driver_version": 13000,
    }
    assert early.gpu_fields(0) is None  # another device: asked the usual way
    assert cu.calls[0] == "cuInit" and cu.calls[-1] == "cuDevicePrimaryCtxRetain"
    assert set(figures) == {"cuda_driver_init_s", "cuda_context_s", "cuda_context_wait_s"}


def test_the_fields_come_before_the_context_is_made():
    """Validation needs the fields, not the context: it does not wait for the context."""
    hold = threading.Event()
    cu = FakeDriver(hold=hold)
    early = EarlyContext.start("cuda", load=lambda: cu)
    try:
        assert early.gpu_fields(0)["gpu_name"] == "NVIDIA Test GPU"
        assert "cuDevicePrimaryCtxRetain" not in cu.calls
    finally:
        hold.set()
    early.wait()
    assert "cuDevicePrimaryCtxRetain" in cu.calls


@pytest.mark.parametrize("failing", ["cuInit", "cuDeviceGetName", "cuDevicePrimaryCtxRetain"])
def test_a_refusal_is_kept_as_a_figure_not_raised(failing):
    early = EarlyContext.start("cuda", load=lambda: FakeDriver(fail=failing))
    figures = early.wait()
    assert figures["cuda_context_error"] == (
        f"RuntimeError: {failing} failed: CUDA_ERROR_NO_DEVICE"
    )
    if failing != "cuDevicePrimaryCtxRetain":
        assert early.gpu_fields(0) is None  # torch's init then says what is wrong


def test_no_driver_library_is_kept_as_a_figure():
    def missing():
        raise OSError("libcuda.so.1: cannot open shared object file")

    early = EarlyContext.start("cuda", load=missing)
    assert early.wait()["cuda_context_error"].startswith("OSError: libcuda.so.1")
    assert early.gpu_fields(0) is None


class _Fn:
    device, world_size = "cuda:0", 1

    def __init__(self, fields):
        self.gpu_fields = lambda index: fields


def test_validation_keys_on_the_early_fields_without_torch(monkeypatch):
    fields = {"gpu_name": "NVIDIA Test GPU", "compute_capability": "9.0"}
    monkeypatch.setattr(compat, "_cuda_fields", lambda *a: pytest.fail("torch's path was taken"))
    key = runtime._compat_here(_Fn(fields))
    assert key["gpu_name"] == "NVIDIA Test GPU" and key["device_type"] == "cuda"
    assert key["world_size"] == 1


def test_validation_without_early_fields_takes_the_usual_key(monkeypatch):
    asked = []
    monkeypatch.setattr(
        runtime, "compat_key", lambda device, world_size, **kw: asked.append(kw) or {}
    )
    runtime._compat_here(_Fn(None))
    assert asked == [{}]  # the full key (torch's), not the light one


def test_a_cpu_function_never_starts_the_thread(tmp_path, monkeypatch):
    from snapfn.snapshot.portable import compile_caches

    monkeypatch.setattr(early_context, "_load_driver", lambda: pytest.fail("driver loaded"))
    figures, pending = compile_caches.prepare_deferred(tmp_path, "cpu")
    assert pending is None and "cuda_init_s" not in figures


CONTEXT_CHECK = """
import json, sys
from snapfn.snapshot.cuda.early_context import EarlyContext
early = EarlyContext.start("cuda")
fields = early.gpu_fields(0)
import torch
figures = early.wait()
torch.cuda.init()
x = torch.ones(4, device="cuda")
from snapfn.snapshot.portable.compat import compat_key, driver_api_fields
print(json.dumps({"fields": fields, "driver": driver_api_fields(0), "figures": figures,
    "sum": float(x.sum()), "light": compat_key("cuda", 1, light=True, gpu_fields=lambda i: fields),
    "full": compat_key("cuda", 1)}))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none here)")
def test_cuda_the_early_context_is_the_one_torch_runs_on_and_keys_match():
    out = subprocess.run(
        [sys.executable, "-c", CONTEXT_CHECK], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    state = json.loads(out.stdout.splitlines()[-1])
    assert "cuda_context_error" not in state["figures"]
    assert state["figures"]["cuda_context_s"] > 0 and state["sum"] == 4.0
    assert state["fields"] == state["driver"]
    assert state["light"] == {k: state["full"][k] for k in state["light"]}
    assert set(state["light"]) == set(state["full"])


def test_the_llm_function_answers_with_its_pending_inits_fields(monkeypatch, tmp_path):
    """The restore's validate asks the LLM function, which asks its CUDA init under way; once
    that init is finished (or on CPU) the answer is None and the key is torch's."""
    from types import SimpleNamespace

    from snapfn.handler.llm.init_config import InitConfig
    from snapfn.handler.llm.recipes.function import LLMFunction

    fn = LLMFunction(InitConfig(device="cuda:0", cache_dir=tmp_path))
    assert fn.gpu_fields(0) is None  # nothing begun
    cu = FakeDriver()
    fn._cuda = SimpleNamespace(early=EarlyContext.start("cuda:0", load=lambda: cu))
    monkeypatch.setattr(compat, "_cuda_fields", lambda *a: pytest.fail("torch's path was taken"))
    assert runtime._compat_here(fn)["gpu_name"] == "NVIDIA Test GPU"
    fn._cuda = None  # finished: torch's own key from here on
    assert fn.gpu_fields(0) is None
