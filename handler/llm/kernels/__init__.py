"""Backend registry: attention / GEMM / MoE implementations chosen by name.

`get_backend("auto", device)` picks the backend for the device: today the torch reference
everywhere. "triton" (our own Triton kernels over the torch reference) is chosen by name
(`SNAPFN_BACKEND=triton`) until its GPU tests have passed on a GPU; then "auto" takes it on
CUDA when triton is installed (`AUTO_TRITON`). "flashinfer" (FlashInfer's paged attention over
the torch reference, CUDA only) is chosen by name only. Other GPU backends come with issue 6.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

from .base import Backend, ExpertWeights

__all__ = ["Backend", "ExpertWeights", "available_backends", "get_backend", "register_backend"]

_FACTORIES: dict[str, Callable[[], Backend]] = {}


def register_backend(name: str, factory: Callable[[], Backend]) -> None:
    _FACTORIES[name] = factory


def _torch_factory() -> Backend:
    from .torch_ref import TorchBackend

    return TorchBackend()


def _triton_factory() -> Backend:
    from .triton_backend import TritonBackend

    return TritonBackend()


def _flashinfer_factory() -> Backend:
    # imports flashinfer (InitFailed, saying how to install it, where it cannot)
    from .flashinfer_backend import FlashInferBackend

    return FlashInferBackend()


register_backend("torch", _torch_factory)
register_backend("triton", _triton_factory)
register_backend("flashinfer", _flashinfer_factory)
# NOTE: off until tests/test_triton_kernels.py's GPU cases have passed on a GPU (never yet):
# correctness before speed, and an unverified kernel must not become every CUDA run's default.
AUTO_TRITON = False


def _triton_installed() -> bool:
    # NOTE: find_spec only: importing triton takes seconds and may touch CUDA.
    return importlib.util.find_spec("triton") is not None


def available_backends() -> list[str]:
    return sorted(_FACTORIES)


def get_backend(name: str = "auto", device: str = "cpu") -> Backend:
    """Instantiate backend `name`; "auto" picks the best registered one for `device`."""
    if name == "auto":
        cuda = torch.device(device).type == "cuda"
        name = "triton" if AUTO_TRITON and cuda and _triton_installed() else "torch"
    if name not in _FACTORIES:
        raise ValueError(f"unknown backend {name!r} (available: {', '.join(available_backends())})")
    return _FACTORIES[name]()
