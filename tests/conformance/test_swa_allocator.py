"""The ``swa_allocator`` suite: kvproof's torch runtime conforms on every config (``ci`` profile); every runtime
mutant is killed; S3 is rediscovered and shrunk.

Kills run without the shrinking phase (a kill needs one failing example); the S3
test shrinks, because the issue asks for the shrunk trace (<= 8 steps).
"""

import re

import pytest

from kvproof.conformance.check import check_swa_allocator, get_suite, kill_mutants, run_swa_allocator_check
from kvproof.conformance.configs import CONFORMANCE_CONFIGS, RING_CONFIGS, RING_P1_CONFIG
from kvproof.conformance.mutants.swa_allocator import MUTANTS
from kvproof.gpu_runtime import SWATokenToKVPoolAllocator
from kvproof.reference.contract import Capability, SWAAllocatorUnderTest

from ..devices import DEVICES
from .runtime_runs import group, runtime_run

#: every config of the suite (the ring configs last), and the P == 1 ring 0.5.23 never builds (F8's shape)
CONFIGS = (*get_suite("swa_allocator").configs, RING_P1_CONFIG)


def test_the_suite_runs_the_ring_configs() -> None:
    assert get_suite("swa_allocator").configs == CONFORMANCE_CONFIGS + RING_CONFIGS
    assert all(c.ring and c.page_size > 1 for c in RING_CONFIGS) and RING_P1_CONFIG.ring


@group("swa_allocator")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", CONFIGS, ids=[c.label() for c in CONFIGS])
def test_runtime_conforms(config, device: str) -> None:
    report = runtime_run("swa_allocator", config, device)
    assert report.passed, report.failure
    assert report.not_applicable == ()
    assert report.never_run == (), f"rules never executed: {report.never_run}"
    assert report.steps > 1000
    if config.ring:  # the harness played ReqToTokenPool: slots taken, given back, and once refused
        assert report.calls["alloc_req_slots"] and report.calls["free_req_slots"], report.calls
        assert report.outcomes["OutOfMemory"]


class RejectsNoMisuse(SWATokenToKVPoolAllocator):
    """kvproof's runtime declaring no ``REJECTS_MISUSE``, as SGLang's allocator: only the legal rules call it."""

    capabilities = SWATokenToKVPoolAllocator.capabilities - {Capability.REJECTS_MISUSE}


@pytest.mark.parametrize("config", [*RING_CONFIGS, RING_P1_CONFIG], ids=lambda c: c.label())
def test_on_a_ring_the_legal_rules_alone_run_every_rule_declared(config) -> None:
    """A ring takes no SWA page and writes no mapping, so ``set_full_to_swa_mapping`` has nothing legal to re-attach
    there: it is declared off ring configs, and a run of legal rules alone (no misuse call reaches the method) is not
    reported as leaving it never run (every SGLang CI run said so, of both ring configs)."""
    assert "set_full_to_swa_mapping" not in get_suite("swa_allocator").needs(config)
    report = check_swa_allocator(RejectsNoMisuse, config, profile="ci", impl_name="runtime without misuse")
    assert report.passed and "misuse" in report.not_applicable, report.failure
    assert report.never_run == (), report.never_run
    assert report.calls.get("set_full_to_swa_mapping", 0) == 0


def test_runtime_declares_everything_and_meets_the_protocol() -> None:
    alloc = SWATokenToKVPoolAllocator(CONFORMANCE_CONFIGS[0], device="cpu")
    assert isinstance(alloc, SWAAllocatorUnderTest)
    assert alloc.capabilities == frozenset(Capability) - {Capability.DECODE_BUDGETS}


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutant_is_killed(name: str) -> None:
    (verdict,) = kill_mutants({name: MUTANTS[name]}, get_suite("swa_allocator").configs, profile="ci")
    assert verdict.killed, f"mutant {name} survived the ci profile on every config"
    assert "HarnessError" not in verdict.evidence, verdict.evidence


def test_at_least_ten_mutants() -> None:
    assert len(MUTANTS) >= 10


@pytest.mark.parametrize("name", ["ring_available_takes_min", "ring_extend_gated_by_swa_pool", "ring_alloc_takes_swa"])
def test_ring_mutant_survives_the_paged_configs_and_dies_on_a_ring(name: str) -> None:
    """The ring mutants break only ring mode: the paged configs cannot see them, a ring config kills them."""
    (paged,) = kill_mutants({name: MUTANTS[name]}, CONFORMANCE_CONFIGS[1:3], profile="dev")
    assert not paged.killed, paged.evidence
    (ring,) = kill_mutants({name: MUTANTS[name]}, RING_CONFIGS, profile="ci")
    assert ring.killed and "HarnessError" not in ring.evidence


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
