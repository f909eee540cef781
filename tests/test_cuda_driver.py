"""The shared VMM helpers against a recording stand-in for `cuda.bindings.driver` (CPU): the
structures they fill and the calls they make, and the clean-up when a call fails. The real
driver runs them in tests/test_process_gpu.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from snapfn.snapshot.cuda import driver as cuda_driver
from snapfn.snapshot.errors import RestoreFailed


class FakeDriver:
    """Enums as names, structures as namespaces, every call recorded; `fail` names a call that
    returns an error status."""

    CUmemAllocationHandleType = SimpleNamespace(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR="fd")
    CUmemAllocationType = SimpleNamespace(CU_MEM_ALLOCATION_TYPE_PINNED="pinned")
    CUmemLocationType = SimpleNamespace(
        CU_MEM_LOCATION_TYPE_DEVICE="device", CU_MEM_LOCATION_TYPE_HOST_NUMA="host_numa"
    )
    CUmemAccess_flags = SimpleNamespace(CU_MEM_ACCESS_FLAGS_PROT_READWRITE="rw")

    def __init__(self, fail: str = "") -> None:
        self.calls: list[tuple] = []
        self.fail = fail

    @staticmethod
    def CUmemAllocationProp():  # noqa: N802 - the driver's name
        return SimpleNamespace(location=SimpleNamespace())

    @staticmethod
    def CUmemAccessDesc():  # noqa: N802
        return SimpleNamespace(location=SimpleNamespace())

    def _call(self, name, *args, value=None):
        self.calls.append((name, *args))
        return (1 if name == self.fail else 0, value)

    def cuMemAddressReserve(self, *args):  # noqa: N802
        return self._call("reserve", *args, value=0x7000_0000)

    def cuMemMap(self, *args):  # noqa: N802
        return self._call("map", *args)

    def cuMemSetAccess(self, *args):  # noqa: N802
        return self._call("access", *args)

    def cuMemUnmap(self, *args):  # noqa: N802
        return self._call("unmap", *args)

    def cuMemAddressFree(self, *args):  # noqa: N802
        return self._call("free", *args)


def test_allocation_prop_and_access_desc_name_the_location():
    cu = FakeDriver()
    prop = cuda_driver.allocation_prop(cu, "HOST_NUMA", 1)
    assert (prop.type, prop.location.type, prop.location.id) == ("pinned", "host_numa", 1)
    assert prop.requestedHandleTypes == "fd" == cuda_driver.fd_handle_type(cu)
    access = cuda_driver.access_desc(cu, "DEVICE", 3)
    assert (access.location.type, access.location.id, access.flags) == ("device", 3, "rw")


def test_map_handle_reserves_maps_and_grants_then_unmap_undoes_it():
    cu = FakeDriver()
    grant = [cuda_driver.access_desc(cu, "DEVICE", 0)]
    va = cuda_driver.map_handle(cu, "handle", 4 << 20, grant, align=1 << 21)
    assert va == 0x7000_0000
    assert cu.calls == [
        ("reserve", 4 << 20, 1 << 21, 0, 0),
        ("map", va, 4 << 20, 0, "handle", 0),
        ("access", va, 4 << 20, grant, 1),
    ]
    cuda_driver.unmap(cu, va, 4 << 20)
    assert cu.calls[-2:] == [("unmap", va, 4 << 20), ("free", va, 4 << 20)]


@pytest.mark.parametrize("failing", ["map", "access"])
def test_a_failed_map_gives_the_address_space_back(failing):
    cu = FakeDriver(fail=failing)
    with pytest.raises(RestoreFailed, match="cuMem"):
        cuda_driver.map_handle(cu, "handle", 1 << 21, [])
    assert [c[0] for c in cu.calls][-2:] == ["unmap", "free"]


def test_use_primary_context_retains_it_and_makes_it_current():
    class Driver(FakeDriver):
        def cuDeviceGet(self, *args):  # noqa: N802
            return self._call("device", *args, value="dev1")

        def cuDevicePrimaryCtxRetain(self, *args):  # noqa: N802
            return self._call("retain", *args, value="ctx1")

        def cuCtxSetCurrent(self, *args):  # noqa: N802
            return self._call("current", *args)

    cu = Driver()
    assert cuda_driver.use_primary_context(cu, 1) == ("dev1", "ctx1")
    assert cu.calls == [("device", 1), ("retain", "dev1"), ("current", "ctx1")]
    with pytest.raises(RestoreFailed, match="cuDevicePrimaryCtxRetain failed"):
        cuda_driver.use_primary_context(Driver(fail="retain"), 0)
