"""Deliberately broken implementations: the suites' own test ("test the tester").

A conformance suite that passes everything proves nothing. For each component of the
registry (``kvproof.reference.registry``), ``kvproof.conformance.mutants.<component>``
holds mutants of kvproof's torch runtime, ``MUTANTS: dict[name, factory]``, each a
plausible bug with the section of sglang_semantics.md it violates;
``kvproof mutants`` runs the component's lockstep suite against every one and fails
unless all are killed. ``kvproof.conformance.check.mutants_of(component)`` loads them.
"""

from kvproof.conformance.mutants.decode_prealloc import MUTANTS as DECODE_PREALLOC_MUTANTS
from kvproof.conformance.mutants.hisparse_host import MUTANTS as HISPARSE_HOST_MUTANTS
from kvproof.conformance.mutants.loc_cache import MUTANTS as LOC_CACHE_MUTANTS
from kvproof.conformance.mutants.swa_allocator import MUTANTS as SWA_ALLOCATOR_MUTANTS

__all__ = ["DECODE_PREALLOC_MUTANTS", "HISPARSE_HOST_MUTANTS", "LOC_CACHE_MUTANTS", "SWA_ALLOCATOR_MUTANTS"]
