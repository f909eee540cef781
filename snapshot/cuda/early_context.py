"""CUDA's context made on a side thread while a start-up's other work runs.

Making a device's primary context (`cuInit`, `cuDevicePrimaryCtxRetain`) takes 0.3-0.35 s on
an H100 host, and `torch.cuda.init()` spends it holding the GIL, so nothing else in the process
moves meanwhile (`runtime_env`'s `cuda_init_s`, `2026-12-07-h100-tier0-env-llama8b-stage-profile`).
Through ctypes the same driver calls let go of the GIL: `EarlyContext.start` makes the context on
a thread while the caller imports torch, validates a snapshot or loads a tokenizer, and
`finish()` then waits for it and runs torch's own init, which finds the context made (the CUDA
runtime uses the device's primary context).

The thread also reads the compat key's GPU fields (name, compute capability, memory, the
driver's CUDA version) right after `cuInit`, for a validation that must not wait for the context
(`gpu_fields`). A failure anywhere is kept, not raised: `gpu_fields` then returns None and
`finish()` lets torch's init raise its own error.

The retained context is never released: torch's runtime holds the same one for the process's life.

`cuInit` itself costs 0.1 s in a bare interpreter and 0.19-0.21 s in one that imported torch,
forked from a zygote or not; loading libcuda in the zygote before it forks does not shorten it
(`bench/probes/fork_cuinit.py`, `2026-12-07-h100-tier0-env-llama8b-cold-snapshot`). A zygote's
restore waits for it in its validate stage.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable
from typing import Any

_COMPUTE_CAPABILITY = (75, 76)  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, _MINOR


def _load_driver() -> Any:
    return ctypes.CDLL("libcuda.so.1")


def device_index(device: str) -> int:
    """The ordinal of "cuda" / "cuda:N" (a fresh process's current device is 0)."""
    _, _, index = device.partition(":")
    return int(index or 0)


class EarlyContext:
    """Device `index`'s primary context, being made on a daemon thread (`start`)."""

    def __init__(self, index: int, load: Callable[[], Any] = _load_driver) -> None:
        self.index = index
        self.error: str | None = None
        self.init_s = self.context_s = 0.0  # cuInit's seconds; the context's, after it
        self._fields: dict[str, Any] | None = None
        self._fields_ready = threading.Event()
        self._load = load
        self._thread = threading.Thread(target=self._run, name="snapfn-cuda-context", daemon=True)

    @classmethod
    def start(cls, device: str, load: Callable[[], Any] = _load_driver) -> EarlyContext:
        early = cls(device_index(device), load)
        early._thread.start()
        return early

    def _run(self) -> None:
        try:
            start = time.perf_counter()
            cu = self._load()
            _check(cu, cu.cuInit(0), "cuInit")
            dev = ctypes.c_int()
            _check(cu, cu.cuDeviceGet(ctypes.byref(dev), self.index), "cuDeviceGet")
            self.init_s = time.perf_counter() - start
            self._fields = _gpu_fields(cu, dev)
            self._fields_ready.set()
            start = time.perf_counter()
            ctx = ctypes.c_void_p()
            _check(
                cu, cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain"
            )
            self.context_s = time.perf_counter() - start
        except (OSError, RuntimeError, AttributeError) as exc:  # no driver, or it refused
            self.error = f"{type(exc).__name__}: {exc}".splitlines()[0]
        finally:
            self._fields_ready.set()

    def gpu_fields(self, index: int) -> dict[str, Any] | None:
        """The compat key's GPU fields of device `index` once `cuInit` is done (not waiting for
        the context); None where the thread failed or another device is asked about."""
        self._fields_ready.wait()
        return dict(self._fields) if self._fields is not None and index == self.index else None

    def wait(self) -> dict[str, Any]:
        """Wait for the thread; its figures (`cuda_context_wait_s`: how long this call waited)."""
        start = time.perf_counter()
        self._thread.join()
        figures: dict[str, Any] = {
            "cuda_driver_init_s": round(self.init_s, 3),
            "cuda_context_s": round(self.context_s, 3),
            "cuda_context_wait_s": round(time.perf_counter() - start, 3),
        }
        if self.error is not None:
            figures["cuda_context_error"] = self.error
        return figures


def _check(cu: Any, result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"{what} failed: {_error_name(cu, result)}")


def _error_name(cu: Any, result: int) -> str:
    name = ctypes.c_char_p()
    try:
        if cu.cuGetErrorName(result, ctypes.byref(name)) == 0 and name.value:
            return name.value.decode()
    except (AttributeError, OSError):
        pass
    return f"CUresult {result}"


def _gpu_fields(cu: Any, dev: ctypes.c_int) -> dict[str, Any]:
    """What `compat.driver_api_fields` reads, through the same driver calls."""
    name = ctypes.create_string_buffer(256)
    _check(cu, cu.cuDeviceGetName(name, 256, dev), "cuDeviceGetName")
    major, minor = ctypes.c_int(), ctypes.c_int()
    for value, attribute in zip((major, minor), _COMPUTE_CAPABILITY, strict=True):
        _check(
            cu, cu.cuDeviceGetAttribute(ctypes.byref(value), attribute, dev), "cuDeviceGetAttribute"
        )
    total = ctypes.c_size_t()
    _check(cu, cu.cuDeviceTotalMem_v2(ctypes.byref(total), dev), "cuDeviceTotalMem")
    version = ctypes.c_int()
    _check(cu, cu.cuDriverGetVersion(ctypes.byref(version)), "cuDriverGetVersion")
    return {
        "gpu_name": name.value.decode(),
        "compute_capability": f"{major.value}.{minor.value}",
        "gpu_total_memory_bytes": int(total.value),
        "cuda_driver_version": int(version.value),
    }
