"""The compat key: what a snapshot is only valid for, and the check that refuses the rest.

`compat_key()` describes this machine as a flat JSON-safe dict of str/int/None values (no tuples:
the dict must compare equal after a round trip through manifest.json). `check_compat()` compares
a recorded key with the current one and raises `IncompatibleSnapshot` naming the first field
that differs, in a single line.

Fields, in the order they are checked (the most telling first):

    format_version         snapfn snapshot format version (FORMAT_VERSION)
    device_type            "cpu" or "cuda"
    machine                platform.machine(), e.g. "x86_64" (CPU images are arch-specific too)
    gpu_name               cuda only: torch.cuda.get_device_properties(i).name
    compute_capability     cuda only: "9.0"
    gpu_total_memory_bytes cuda only: a memory plan is only valid for as much memory as it saw
    driver_version         cuda only: kernel driver release from /proc/driver/nvidia/version
                           ("580.159.04"), None where that file cannot be read
    cuda_driver_version    cuda only: cuDriverGetVersion() (cuda.bindings, else torch), e.g. 13000
    cuda_runtime_version   cuda only: torch.version.cuda, e.g. "13.0"
    triton                 cuda only: installed triton version, None if absent (never imported)
    torch                  torch.__version__
    python                 "3.12"
    world_size             number of ranks the snapshot was made for

Two kinds of field. `LAYOUT_FIELDS` (format version, device type, world size) are what the
restore layout needs: the weights' bytes, dtypes and shapes (themselves checked against the
layout table and the model) are only valid for them, so a portable restore refuses a snapshot
whose layout fields differ. Every other field is one only the compile caches (and a memory plan
measured on that GPU) need: a portable restore whose key differs there drops the caches and
recompiles, the weights still stream from the snapshot (`cache_drift`). A process image (tier 1)
needs the exact key.
"""

from __future__ import annotations

import importlib.util
import platform
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from snapfn.snapshot.errors import IncompatibleSnapshot

FORMAT_VERSION = 1
"""Version of the snapshot directory format this build writes and reads (see format.py)."""

_NVIDIA_VERSION_FILE = Path("/proc/driver/nvidia/version")
_DRIVER_RELEASE = re.compile(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)")
_TRITON_DISTRIBUTIONS = ("triton", "pytorch-triton", "triton-nightly")


