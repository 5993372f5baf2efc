"""A suite is also a plain pytest/unittest test case: ``make_test_case(component, factory, config)``."""

from kvproof.conformance.check import make_test_case
from kvproof.conformance.configs import CONFORMANCE_CONFIGS
from kvproof.gpu_runtime import SWATokenToKVPoolAllocator

_Case = make_test_case("swa_allocator", SWATokenToKVPoolAllocator, CONFORMANCE_CONFIGS[3], profile="dev",
                       impl_name="runtime")


class TestRuntimeLockstepP4W2(_Case):
    """Collected by pytest like any unittest class; runs the dev profile."""
