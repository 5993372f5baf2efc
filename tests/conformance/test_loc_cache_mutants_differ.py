"""Every mutant in ``kvproof.conformance.mutants.loc_cache`` reads stale data on its witness; the runtime does not.

A witness is the matching trace of ``tests/reference/test_loc_cache.py`` (the
reference proves each point needed with it), replayed on an allocator with index
tensors at controlled addresses. On the correct ``SWATokenToKVPoolAllocator`` every
value it observes equals the fresh one (``M[contents]``, or the rows written); on the
mutant some translation differs, or KV lands in the wrong slot. Whether the loc-cache
lockstep suite *catches* them is the harness author's test, against ``LOC_CACHE_MUTANTS``.
"""

from __future__ import annotations

import re

import pytest

from kvproof.conformance.mutants import LOC_CACHE_MUTANTS, SWA_ALLOCATOR_MUTANTS
from kvproof.conformance.mutants.loc_cache import MUTANTS, WITNESSES, stale
from kvproof.gpu_runtime import SWATokenToKVPoolAllocator
from kvproof.reference.loc_cache import InvalidationPoint


def test_every_point_has_a_mutant_and_every_mutant_a_witness() -> None:
    assert LOC_CACHE_MUTANTS is MUTANTS and not set(MUTANTS) & set(SWA_ALLOCATOR_MUTANTS)
    assert {f"no_invalidate_{p.value}" for p in InvalidationPoint} <= set(MUTANTS)
    assert {"storage_base_key", "cache_shared_across_pools"} <= set(MUTANTS)
    assert set(WITNESSES) == set(MUTANTS)


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutant_reads_stale_on_its_witness(name: str) -> None:
    witness = WITNESSES[name]
    correct = witness.run(SWATokenToKVPoolAllocator)
    assert correct and stale(correct) == [], f"the correct runtime read {stale(correct)}"
    broken = witness.run(MUTANTS[name])
    assert stale(broken), f"{name} reads nothing stale on its witness"
    assert [what for what, _, _ in broken] == [what for what, _, _ in correct]  # same trace, other values


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutant_documents_its_bug(name: str) -> None:
    doc = MUTANTS[name].__doc__ or ""
    witness = re.escape(name.removeprefix("no_invalidate_"))
    assert re.search(rf"Witness\s+``(no_invalidate_)?{witness}``", doc), f"{name} docstring names no witness"
    assert re.search(r"point ``\w+``|#\d{5}|\bS[56]\b|R2-[a-e]", doc), f"{name} docstring names no point or bug"
