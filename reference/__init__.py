"""``kvproof.reference``: a pydantic-typed, pure-Python reference of the KV pools.

Frozen models for configs and states (:mod:`.config`, :mod:`.swa_allocator`),
pure operations named exactly like SGLang's methods, and one error taxonomy
(:mod:`.errors`). Stateful wrappers live at the edge (``kvproof.conformance``).
Semantics: ../shared/research/sglang_semantics.md, cited per module.
"""

from kvproof.reference import arith, swa_allocator
from kvproof.reference.config import KVGeometry, PoolConfig
from kvproof.reference.errors import InvalidOperation, InvariantViolation, OutOfMemory, PoolError
from kvproof.reference.invariants import check_invariants
from kvproof.reference.snapshot import AllocatorSnapshot, PoolSnapshot

#: The components kvproof models, in the order every layer, CLI and report lists them.
#: One name each, used as spec component, reference module, conformance suite and test id.
COMPONENTS: tuple[str, ...] = ("swa_allocator", "loc_cache", "decode_prealloc", "hisparse_host", "admission",
                               "tp_prefetch", "block_pool")

__all__ = [
    "COMPONENTS",
    "AllocatorSnapshot",
    "InvalidOperation",
    "InvariantViolation",
    "KVGeometry",
    "OutOfMemory",
    "PoolConfig",
    "PoolError",
    "PoolSnapshot",
    "arith",
    "check_invariants",
    "swa_allocator",
]
