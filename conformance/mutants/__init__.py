"""Deliberately broken implementations: the suite's own test (\"test the tester\").

A conformance suite that passes everything proves nothing. Each module here holds
mutants of kvproof's torch runtime for one component; ``kvproof mutants`` runs the
lockstep suite against every one and fails unless all are killed.
"""

from kvproof.conformance.mutants.swa_allocator import MUTANTS as SWA_ALLOCATOR_MUTANTS

__all__ = ["SWA_ALLOCATOR_MUTANTS"]
