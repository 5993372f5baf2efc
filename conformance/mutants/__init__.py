"""Deliberately broken implementations: the suite's own test (\"test the tester\").

A conformance suite that passes everything proves nothing. Each module here holds
mutants of kvproof's torch runtime for one component; ``kvproof mutants`` runs the
lockstep suite against every one and fails unless all are killed.
"""

from kvproof.conformance.mutants.decode_prealloc import MUTANTS as DECODE_PREALLOC_MUTANTS
from kvproof.conformance.mutants.hisparse_host import MUTANTS as HISPARSE_HOST_MUTANTS
from kvproof.conformance.mutants.loc_cache import MUTANTS as LOC_CACHE_MUTANTS
from kvproof.conformance.mutants.swa_allocator import MUTANTS as SWA_ALLOCATOR_MUTANTS

__all__ = ["DECODE_PREALLOC_MUTANTS", "HISPARSE_HOST_MUTANTS", "LOC_CACHE_MUTANTS", "MUTANTS", "SWA_ALLOCATOR_MUTANTS"]

#: Mutants by the component whose suite must kill them.
MUTANTS = {"swa_allocator": SWA_ALLOCATOR_MUTANTS, "loc_cache": LOC_CACHE_MUTANTS,
           "decode_prealloc": DECODE_PREALLOC_MUTANTS, "hisparse_host": HISPARSE_HOST_MUTANTS}
