"""Backend registry: attention / GEMM / MoE implementations chosen by name.

`get_backend("auto", device)` picks the fastest importable backend for the device; today that
is the torch reference everywhere (GPU backends are registered by a later issue).
"""

from __future__ import annotations

from collections.abc import Callable

from .base import Backend, ExpertWeights

__all__ = ["Backend", "ExpertWeights", "available_backends", "get_backend", "register_backend"]

_FACTORIES: dict[str, Callable[[], Backend]] = {}


def register_backend(name: str, factory: Callable[[], Backend]) -> None:
    _FACTORIES[name] = factory


def _torch_factory() -> Backend:
    from .torch_ref import TorchBackend

    return TorchBackend()


register_backend("torch", _torch_factory)


def available_backends() -> list[str]:
    return sorted(_FACTORIES)


def get_backend(name: str = "auto", device: str = "cpu") -> Backend:
    """Instantiate backend `name`; "auto" picks the best registered one for `device`."""
    if name == "auto":
        name = "torch"
    if name not in _FACTORIES:
        raise ValueError(f"unknown backend {name!r} (available: {', '.join(available_backends())})")
    return _FACTORIES[name]()
