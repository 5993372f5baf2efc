"""Deliberately broken variants of the torch ``SWATokenToKVPoolAllocator``, for mutation testing.

Each mutant is a subclass with one small override reproducing a real (or plausible)
bug of SGLang's SWA pools (sglang_semantics.md §2.11, §8). Its docstring names the
bug, the invariant it breaks (§7 ids) and a short op sequence on which it differs
from the correct runtime (``tests/conformance/test_mutants_differ.py`` runs those).

:data:`MUTANTS` maps a name to a factory ``PoolConfig -> allocator`` (the class
itself: ``Mutant(config)`` builds it on the default device). The lockstep suite
must catch every one of them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvproof.gpu_runtime.paged import PagedTokenToKVPoolAllocator, as_index
from kvproof.gpu_runtime.swa_allocator import SWATokenToKVPoolAllocator
from kvproof.gpu_runtime.swa_kv_pool import SWAKVPool
from kvproof.reference.config import PoolConfig

__all__ = ["MUTANTS"]

Tensor = torch.Tensor


class LeakOnFailedAlloc(SWATokenToKVPoolAllocator):
    """An ``alloc_extend`` that fails for want of SWA pages has already taken full pages.

    Breaks G4 (all-or-nothing) and G3 (the taken full pages are neither free nor owned).
    Differs: P=4, 8 full / 2 SWA pages; ``alloc_extend`` 0 -> 12 raises OutOfMemory(swa)
    in both, but here the full free list lost 3 pages.
    """

    def _check_capacity(self, op: str, full_pages: int, swa_pages: int) -> None:
        full = self.full_attn_allocator
        if op == "alloc_extend" and swa_pages > self.swa_attn_allocator.num_free_pages():
            full.take_pages(min(full_pages, full.num_free_pages()))  # consumed before the SWA side is checked
        super()._check_capacity(op, full_pages, swa_pages)


class WrongPageRounding(SWATokenToKVPoolAllocator):
    """The new-page count floors instead of ceiling: ``Σ s//P - p//P``.

    Too few pages are taken, so the last partial page of a request reuses an earlier
    page: its slots are handed out twice (G3, M2), and the free list is off (G4).
    Differs: P=4, ``alloc_extend`` 0 -> 6 returns [4,5,6,7,4,5] and takes one page.
    """

    def _count_new_pages(self, prefix_cpu: Tensor, seq_cpu: Tensor) -> int:
        p = self.page_size
        return int((seq_cpu // p - prefix_cpu // p).sum())


class FreeSwaKeepsMapping(SWATokenToKVPoolAllocator):
    """``free_swa`` (and ``free``'s SWA half) release the SWA pages but leave M in place.

    Breaks M3 (``M[F] == 0`` after ``free_swa``) and then M2: the released SWA slots are
    still reachable, and a second release double-frees them (G1).
    Differs: P=4, ``alloc_extend`` 0 -> 4, ``free_swa([4])``: M[4..7] stays [4..7].
    """

    def _zero_released_mapping(self, slots: Tensor) -> None:
        pass


class NonatomicAllocDecode(SWATokenToKVPoolAllocator):
    """Upstream R7 (§2.11, §8 item 3): ``alloc_decode`` allocates full, then finds the SWA pool short.

    The full pages stay consumed although the call fails: breaks G4 and G3 (leak).
    Differs: P=4, 8 full / 1 SWA page; decode seq [1] succeeds, a second decode seq [1]
    raises OutOfMemory(swa) in both, but here one more full page is gone.
    """

    def _check_capacity(self, op: str, full_pages: int, swa_pages: int) -> None:
        full, swa = self.full_attn_allocator, self.swa_attn_allocator
        if op == "alloc_decode" and full_pages <= full.num_free_pages() and swa_pages > swa.num_free_pages():
            full.take_pages(full_pages)  # the full allocation already ran
        super()._check_capacity(op, full_pages, swa_pages)


class _LegacyMaskKVPool(SWAKVPool):
    def _swa_rows_to_load(self, swa: Tensor, old_mask: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
        row_mask = t > 0  # legacy: the NEW mask, over positions, applied to the saved (old-mask) rows
        return swa[:, :, row_mask], t[row_mask]


class MaskAsymmetry(SWATokenToKVPoolAllocator):
    """``load_cpu_copy`` uses the legacy ``row_mask = new_mask``, destinations ``t[new_mask]`` (§2.8).

    A masked copy saves only the rows of positions mapped at copy time; indexing them
    with the load-time position mask misaligns rows and positions (D3, mask symmetry);
    upstream's ``_filter_swa_cpu_copy`` then raises IndexError when the counts differ.
    Differs: S4 (P=1): M = [0,0,9,10,11,12] at copy, [0,0,0,0,21,22] at load: IndexError.
    """

    kv_pool_class = _LegacyMaskKVPool


class TailStartOffByOne(SWATokenToKVPoolAllocator):
    """The tail mapping starts one slot early: ``M[F[-tail-1:-1]] = S``.

    Breaks M4 (mapped positions are exactly the tail) and M5 (in-page offsets differ);
    the last position has no SWA slot.
    Differs: P=4, ``alloc_extend_swa_tail`` 0 -> 8 with tail 4: M[7..11] = [4,5,6,7,0].
    """

    def _split_tail(self, full: Tensor, swa_tail_len: int) -> tuple[Tensor, Tensor]:
        n_head = max(full.numel() - swa_tail_len - 1, 0)
        return full[:n_head], full[n_head:n_head + swa_tail_len]


class DoubleFreeAccepted(SWATokenToKVPoolAllocator):
    """``free`` trusts its caller, as upstream (R5): a page already free is released again.

    The page appears twice in the free list (G1), so two later owners share it (G3, M2).
    Differs: P=4, ``alloc_extend`` 0 -> 4, ``free([4])``, ``free([4])``: the second call
    succeeds and the full free list starts [1, 1, ...].
    """

    def _check_release(self, op: str, free_index: Tensor) -> Tensor:
        if op == "free":  # no liveness check: just the pages touched
            return self._touched_pages(as_index(free_index, self.device), None)
        return super()._check_release(op, free_index)


class SlotZeroHandedOut(SWATokenToKVPoolAllocator):
    """``clear()`` puts the reserved page 0 at the front of the full free list.

    Breaks G1 (page 0 never free) and §1.4: the padding slot 0 is handed out, so
    CUDA-graph dummy writes land in a live request's KV.
    Differs: right after construction the full free list is [0, 1, 2, ...].
    """

    def clear(self) -> None:
        super().clear()
        full = self.full_attn_allocator
        full.free_pages = torch.cat((torch.zeros(1, dtype=torch.int64, device=self.device), full.free_pages))


class StaleTailMapping(SWATokenToKVPoolAllocator):
    """Pre-#25805 (R1): the tail allocation does not clear M on the non-tail new slots.

    A recycled page keeps a stale mapping (left by ``restore_state``, R3) that a later
    window eviction frees: an SWA double free (M2, G1). Scenario S3 (§9).
    Differs: P=2: backup, ``alloc_extend`` 0 -> 2, restore, ``alloc_extend_swa_tail``
    0 -> 4 with tail 2: M[2], M[3] stay [2, 3] instead of [0, 0].
    """

    def _clear_head_mapping(self, head: Tensor) -> None:
        pass


class SwaLastLocUntranslated(SWATokenToKVPoolAllocator):
    """The SWA side of a 1:1 extend continues from the FULL ``last_loc`` instead of ``M[last_loc]``.

    Part 1 on the SWA side writes into whatever SWA page has the full page's number:
    breaks M2 (maps to a free or foreign SWA slot) and M5.
    Differs: P=2: A 0 -> 2, ``free_swa(A)``, B 0 -> 1 (full 4, SWA 2), B 1 -> 2 from
    last_loc 4: M[5] = 5 instead of 3.
    """

    def _swa_last_loc(self, last_loc: Tensor) -> Tensor:
        return last_loc


class RestoreForgetsSwa(SWATokenToKVPoolAllocator):
    """``restore_state`` rolls back only the full free list; the SWA pages of the draft stay taken.

    Breaks G3 on the SWA side (owned by nobody, reachable from no live slot: a leak).
    Differs: P=4: backup, ``alloc_extend`` 0 -> 4, restore: the SWA free list lacks page 1.
    """

    def restore_state(self, state: object) -> None:
        swa_now = self.swa_attn_allocator.backup_state()
        super().restore_state(state)
        self.swa_attn_allocator.restore_state(swa_now)


class _AppendingPool(PagedTokenToKVPoolAllocator):
    def release_pages(self, pages: Tensor) -> None:
        self.fill.index_fill_(0, pages, 0)
        self.free_pages = torch.cat((self.free_pages, pages))  # FIFO at every page size


class FreeOrderAppend(SWATokenToKVPoolAllocator):
    """At P > 1 released pages are appended (token-allocator FIFO) instead of prepended sorted.

    Harmless for safety but breaks the SGLang 0.5.23 order that ``EXACT_PAGE_ORDER``
    promises (§1.3, §8 item 10): a different page is reused first.
    Differs: P=4, ``alloc_extend`` 0 -> 8, ``free([4])``: full free list [3, ..., 1].
    """

    pool_class = _AppendingPool


class FreeFullUnchecked(SWATokenToKVPoolAllocator):
    """``free_full`` skips 0.5.23's ``swa.peer_released`` guard: live SWA peers are stranded.

    The SWA pages stay allocated but unreachable (G3 leak), and M keeps pointing at
    them from a free full page (M2).
    Differs: P=4, ``alloc_extend`` 0 -> 4, ``free_full([4])`` succeeds here.
    """

    def free_full(self, free_index: Tensor) -> None:
        self._release_full(self._check_release("free_full", free_index))  # no M == 0 guard


class ClearDropsSentinel(SWATokenToKVPoolAllocator):
    """``clear()`` zeroes the whole mapping, the trailing -1 sentinel included (M1).

    ``translate(-1)`` then yields 0 instead of -1, so a prefix-less SWA last_loc reads
    as the padding slot.
    Differs: right after construction ``M[-1] == 0``.
    """

    def clear(self) -> None:
        super().clear()
        self.full_to_swa_index_mapping.zero_()


class GroupIgnored(SWATokenToKVPoolAllocator):
    """``free_group_begin`` opens nothing: releases inside a group go back at once (0.5.23 holds them to the end).

    Inside the group the free lists already hold pages the caller's batch has not finished with; the order after
    the end differs too (EXACT_PAGE_ORDER; §1.5a).
    Differs: P=4, ``alloc_extend`` 0 -> 4, ``free_group_begin``, ``free([4])``: the page is free before the end.
    """

    def free_group_begin(self) -> None:
        pass

    def free_group_end(self) -> None:
        pass


class GroupEndInCallOrder(SWATokenToKVPoolAllocator):
    """``free_group_end`` gives the full pages of the group's ``free`` calls back in call order, not as the sorted
    set 0.5.23's one ``free(cat(pending))`` makes (EXACT_PAGE_ORDER; §1.5a).
    Differs: P=4, two requests of one page each, ``free`` the second then the first in one group: the free list
    starts with page 2, page 1 (0.5.23: 1, 2).
    """

    def free_group_end(self) -> None:
        group = self._group
        if group is not None and group.full_set and self.page_size > 1:
            group.full_ids[:0] = group.full_set  # in call order, as page ids, before the segments' pages
            group.full_set.clear()
        super().free_group_end()


class GroupMappingKeptToEnd(SWATokenToKVPoolAllocator):
    """Inside a free group ``free_swa`` (and ``free``'s SWA side) leaves the mapping until the group ends.

    0.5.23 clears it at the call ("resolve ownership now": a cache action later in the group may re-point the slot);
    here M still names released SWA pages inside the group (M3; §1.5a).
    Differs: P=4, ``alloc_extend`` 0 -> 4, ``free_group_begin``, ``free_swa([4])``: M[4] is still non-zero.
    """

    def _zero_released_mapping(self, slots: Tensor) -> None:
        if self._group is None:
            super()._zero_released_mapping(slots)
        else:
            pending = self.__dict__.setdefault("_pending_zero", [])
            pending.append(slots.clone())

    def free_group_end(self) -> None:
        for slots in self.__dict__.pop("_pending_zero", []):
            super()._zero_released_mapping(slots)
        super().free_group_end()


class SegmentSortsPages(SWATokenToKVPoolAllocator):
    """``free_segment`` gives its pages back as a sorted set, as ``free`` does, not in the segment's order (0.5.23's
    ``free_page_ids``: one representative per page, no sort; EXACT_PAGE_ORDER, §1.5a).
    Differs: P=4, three one-page requests on pages 1, 2, 3; free the first, then the third; a two-page request gets
    pages 3, 1; ``free_segment`` of it puts 1, 3 at the head of the free list (0.5.23: 3, 1).
    """

    def _segment_apply(self, reps: Tensor, swa_pages: Tensor | None, *, full: bool) -> None:
        if self.page_size > 1 and reps.numel() > 1:
            order = torch.argsort(reps)
            reps = reps.index_select(0, order)
            swa_pages = None if swa_pages is None else torch.sort(swa_pages).values
        super()._segment_apply(reps, swa_pages, full=full)


class SegmentPeerUnchecked(SWATokenToKVPoolAllocator):
    """``free_segment`` skips the ``swa.peer_mapped`` check, as 0.5.23 does with its checks off: a segment whose
    SWA side was released gives the reserved SWA page 0 back (M1, G3; F2's segment shape).
    Differs: P=4, ``alloc_extend`` 0 -> 4, ``free_swa([4..7])``, ``free_segment([4..7], start_pos=0)`` succeeds and
    puts SWA page 0 in the free list.
    """

    def _require_peers(self, op: str, peers: Tensor) -> None:
        pass


class RingAvailableTakesMin(SWATokenToKVPoolAllocator):
    """Ring mode: ``available_size`` still takes ``min(full, swa)`` (the paged path's), so the request slots' ring
    capacity limits token growth, which 0.5.23's ring branch rules out ("the SWA ring ... never constrains token
    growth"; SR1, docs/sglang-findings.md "The per-request SWA ring").
    Differs: P=2, 24 full tokens, ring 3 x 4 slots (cost 4): right after construction ``available_size()`` is 16,
    not 24.
    """

    def available_size(self) -> int:
        return min(self.full_available_size(), self.swa_available_size())


class RingExtendGatedBySwaPool(SWATokenToKVPoolAllocator):
    """Ring mode: an allocation also needs the (unused) paged SWA pool to have its pages, as
    ``new_pages_available`` without its ring branch would: a request the full pool fits is refused (SR1, SR3; G4's
    outcome side).
    Differs: P=2, 24 full / 4 SWA tokens, ring 3 x 4 slots: ``alloc_extend`` 0 -> 6 raises OutOfMemory(swa) here.
    """

    def _check_capacity(self, op: str, full_pages: int, swa_pages: int) -> None:
        super()._check_capacity(op, full_pages, full_pages if self._ring else swa_pages)


class RingAllocTakesSwa(SWATokenToKVPoolAllocator):
    """Ring mode: ``alloc`` takes paged SWA pages and writes M as the paged path does (SGLang 0.5.23's ``alloc`` has
    no ring branch: finding F8), and the ring's ``free`` never gives them back nor clears M (SR3, M3, G3).
    Differs: P=2, 24 full / 12 SWA tokens, ring 3 x 4 slots: ``alloc(2)`` leaves SWA page 1 taken and M[2..3] = [2, 3].
    """

    def alloc(self, need_size: int) -> Tensor:
        ring, self._ring = self._ring, False
        try:
            return super().alloc(need_size)
        finally:
            self._ring = ring


MUTANTS: dict[str, Callable[[PoolConfig], SWATokenToKVPoolAllocator]] = {
    "leak_on_failed_alloc": LeakOnFailedAlloc,
    "wrong_page_rounding": WrongPageRounding,
    "free_swa_keeps_mapping": FreeSwaKeepsMapping,
    "nonatomic_alloc_decode": NonatomicAllocDecode,
    "mask_asymmetry": MaskAsymmetry,
    "tail_start_off_by_one": TailStartOffByOne,
    "double_free_accepted": DoubleFreeAccepted,
    "slot_zero_handed_out": SlotZeroHandedOut,
    "stale_tail_mapping": StaleTailMapping,
    "swa_last_loc_untranslated": SwaLastLocUntranslated,
    "restore_forgets_swa": RestoreForgetsSwa,
    "free_order_append": FreeOrderAppend,
    "free_full_unchecked": FreeFullUnchecked,
    "clear_drops_sentinel": ClearDropsSentinel,
    "group_ignored": GroupIgnored,
    "group_end_in_call_order": GroupEndInCallOrder,
    "group_mapping_kept_to_end": GroupMappingKeptToEnd,
    "segment_sorts_pages": SegmentSortsPages,
    "segment_peer_unchecked": SegmentPeerUnchecked,
    "ring_available_takes_min": RingAvailableTakesMin,
    "ring_extend_gated_by_swa_pool": RingExtendGatedBySwaPool,
    "ring_alloc_takes_swa": RingAllocTakesSwa,
}
