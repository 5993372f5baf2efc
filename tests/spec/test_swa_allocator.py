"""``kvproof.spec.swa_allocator``: one transition per reference op, one name per op (sglang_semantics.md §1.3-§2.8).

The component module's ``SYSTEM`` has a transition named like every state-changing
operation of ``kvproof.reference.swa_allocator``, ``kvproof prove -k <op>`` finds
obligations about each, and the combined step relation the BMC queries use agrees
with the per-op relations the drift test checks.
"""

from __future__ import annotations

import inspect

import pytest

from kvproof.reference import swa_allocator as reference
from kvproof.spec import obligations, swa_allocator, swa_s3, systems
from kvproof.spec._ts import combine_agrees

#: The reference's operations that change the allocator or read it for the caller (everything but the queries).
QUERIES = {"initial_state", "available_size", "full_available_size", "swa_available_size", "is_live", "snapshot",
           "check_live_mapping", "check_live_pairs"}
OPS = sorted(set(reference.__all__) - QUERIES - {name for name in reference.__all__
                                                  if inspect.isclass(getattr(reference, name))})


def test_the_component_exports_its_system_and_obligations() -> None:
    assert swa_allocator.SYSTEMS == (swa_allocator.SYSTEM,)
    assert systems("swa_allocator") == swa_allocator.SYSTEMS
    assert swa_allocator.SYSTEM.component == "swa_allocator"
    assert obligations(component="swa_allocator") == swa_allocator.OBLIGATIONS


def test_every_reference_op_has_a_transition_of_its_name() -> None:
    assert len(OPS) == 21, OPS
    assert sorted(swa_allocator.SYSTEM.ops) == OPS
    assert swa_allocator.SYSTEM.ops == swa_s3.OPS


@pytest.mark.parametrize("op", OPS)
def test_prove_k_op_finds_obligations_about_the_op(op: str) -> None:
    """``kvproof prove -k <op>`` selects by substring; at least one obligation is named after the op itself."""
    named = [ob for ob in obligations(name_filter=op) if ob.name.startswith(f"swa_allocator.{op}.")]
    assert named, f"no obligation named swa_allocator.{op}.*"
    assert any(ob.twin_of is None for ob in named) and any(ob.twin_of is not None for ob in named)


def test_obligation_names_follow_component_op_claim() -> None:
    invariants = {"no_double_free", "swa_tail_len"}
    for ob in swa_allocator.OBLIGATIONS:
        component, head, *claim = ob.name.split(".")
        assert component == "swa_allocator" and claim, ob.name
        assert head in OPS or head in invariants, f"{ob.name}: {head!r} is neither an op nor an invariant"


@pytest.mark.parametrize("op", swa_s3.OPS)
def test_the_combined_step_agrees_with_each_transition(op: str) -> None:
    """BMC and induction use ``combine`` (the allocations and releases share one formula); the drift test and the
    per-op obligations use ``transitions[op]``: with the op chosen, both are the same relation."""
    system = swa_s3.SYSTEM
    assert system.combine is not None
    assert combine_agrees(system, op), f"combine and transitions[{op!r}] differ"


def test_the_combined_step_agrees_for_the_broken_variants() -> None:
    """The twins' systems too: every variant flag set, each op's combined relation equals its own."""
    variant = swa_s3.Variant(clears_non_tail=False, alloc_writes_mapping=False, checks_continuation=False,
                             atomic_decode=False, free_releases_swa=False, free_swa_clears=False,
                             free_full_checks_peer=False)
    system = swa_s3.system(variant)
    for op in (*swa_s3.ALLOCATIONS, *swa_s3.RELEASES):
        assert combine_agrees(system, op), op
