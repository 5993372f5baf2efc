"""The lockstep machine is also a plain pytest/unittest test case: ``machine_for(...).TestCase``."""

from hypothesis import settings

from kvproof.conformance.configs import CONFORMANCE_CONFIGS
from kvproof.conformance.profiles import get_profile
from kvproof.conformance.swa_allocator import machine_for
from kvproof.gpu_runtime import SWATokenToKVPoolAllocator

_Machine = machine_for(SWATokenToKVPoolAllocator, CONFORMANCE_CONFIGS[3], impl_name="runtime")
_Machine.TestCase.settings = settings(get_profile("dev"))


class TestRuntimeLockstepP4W2(_Machine.TestCase):  # type: ignore[name-defined,misc]
    """Collected by pytest like any unittest class; runs the dev profile."""
