"""``swa_allocator``: every Z3 obligation and the transition system of the SWA composite allocator.

The component module of ``kvproof.spec`` (sglang_semantics.md §1.2-§1.6, §2.3, §2.7,
§2.8, §7 G1-G5 M1-M5, §9 S3 S4). Its obligations are named
``swa_allocator.<op>.<claim>[.<twin>]`` after the reference operation they are about
(``swa_allocator.<invariant>.<claim>`` for whole-state invariants), and come from
the family modules:

* :mod:`.swa_tail` — lemma D2 on ``swa_tail_len`` for symbolic ``L, W, P`` (§2.3);
* :mod:`.page_arith` — ``alloc_extend`` parts 1/2/3, ``get_num_new_pages``, batches,
  ``alloc_decode`` (§1.3);
* :mod:`.swa_mask` — ``load_cpu_copy``'s mask symmetry for every mask of length <= 8
  (§2.8, S4);
* :mod:`.swa_mapping` — M under ``free_swa``, ``alloc_extend_swa_tail`` and
  ``alloc_extend`` for symbolic contents in two geometries (§1.5, §2.7, M3-M5);
* :mod:`.swa_s3` — the bounded transition system :data:`SYSTEM` with one transition
  per state-changing reference operation, scenario S3, the safety induction
  (``no_double_free``) and one claim per operation (§1.3-§1.6, §2.7, §2.8, §9 S3);
* :mod:`.swa_ring` — ring mode (0.5.23's per-request SWA ring, ``PoolConfig.swa_ring_size``): its own transition
  system :data:`RING_SYSTEM` (the request-slot operations ``alloc_req_slots`` / ``free_req_slots`` are transitions
  of it only) and SR1-SR3, each with a broken twin (0.5.23's ring-less ``alloc``: finding F8).
"""

from __future__ import annotations

from typing import Any

from kvproof.spec import page_arith, swa_mapping, swa_mask, swa_ring, swa_s3, swa_tail
from kvproof.spec._solver import Obligation
from kvproof.spec._ts import TransitionSystem

__all__ = ["COMPONENT", "FAMILY_MODULES", "OBLIGATIONS", "RING_SYSTEM", "SYSTEM", "SYSTEMS"]

COMPONENT = "swa_allocator"

#: The modules whose obligations make up the component, in report order.
FAMILY_MODULES = (swa_tail, page_arith, swa_mask, swa_mapping, swa_s3, swa_ring)

OBLIGATIONS: tuple[Obligation, ...] = tuple(ob for module in FAMILY_MODULES for ob in module.OBLIGATIONS)

#: The bounded allocator: a transition for every state-changing operation of kvproof.reference.swa_allocator.
SYSTEM: TransitionSystem[swa_s3.State, swa_s3.Action] = swa_s3.SYSTEM
#: Ring mode's counts (any page size, ring, pool and slot count): the ring-changing operations and the request slots.
RING_SYSTEM: TransitionSystem[swa_ring.State, swa_ring.Action] = swa_ring.SYSTEM
SYSTEMS: tuple[TransitionSystem[Any, Any], ...] = (SYSTEM, RING_SYSTEM)
