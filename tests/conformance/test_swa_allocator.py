"""The ``swa_allocator`` suite: kvproof's torch runtime conforms on every config (``ci`` profile); every runtime
mutant is killed; S3 is rediscovered and shrunk.

Kills run without the shrinking phase (a kill needs one failing example); the S3
test shrinks, because the issue asks for the shrunk trace (<= 8 steps).
"""

import re

import pytest
import torch

from kvproof.conformance.check import check_swa_allocator, kill_mutants, run_swa_allocator_check
from kvproof.conformance.configs import CONFORMANCE_CONFIGS
from kvproof.conformance.mutants.swa_allocator import MUTANTS
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
    assert alloc.capabilities == frozenset(Capability) - {Capability.DECODE_BUDGETS}


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutant_is_killed(name: str) -> None:
    (verdict,) = kill_mutants({name: MUTANTS[name]}, CONFORMANCE_CONFIGS, profile="ci")
    assert verdict.killed, f"mutant {name} survived the ci profile on every config"
    assert "HarnessError" not in verdict.evidence, verdict.evidence


def test_at_least_ten_mutants() -> None:
    assert len(MUTANTS) >= 10


def _trace(failure: str) -> list[str]:
    block = failure.split("operations so far:")[1].split("\n\n")[0]
    return re.findall(r"^\s+\d+\. (\w+)\(", block, flags=re.M)


def test_s3_stale_mapping_rediscovered_and_shrunk() -> None:
    """S3 (sglang_semantics.md §9, R1 + R3): draft, restore_state, tail allocation over the draft's page."""
    for config in CONFORMANCE_CONFIGS:
        report = run_swa_allocator_check(MUTANTS["stale_tail_mapping"], config, profile="ci",
                                         impl_name="stale_tail_mapping (pre-#25805)", failures_dir=None)
        if not report.passed:
            break
    assert not report.passed, "S3 was not rediscovered on any config"
    ops = _trace(report.failure or "")
    assert len(ops) <= 8, ops
    assert "restore_state" in ops and ops[-1] == "alloc_extend_swa_tail", ops
    assert ops.index("backup_state") < ops.index("restore_state")
    assert "stale mapping" in (report.failure or "")
