"""The compat key: what this machine is, and the check that names the first field that differs."""

from __future__ import annotations

import json

import pytest

from snapfn.snapshot.errors import IncompatibleSnapshot
from snapfn.snapshot.portable.compat import FORMAT_VERSION, check_compat, compat_key


def test_check_compat_names_the_first_mismatch() -> None:
    recorded = {"device_type": "cuda", "gpu_name": "NVIDIA H100", "world_size": 2}
    current = {"device_type": "cuda", "gpu_name": "NVIDIA H200", "world_size": 1}
    with pytest.raises(IncompatibleSnapshot) as info:
        check_compat(recorded, current)
    assert (
        str(info.value)
        == "snapshot was made for gpu_name='NVIDIA H100', this machine has 'NVIDIA H200'"
    )
    check_compat(
        recorded, {**current, "gpu_name": "NVIDIA H100"}, fields=["device_type", "gpu_name"]
    )
    with pytest.raises(IncompatibleSnapshot, match="triton=<missing>, this machine has '3.5.0'"):
        check_compat(recorded, {**recorded, "triton": "3.5.0"})


def test_compat_key_on_cpu_survives_json() -> None:
    key = compat_key("cpu", world_size=4)
    assert key["device_type"] == "cpu" and key["world_size"] == 4
    assert key["format_version"] == FORMAT_VERSION and key["machine"]
    assert "gpu_name" not in key and "python" in key and "torch" in key
    check_compat(json.loads(json.dumps(key)), key)


@pytest.mark.gpu
def test_compat_key_on_cuda() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    key = compat_key("cuda", world_size=1)
    assert key["gpu_name"] == torch.cuda.get_device_name(0)
    assert key["compute_capability"].count(".") == 1 and key["cuda_driver_version"] > 0
    check_compat(json.loads(json.dumps(key)), key)


def test_the_restore_chain_follows_the_key_field_by_field():
    from snapfn.handler.llm.recipes.cli import restore_chain
    from snapfn.snapshot.portable.compat import cache_drift, check_layout_compat

    here = {"format_version": 1, "device_type": "cpu", "machine": "x86_64", "torch": "2.13.0"}
    here |= {"python": "3.11", "world_size": 1}
    same = {"tier": "process", "compat": dict(here)}
    assert restore_chain(same, here) == (
        "restore chain here: tier 1 (process image) → tier 0, caches kept → cold init"
    )
    torch = {"tier": "process", "compat": {**here, "torch": "2.12.0"}}
    chain = restore_chain(torch, here)
    assert chain.startswith("restore chain here: not tier 1 (snapshot was made for torch=")
    assert "→ tier 0, caches dropped (snapshot was made for torch='2.12.0'" in chain
    two = {"tier": "portable", "compat": {**here, "world_size": 2}}
    chain = restore_chain(two, here)
    assert "not tier 0 (snapshot was made for world_size=2" in chain and chain.endswith("cold init")
    assert cache_drift(two["compat"], here) is None  # world size is the layout's, not the caches'
    with pytest.raises(IncompatibleSnapshot, match="world_size"):
        check_layout_compat(two["compat"], here)
    # a field one side lacks counts as differing, on the cache side
    assert "triton" in cache_drift({**here, "triton": "3.7.1"}, here)
