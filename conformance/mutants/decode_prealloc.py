"""Deliberately broken variants of the torch ``SWATokenToKVPoolAllocator`` on a PD decode node's paths.

The ``decode_prealloc`` suite (:mod:`kvproof.conformance.decode_prealloc`) replays every
allocator call the reference scheduler makes: ``_pre_alloc`` (``alloc`` at P == 1,
``alloc_extend_swa_tail`` above, §2.6, §2.7), decode steps (``alloc_decode``, the KV
writes, window eviction ``free_swa``, ``free`` of finished requests, §1.6), retraction
(``get_cpu_copy`` + ``free``) and resumption (preallocation + ``load_cpu_copy``, §2.8),
and observes the available sizes the budgets read (§2.4). Each mutant here breaks one of
those paths with one small override; its docstring names the section and the invariant
(§7: G1-G5, M1-M5, D3) it violates and a short call sequence on which it differs from
the correct runtime (``tests/conformance/test_decode_prealloc_mutants.py`` runs those).

:data:`MUTANTS` maps a name to a factory ``PoolConfig -> allocator`` (the class itself).
The ``decode_prealloc`` suite must kill every one (``kvproof mutants``); none of them is
a copy of a ``swa_allocator`` mutant.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvproof.gpu_runtime._geometry import DecodePlan, Plan, decode_plan
from kvproof.gpu_runtime._validate import ExtendArgs
from kvproof.gpu_runtime.paged import as_index
from kvproof.gpu_runtime.swa_allocator import SWATokenToKVPoolAllocator
from kvproof.gpu_runtime.swa_kv_pool import KVCpuCopy
from kvproof.reference.config import PoolConfig
from kvproof.reference.loc_cache import InvalidationPoint

__all__ = ["MUTANTS"]

Tensor = torch.Tensor


class TailCeilAsFloorPlusOne(SWATokenToKVPoolAllocator):
    """§2.7 step 1: the tail's SWA page count is ``swa_tail_len // P + 1``, a ceiling written as floor plus one.

    When the tail ends on a page boundary (the fill length is a page multiple) the
    preallocation takes one SWA page too many, which nobody maps: a leak (G3), and the
    capacity check asks for that page too (G4: fails where the reference succeeds).
    Differs: P=4, W=4: ``alloc_extend_swa_tail`` 0 -> 8 with tail 4 takes 2 SWA pages, not 1.
    """

    _tail_aligned = False

    def alloc_extend_swa_tail(self, prefix_lens: Tensor, prefix_lens_cpu: Tensor, seq_lens: Tensor,
                              seq_lens_cpu: Tensor, last_loc: Tensor, extend_num_tokens: int,
                              swa_tail_len: int) -> Tensor:
        self._tail_aligned = int(swa_tail_len) % self.page_size == 0
        try:
            full = super().alloc_extend_swa_tail(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
                                                 extend_num_tokens, swa_tail_len)
        finally:
            aligned, self._tail_aligned = self._tail_aligned, False
        if aligned:
            self.swa_attn_allocator.take_pages(1)  # the "+ 1" page, reserved and never mapped
        return full

    def _check_capacity(self, op: str, full_pages: int, swa_pages: int) -> None:
        super()._check_capacity(op, full_pages, swa_pages + int(self._tail_aligned))


class DecodeOpensSwaPageLate(SWATokenToKVPoolAllocator):
    """§1.3 / §1.5 ``alloc_decode``: the SWA side opens a token's new page one token late.

    The SWA plan is made for ``seq_lens - 1``: the token at in-page offset 0 continues
    past the end of its predecessor's SWA page (into a page it does not own: M2), and
    the token at offset 1 opens a new SWA page at offset 0 (M5: offsets differ).
    Full slots are right, so only the mapping and the SWA pool show it (P > 1).
    Differs: P=2: ``alloc_extend_swa_tail`` 0 -> 2 (tail 2, SWA page 1), decode seq 3 from
    last_loc 3: M[4] = 4 but SWA page 2 stays free; decode seq 4 from 4: M[5] = 4, not 5.
    """

    def _alloc_one_to_one(self, op: str, plan: Plan, args: ExtendArgs) -> Tensor:
        if op != "alloc_decode" or self.page_size == 1:
            return super()._alloc_one_to_one(op, plan, args)
        late = decode_plan(args[2] - 1, args[3] - 1, self.page_size)  # opens where (s - 2) % P == 0
        last_loc = args[4]
        self._check_capacity(op, plan.num_new_pages, late.num_new_pages)
        swa_last_loc = self._swa_last_loc(last_loc)
        owners = self._owners.of_requests(args[0], args[1], last_loc, self.page_size)
        full, fpages = self.full_attn_allocator.alloc_planned_pages(plan, last_loc)
        swa, spages = self.swa_attn_allocator.alloc_planned_pages(late, swa_last_loc)
        self._claim(plan, owners, (full, fpages), (swa, spages))
        self._map(full, swa)
        return full


class DecodeBatchSharesPage(SWATokenToKVPoolAllocator):
    """§1.3 ``alloc_decode``: every page-opening request of a batch gets the FIRST new page (rank not cumsummed).

    Two requests decoding into a new page in the same step share one slot in both pools
    (G3, M2: two owners, each overwriting the other's KV); the other pages taken leak (G3).
    Differs: P=1: two requests of 1 token (``alloc(1)`` twice), decode batch seq [2, 2]:
    both get the same slot.
    """

    def _alloc_one_to_one(self, op: str, plan: Plan, args: ExtendArgs) -> Tensor:
        if op == "alloc_decode" and isinstance(plan, DecodePlan):
            plan = DecodePlan(plan.num_new_pages, plan.page_size, plan.opens, torch.zeros_like(plan.rank))
        return super()._alloc_one_to_one(op, plan, args)


class EvictOnePageTooMany(SWATokenToKVPoolAllocator):
    """§1.6 window eviction: ``free_swa`` treats its end as inclusive and also releases the next page.

    Besides the pages of ``free_index`` it releases the SWA side of the page holding
    ``free_index[-1] + 1``: on a decode node the request's next page (the margin page
    that §1.6's ``- P`` keeps resident) or another request's page, whose in-window SWA
    KV is then lost (D3). Slots nobody released lose their mapping and SWA pages (M3:
    ``free_swa(F)`` frees exactly ``{M[f] > 0 : f in F}``).
    Differs: P=2: ``alloc_extend`` 0 -> 4 (full 2..5, SWA 2..5), ``free_swa([2, 3])``:
    M[4], M[5] become 0 and SWA page 2 is freed too.
    """

    def free_swa(self, free_index: Tensor) -> None:
        self._invalidate_at(InvalidationPoint.FREE_SWA)
        idx = as_index(free_index, self.device)
        pages = self._check_release("free_swa", idx)
        if idx.numel():
            after = (idx[-1:] + 1) // self.page_size  # the page right after the last slot given
            if int(after) <= self.full_attn_allocator.num_pages:
                pages = torch.unique(torch.cat((pages, after))) if self.page_size > 1 else torch.cat((pages, after))
        self._release_swa(pages)


class EvictOnePageTooFew(SWATokenToKVPoolAllocator):
    """§1.6 window eviction: ``free_swa`` releases every page it touches but the last (an exclusive end).

    That page's SWA slots stay allocated and mapped behind the window: a request keeps
    SWA residency below ``floor_P(L - 1 - W - P)`` (D3), M is not zeroed where it was
    released (M3), and the pool leaks until the request is freed (G3).
    Differs: P=2: ``alloc_extend`` 0 -> 4, ``free_swa`` of its 4 slots: SWA page 2 stays taken.
    """

    def free_swa(self, free_index: Tensor) -> None:
        self._invalidate_at(InvalidationPoint.FREE_SWA)
        pages = self._check_release("free_swa", free_index)
        self._release_swa(pages[:-1])


class RetractDropsLastSwaRow(SWATokenToKVPoolAllocator):
    """§1.6 / §2.8 retraction: the SWA half of ``get_cpu_copy`` stops one position early (upstream's ``seqlen - 1``).

    The copy's ``swa_mask`` clears the last position, although its KV is written: on
    resumption ``load_cpu_copy`` restores every in-window SWA row but that one, which
    keeps whatever the new SWA slot held (D3: ``load_cpu_copy`` must lose nothing).
    Differs: P=1: ``alloc(2)``, write SWA layer 0, copy, free, ``alloc(2)``, load: the new
    slot of position 1 keeps its zero SWA row.
    """

    def get_cpu_copy(self, indices: Tensor) -> KVCpuCopy:
        copy = super().get_cpu_copy(indices)
        mask, swa = copy["swa_mask"], copy["swa"]
        if mask is None or swa is None or not bool(mask[-1]):
            return copy
        mask = mask.clone()
        mask[-1] = False
        return {**copy, "swa": swa[:, :, :-1] if swa.shape[2] > 1 else None, "swa_mask": mask}


class FreeForgetsEvictedPages(SWATokenToKVPoolAllocator):
    """§1.5 ``free`` (finish, retraction): the full pages to release are found through the SWA side.

    Only full pages with a live slot still mapped (``M > 0``) are released; pages whose
    SWA side was evicted (§1.6) or never allocated (the non-tail head of a tail
    preallocation, §2.7) stay allocated in the full pool, owned by nobody (G3 leak).
    Differs: P=2: ``alloc_extend_swa_tail`` 0 -> 4 with tail 2, ``free`` of its 4 slots:
    full page 1 (the head) stays taken.
    """

    def free(self, free_index: Tensor) -> None:
        self._invalidate_at(InvalidationPoint.FREE_SWA)  # free reaches free_swa's point
        pages = self._check_release("free", free_index)
        slots, live = self.full_attn_allocator.live_slots_of(pages)
        mapped = (self.full_to_swa_index_mapping.index_select(0, slots) > 0) & live
        keep = mapped.reshape(pages.numel(), -1).any(dim=1)  # before _release_swa zeroes M
        self._release_swa(pages)
        self._release_full(pages[keep])


class SwaAvailableCountsReservedPage(SWATokenToKVPoolAllocator):
    """§1.4 / §2.4: ``swa_available_size()`` counts the reserved page 0 as free (``+ P``).

    The SWA budget of the tail gate reads it, so the node admits one page more than the
    pool holds; the report breaks G2 (``available == P * |free_pages|``). ``available_size``
    (``min`` of both) follows it when the SWA pool is the smaller.
    Differs: right after construction (P=4, 16 SWA tokens) ``swa_available_size()`` is 20.
    """

    def swa_available_size(self) -> int:
        return super().swa_available_size() + self.page_size


#: name -> factory ``PoolConfig -> allocator``; the ``decode_prealloc`` suite must kill every one.
MUTANTS: dict[str, Callable[[PoolConfig], SWATokenToKVPoolAllocator]] = {
    "tail_ceil_as_floor_plus_one": TailCeilAsFloorPlusOne,
    "decode_opens_swa_page_late": DecodeOpensSwaPageLate,
    "decode_batch_shares_page": DecodeBatchSharesPage,
    "evict_one_page_too_many": EvictOnePageTooMany,
    "evict_one_page_too_few": EvictOnePageTooFew,
    "retract_drops_last_swa_row": RetractDropsLastSwaRow,
    "free_forgets_evicted_pages": FreeForgetsEvictedPages,
    "swa_available_counts_reserved_page": SwaAvailableCountsReservedPage,
}
