"""kvproof's torch runtime conforms to the reference on every conformance config (``ci`` profile)."""

import pytest
import torch

from kvproof.conformance.check import check_swa_allocator
from kvproof.conformance.configs import CONFORMANCE_CONFIGS
from kvproof.gpu_runtime import SWATokenToKVPoolAllocator
from kvproof.reference.contract import Capability, SWAAllocatorUnderTest

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="no CUDA device on this machine"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", CONFORMANCE_CONFIGS, ids=[c.label() for c in CONFORMANCE_CONFIGS])
def test_runtime_conforms(config, device: str) -> None:
    report = check_swa_allocator(lambda cfg: SWATokenToKVPoolAllocator(cfg, device=device), config,
                                 profile="ci", impl_name=f"runtime[{device}]")
    assert report.not_applicable == ()
    assert report.never_run == (), f"rules never executed: {report.never_run}"
    assert report.steps > 1000


def test_runtime_declares_everything_and_meets_the_protocol() -> None:
    alloc = SWATokenToKVPoolAllocator(CONFORMANCE_CONFIGS[0], device="cpu")
    assert isinstance(alloc, SWAAllocatorUnderTest)
    assert alloc.capabilities == frozenset(Capability)