def compat_key(
    device: str = "cpu",
    world_size: int = 1,
    light: bool = False,
    gpu_fields: Callable[[int], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Describe what a snapshot made here, on `device` with `world_size` ranks, is valid for.

    `light`: the same key without importing torch (seconds a process-snapshot restorer must not
    pay): the GPU through cuda.bindings' driver API (`driver_api_fields`, or `gpu_fields(index)`
    — e.g. asked of a keeper whose driver is already initialised), torch's versions from its
    version.py.
    """
    if light:
        return _light_key(device, world_size, gpu_fields or driver_api_fields)
    # NOTE: torch is imported here, not at module level: importing it costs seconds and this
    # module is imported by tools (inspect, doctor) that may never need it.
    import torch

    dev = torch.device(device)
    key: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "device_type": dev.type,
        "machine": platform.machine(),
    }
    if dev.type == "cuda":
        key.update(_cuda_fields(torch, dev))
    elif dev.type != "cpu":
        raise ValueError(f"compat_key: unsupported device type {dev.type!r} (cpu or cuda)")
    key["torch"] = torch.__version__
    key["python"] = f"{sys.version_info.major}.{sys.version_info.minor}"
    key["world_size"] = int(world_size)
    return key


def _light_key(
    device: str, world_size: int, gpu_fields: Callable[[int], dict[str, Any]]
) -> dict[str, Any]:
    kind, _, index = device.partition(":")
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"compat_key: unsupported device type {kind!r} (cpu or cuda)")
    key: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "device_type": kind,
        "machine": platform.machine(),
    }
    versions = _torch_versions()
    if kind == "cuda":
        key.update(gpu_fields(int(index or 0)))
        key.update(
            driver_version=_driver_release(),
            cuda_runtime_version=versions.get("cuda"),
            triton=_triton_version(),
        )
    key["torch"] = versions.get("__version__")
    key["python"] = f"{sys.version_info.major}.{sys.version_info.minor}"
    key["world_size"] = int(world_size)
    return key


_VERSION_LINE = re.compile(r"^(__version__|cuda)\s*(?::\s*[^=]+)?=\s*['\"]([^'\"]+)['\"]", re.M)


def _torch_versions() -> dict[str, str]:
    """torch.__version__ and torch.version.cuda from torch/version.py, without importing torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return {}  # a function without torch: the key says torch=None
    text = (Path(list(spec.submodule_search_locations)[0]) / "version.py").read_text()
    return dict(_VERSION_LINE.findall(text))


def driver_api_fields(index: int) -> dict[str, Any]:
    """The key's GPU fields through the driver API (cuInit on first use: ~0.1–0.3 s)."""
    from snapfn.snapshot.cuda.driver import driver, ok

    cu = driver()
    dev = ok(cu.cuDeviceGet(index), "cuDeviceGet")
    attr = cu.CUdevice_attribute
    cc = (
        attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
        attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
    )
    major, minor = (ok(cu.cuDeviceGetAttribute(a, dev), "cuDeviceGetAttribute") for a in cc)
    name = ok(cu.cuDeviceGetName(256, dev), "cuDeviceGetName").split(b"\0", 1)[0].decode()
    return {
        "gpu_name": name,
        "compute_capability": f"{major}.{minor}",
        "gpu_total_memory_bytes": int(ok(cu.cuDeviceTotalMem(dev), "cuDeviceTotalMem")),
        "cuda_driver_version": int(ok(cu.cuDriverGetVersion(), "cuDriverGetVersion")),
    }


LAYOUT_FIELDS = ("format_version", "device_type", "world_size")


def check_layout_compat(recorded: dict[str, Any], current: dict[str, Any]) -> None:
    """IncompatibleSnapshot naming the first layout field that differs (a portable restore's
    refusal)."""
    check_compat(recorded, current, LAYOUT_FIELDS)


def cache_drift(recorded: dict[str, Any], current: dict[str, Any]) -> str | None:
    """Why the snapshot's compile caches do not fit this machine (the first field outside
    `LAYOUT_FIELDS` that differs, one line), or None when the keys agree everywhere."""
    names = [n for n in _union_in_order(recorded, current) if n not in LAYOUT_FIELDS]
    try:
        check_compat(recorded, current, names)
    except IncompatibleSnapshot as exc:
        return str(exc)
    return None


def restore_steps(recorded: dict[str, Any], current: dict[str, Any], process: bool) -> list[str]:
    """The chain a restore takes from the compat keys alone (the files' own checks come at
    restore): tier 1 (when the snapshot holds a process image) needs the exact key, tier 0 the
    layout fields, its caches dropped when the rest differs; then a cold init."""
    steps = []
    if process:
        try:
            check_compat(recorded, current)
            steps.append("tier 1 (process image)")
        except IncompatibleSnapshot as exc:
            steps.append(f"not tier 1 ({exc})")
    try:
        check_layout_compat(recorded, current)
    except IncompatibleSnapshot as exc:
        return [*steps, f"not tier 0 ({exc})", "cold init"]
    drift = cache_drift(recorded, current)
    steps.append("tier 0, caches kept" if drift is None else f"tier 0, caches dropped ({drift})")
    return [*steps, "cold init"]


def check_compat(
    recorded: dict[str, Any], current: dict[str, Any], fields: Iterable[str] | None = None
) -> None:
    """Raise IncompatibleSnapshot naming the first field where `recorded` and `current` differ.

    `fields` restricts the check to those names (e.g. a portable tier that tolerates another
    driver); by default every field of either key is checked, recorded's order first.
    """
    names = list(fields) if fields is not None else _union_in_order(recorded, current)
    missing = _Missing()
    for name in names:
        was, now = recorded.get(name, missing), current.get(name, missing)
        if was != now:
            raise IncompatibleSnapshot(
                _one_line(
                    f"snapshot was made for {name[:100]}={repr(was)[:200]}, this machine has "
                    f"{repr(now)[:200]}"
                )
            )


def _cuda_fields(torch: Any, dev: Any) -> dict[str, Any]:
    if not torch.cuda.is_available():
        raise ValueError(f"compat_key: device {str(dev)!r} asked for but CUDA is not available")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return {
        "gpu_name": props.name,
        "compute_capability": f"{props.major}.{props.minor}",
        "gpu_total_memory_bytes": int(props.total_memory),
        "driver_version": _driver_release(),
        "cuda_driver_version": _cuda_driver_version(torch),
        "cuda_runtime_version": torch.version.cuda,
        "triton": _triton_version(),
    }


def _driver_release() -> str | None:
    """The NVIDIA kernel driver release ("580.159.04"), read without nvidia-smi or NVML."""
    try:
        text = _NVIDIA_VERSION_FILE.read_text()
    except OSError:
        return None
    match = _DRIVER_RELEASE.search(text)
    return match.group(1) if match else None


def _cuda_driver_version(torch: Any) -> int:
    """cuDriverGetVersion(): the CUDA API version the driver supports, e.g. 13000."""
    try:
        from cuda.bindings import driver
    except ImportError:
        return int(torch._C._cuda_getDriverVersion())
    err, version = driver.cuDriverGetVersion()
    if err != driver.CUresult.CUDA_SUCCESS:
        return int(torch._C._cuda_getDriverVersion())
    return int(version)


def _triton_version() -> str | None:
    # NOTE: find_spec + metadata only: importing triton takes seconds and may touch CUDA.
    if importlib.util.find_spec("triton") is None:
        return None
    from importlib import metadata  # NOTE: here: ~0.02 s of a tier-1 restorer's imports

    for dist in _TRITON_DISTRIBUTIONS:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def _union_in_order(first: dict[str, Any], second: dict[str, Any]) -> list[str]:
    return list(first) + [name for name in second if name not in first]


class _Missing:
    """Stands for a field one key lacks; never equal to a real value."""

    def __repr__(self) -> str:
        return "<missing>"


def _one_line(message: str) -> str:
    return " ".join(message.split("\n")).replace("\r", " ")
