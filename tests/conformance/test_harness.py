"""Test the tester: the lockstep harness accepts legal implementations and only those."""

from pathlib import Path

import pytest

from kvproof.conformance.check import check_swa_allocator, run_swa_allocator_check
from kvproof.conformance.configs import CONFORMANCE_CONFIGS
from kvproof.conformance.errors import ConformanceFailure
from kvproof.conformance.reference_impl import ReferenceAllocator
from kvproof.conformance.swa_allocator import SUITE

from .variants import RelabelledClaimingExactOrder, RelabelledReference

IDS = [c.label() for c in CONFORMANCE_CONFIGS]


@pytest.mark.parametrize("config", CONFORMANCE_CONFIGS, ids=IDS)
def test_reference_passes_its_own_suite(config) -> None:
    report = check_swa_allocator(ReferenceAllocator, config, profile="ci", impl_name="reference")
    assert report.steps > 500
    assert report.never_run == (), f"rules never executed: {report.never_run}"
    assert report.outcomes["OutOfMemory"] > 0 and report.outcomes["InvalidOperation"] > 0


@pytest.mark.parametrize("config", CONFORMANCE_CONFIGS[:3], ids=IDS[:3])
def test_relabelled_pages_are_accepted(config) -> None:
    """Page choice is implementation-defined: a consistent renaming must pass."""
    check_swa_allocator(RelabelledReference, config, profile="dev", impl_name="relabelled")


def test_false_exact_order_claim_is_rejected() -> None:
    report = run_swa_allocator_check(RelabelledClaimingExactOrder, CONFORMANCE_CONFIGS[1], profile="dev",
                                     impl_name="relabelled-claiming-exact", failures_dir=None)
    assert not report.passed
    assert "EXACT_PAGE_ORDER" in (report.failure or "")


def test_capabilities_gate_rules_and_are_reported() -> None:
    class Minimal(ReferenceAllocator):
        capabilities = frozenset({c for c in ReferenceAllocator.capabilities if c.value in ("alloc_extend",)})

    report = check_swa_allocator(Minimal, CONFORMANCE_CONFIGS[2], profile="dev", impl_name="minimal")
    config = CONFORMANCE_CONFIGS[2]
    ops = SUITE.machine.operations  # a rule needs all of ``needs`` and, when it has them, one of ``needs_any``
    assert set(report.not_applicable) == {r for r, needs in SUITE.needs(config).items()
                                          if needs - Minimal.capabilities
                                          or (r in ops and ops[r].needs_any and not ops[r].needs_any
                                              & Minimal.capabilities)}
    assert "release_batch" in report.not_applicable  # neither FREE_GROUP nor FREE_SEGMENT
    assert "alloc_decode" in report.not_applicable and "misuse" in report.not_applicable
    assert report.rules.get("alloc_decode", 0) == 0 and report.calls.get("alloc_decode", 0) == 0


def test_failures_are_saved(tmp_path) -> None:
    report = run_swa_allocator_check(RelabelledClaimingExactOrder, CONFORMANCE_CONFIGS[1], profile="dev",
                                     impl_name="x/y", failures_dir=tmp_path)
    assert report.failure_file is not None
    text = Path(report.failure_file).read_text()
    assert "operations so far" in text and "Failing test case" in text
    assert "reproduce_failure" not in text  # advice for a test nobody can decorate (issue 11, observation 9)


def test_check_raises_conformance_failure() -> None:
    with pytest.raises(ConformanceFailure, match="relabelled"):
        check_swa_allocator(RelabelledClaimingExactOrder, CONFORMANCE_CONFIGS[1], profile="dev", impl_name="relabelled")


def test_free_of_released_positions_is_split_without_the_capability() -> None:
    """Without FREE_RELEASED_SWA the harness frees such requests as free_swa(still mapped) + free_full."""
    from kvproof.conformance.check import check
    from kvproof.conformance.configs import CONFORMANCE_CONFIGS
    from kvproof.gpu_runtime import SWATokenToKVPoolAllocator
    from kvproof.reference.contract import Capability

    class Strict(SWATokenToKVPoolAllocator):
        capabilities = frozenset(Capability) - {Capability.FREE_RELEASED_SWA, Capability.REJECTS_MISUSE,
                                                Capability.DECODE_BUDGETS}

        def _mapped_only(self, op, free_index):
            mapping = self.snapshot().full_to_swa_index_mapping
            assert all(mapping[int(s)] > 0 for s in free_index), f"{op} of a slot whose SWA side is released"

        def free(self, free_index):
            self._mapped_only("free", free_index)
            return super().free(free_index)

        def free_swa(self, free_index):
            self._mapped_only("free_swa", free_index)
            return super().free_swa(free_index)

    for config in CONFORMANCE_CONFIGS[:3]:
        report = check("swa_allocator", Strict, config, profile="ci", impl_name="strict")
        assert report.calls["free_full"] > 0 and report.calls["free"] > 0
