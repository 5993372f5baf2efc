"""``SWATokenToKVPoolAllocator`` over torch tensors (sglang_semantics.md §1.5, §2.7, §2.8, §7).

Two :class:`~kvproof.gpu_runtime.paged.PagedTokenToKVPoolAllocator` pools (*full* and
*SWA*, page 0 reserved in both), the mapping ``full_to_swa_index_mapping`` (M: one
entry per full slot plus a trailing ``-1`` sentinel, ``0`` = no SWA slot) and an
:class:`~kvproof.gpu_runtime.swa_kv_pool.SWAKVPool` that holds the same M tensor.
Method names and tensor signatures are SGLang 0.5.23's; the observable behaviour
(slots, free-list order, M, errors, KV rows) is exactly ``kvproof.reference.swa_allocator``'s:

* every operation validates its arguments first and raises ``InvalidOperation`` or
  ``OutOfMemory`` with the reference's op and argument names; a failed call changes
  nothing. Capacity of BOTH pools is checked before any page is taken, including in
  ``alloc_decode`` (upstream leaks full pages there, §2.11 R7);
* the tail allocation clears M on the non-tail new slots, also when
  ``swa_tail_len == 0`` (upstream returns early, R2);
* ``free_swa`` releases the SWA pages mapped from the *live* slots of every full page
  it touches and zeroes M on those whole pages (0.5.23's page expansion). Liveness is
  the per-page ``fill`` of the full pool, so a stale entry on a never-handed-out slot
  (left by ``restore_state``, R3) is never released into another owner's SWA page;
* ``backup_state`` / ``restore_state`` roll back free lists and ``fill``, never M (R3),
  and refuse a restore after any release (an ``epoch`` counts releases), because the
  restore would resurrect released pages as allocated;
* ``set_full_to_swa_mapping`` keeps the live mapping well formed (M2 with ghost page
  owners, M5, G3: :mod:`._mapping`), as the reference's.

Ring mode (``PoolConfig.swa_ring_size``: 0.5.23's per-request SWA ring, docs/sglang-findings.md "The per-request SWA
ring"), as the reference's: the request slots are a free-slot list (``alloc_req_slots`` takes from its tail,
``free_req_slots`` appends, ``ReqToTokenPool.alloc_rows`` / ``free_rows``); ``swa_available_size`` = free slots x
``swa_ring_cost``, ``available_size`` = the full pool's; every allocation takes full pages only and never writes M
(``alloc`` too: upstream's has no ring branch, finding F8); ``free_swa`` / ``free_swa_segment`` validate and release
nothing, ``free`` / ``free_segment`` release the full side only.

Loc cache (PR #25824 / #26152, §3.3): the pool memoises ``M[x]``; every mutator of M
drops that cache at its START, before any check that can fail, through one call site
per point (:meth:`_invalidate_at`, consulting :attr:`invalidate_at`): ``alloc``,
``alloc_extend``, ``alloc_extend_swa_tail``, ``alloc_decode``, ``free_swa`` (and
``free``), ``set_full_to_swa_mapping`` (after its empty / length checks), ``clear``.
``free_full``, ``backup_state`` and ``restore_state`` never write M and have none.
``alloc_extend`` / ``alloc_decode`` continue the SWA side from the cached translation
of ``last_loc`` (C4: it is taken after the invalidation and before M is written, and
the new entries never overlap ``last_loc``). ``register_mapping`` installs a fresh M,
which the pool's ``register_mapping`` follows with its own invalidation. The engine
hooks ``forward`` / ``capture`` / ``replay`` (:mod:`.loc_cache`) carry the points
``forward`` and ``run_once``.

Throughput: allocation and release are a fixed number of tensor ops per call, whatever
the batch (no per-token Python loop, no Python loop over device data). Every host rule,
page count, plan and ghost-owner decision reads the ``*_cpu`` twins as Python lists, per
request (:mod:`._validate`, :mod:`._geometry`); host-made index vectors reach the device
with an asynchronous copy. The ``last_loc`` rules cost one comparison and one sync (one
more each for M5 and for distinct continued pages, only when a request continues a
page); errors cost a few reductions. ``snapshot`` returns the previous (frozen) snapshot
objects again when the free lists and mapping it reads are equal to theirs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvproof.gpu_runtime._geometry import Plan, SinglePlan, count_new_pages, decode_plan, extend_plan, page_slots
from kvproof.gpu_runtime._mapping import Owners, check_live_mapping
from kvproof.gpu_runtime._validate import ExtendArgs, HostBatch, check_extend_args, check_swa_continuation, host_batch
from kvproof.gpu_runtime.loc_cache import GraphRunner, ModelRunner
from kvproof.gpu_runtime.paged import PagedBackup, PagedTokenToKVPoolAllocator, as_index, resolve_device
from kvproof.gpu_runtime.swa_kv_pool import KVCpuCopy, SWAKVPool
from kvproof.reference.arith import split_kv_row_segments
from kvproof.reference.config import PoolConfig
from kvproof.reference.contract import Capability
from kvproof.reference.errors import InvalidOperation, InvariantViolation, OutOfMemory, ensure, require
from kvproof.reference.loc_cache import UPSTREAM_POINTS, InvalidationPoint
from kvproof.reference.registry import Component
from kvproof.reference.snapshot import AllocatorSnapshot, PoolSnapshot, allocator_snapshot, pool_snapshot

__all__ = ["SWAAllocatorBackup", "SWATokenToKVPoolAllocator"]

Tensor = torch.Tensor
P = InvalidationPoint


@dataclass(slots=True)
class _FreeGroup:
    """The pages an open free group holds back, per pile (``reference.swa_allocator.FreeGroup``)."""

    swa_ids: list[Tensor] = field(default_factory=list)
    swa_set: list[Tensor] = field(default_factory=list)
    full_set: list[Tensor] = field(default_factory=list)
    full_ids: list[Tensor] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class SWAAllocatorBackup:
    """What ``backup_state`` captures: both free lists and fills, and the release epoch."""

    full: PagedBackup
    swa: PagedBackup
    epoch: int
    num_pages: tuple[int, int]


class SWATokenToKVPoolAllocator:
    """SGLang's SWA composite allocator: failure by exception, observation by :meth:`snapshot`."""

    #: classes built at construction (a mutant may substitute a broken one)
    pool_class: type[PagedTokenToKVPoolAllocator] = PagedTokenToKVPoolAllocator
    kv_pool_class: type[SWAKVPool] = SWAKVPool
    #: everything but DECODE_BUDGETS (an engine's own preallocation-queue functions: kvproof's are the reference's)
    capabilities: frozenset[Capability] = frozenset(Capability) - {Capability.DECODE_BUDGETS}
    components = frozenset({Component.SWA_ALLOCATOR, Component.LOC_CACHE, Component.DECODE_PREALLOC})
    #: the loc-cache invalidation points this allocator, its runners and its pool honour
    #: (all: upstream after #26152); a mutant drops one
    invalidate_at: ClassVar[frozenset[InvalidationPoint]] = UPSTREAM_POINTS
    #: graph recording: ``None`` = a real CUDA graph on CUDA, the emulation elsewhere; ``True`` = always emulate
    emulate_graphs: ClassVar[bool | None] = None
    model_runner_class: ClassVar[type[ModelRunner]] = ModelRunner
    graph_runner_class: ClassVar[type[GraphRunner]] = GraphRunner

    def __init__(self, config: PoolConfig, device: torch.device | str | None = None) -> None:
        self.config, self.page_size = config, config.page_size
        self.device = resolve_device(device)
        self._size_full, self._size_swa = config.size_full, config.size_swa
        self.full_attn_allocator = self.pool_class(config.size_full, self.page_size, self.device, "full")
        self.swa_attn_allocator = self.pool_class(config.size_swa, self.page_size, self.device, "swa")
        self.full_to_swa_index_mapping = self._fresh_mapping()
        self._epoch = 0  # bumped by every release; restore_state needs it unchanged
        self._group: _FreeGroup | None = None  # the open free group (free_group_begin)
        self._last_snapshot: AllocatorSnapshot | None = None  # the previous snapshot() and its pools' parts
        self._last_pool_snapshots: dict[str, PoolSnapshot] = {}
        self._owners = Owners(config.num_pages_full, config.num_pages_swa, self.device)  # ghost, for M2
        # ring mode: the SWA side is each request slot's ring (ReqToTokenPool's free slots, slot 0 its padding row)
        self._ring, self._ring_cost = config.ring, config.swa_ring_cost
        self._req_free: list[int] = list(range(1, (config.num_req_slots or 0) + 1))
        # the pool exists before clear(), because clear invalidates its cache
        self._kvcache = self.kv_pool_class(config, self.device)
        if P.REGISTER_MAPPING not in self.invalidate_at:  # that point is the pool's own (SWAKVPool.register_mapping)
            self._kvcache.register_invalidates = False
        self._kvcache.register_mapping(self.full_to_swa_index_mapping)
        self._kvcache.register_slot_check(self.full_attn_allocator.check_live)
        self._model_runner = self.model_runner_class(self._kvcache, self._invalidate_at)
        self._graph_runner = self.graph_runner_class(self._kvcache, self._invalidate_at, emulate=self.emulate_graphs)
        self.clear()

    def _fresh_mapping(self) -> Tensor:
        """All 0 but the trailing -1: a last_loc of -1 (no prefix) translates to -1 on the SWA side."""
        mapping = torch.zeros(self.config.mapping_len, dtype=torch.int64, device=self.device)
        mapping[-1] = -1
        return mapping

    def _invalidate_at(self, point: InvalidationPoint) -> None:
        """The one call site of each invalidation point: drop the pool's loc cache if ``point`` is on."""
        if point in self.invalidate_at:
            self._kvcache.invalidate_loc_cache()

    # ------------------------------------------------------------ queries

    def available_size(self) -> int:
        """``min(full, swa)`` free tokens (§1.5); in ring mode the full pool's alone."""
        if self._ring:
            return self.full_available_size()
        return min(self.full_available_size(), self.swa_available_size())

    def full_available_size(self) -> int:
        return self.full_attn_allocator.available_size()

    def swa_available_size(self) -> int:
        """The paged SWA pool's free tokens; in ring mode free request slots x ``swa_ring_cost``."""
        if self._ring:
            return len(self._req_free) * self._ring_cost
        return self.swa_attn_allocator.available_size()

    @property
    def size(self) -> int:
        return min(self._size_full, self._size_swa)

    @property
    def size_full(self) -> int:
        return self._size_full

    @property
    def size_swa(self) -> int:
        return self._size_swa

    def get_kvcache(self) -> SWAKVPool:
        return self._kvcache

    def translate_loc_from_full_to_swa(self, kv_indices: Tensor) -> Tensor:
        """``M[kv_indices]`` (any shape) through the pool's loc cache; -1 translates to -1 (sentinel, §1.5)."""
        op, n = "translate_loc_from_full_to_swa", self.full_to_swa_index_mapping.numel() - 1
        idx = kv_indices  # the caller's tensor itself when it can index M: its address is the cache key
        if not (isinstance(idx, Tensor) and idx.device == self.device and idx.dtype in (torch.int64, torch.int32)):
            idx = torch.as_tensor(kv_indices, dtype=torch.int64, device=self.device)
        # -1 (no prefix) or a full slot id: nothing moves when clamped to that range
        require(torch.equal(idx.clamp(-1, n - 1), idx), op, "loc", lambda: f"entries outside [-1, {n})")
        return self._kvcache.translate_loc_from_full_to_swa(idx)

    def snapshot(self) -> AllocatorSnapshot:
        """Free lists in hand-out order and the whole mapping, in the shape every implementation reports (built
        without validation: every field is a Python int or a tuple of them by construction, and the harness takes
        one after every step).

        Snapshots are frozen, so a call that reads the same free lists and mapping as the
        previous one returns the same objects (compared by value, never assumed unchanged).
        """
        full, swa = self._pool_snapshot(self.full_attn_allocator), self._pool_snapshot(self.swa_attn_allocator)
        mapping = tuple(self.full_to_swa_index_mapping.tolist())
        last = self._last_snapshot
        if last is None or last.full is not full or last.swa is not swa or last.full_to_swa_index_mapping != mapping:
            last = self._last_snapshot = allocator_snapshot(full, swa, mapping)
        return last

    def _pool_snapshot(self, pool: PagedTokenToKVPoolAllocator) -> PoolSnapshot:
        free = tuple(pool.free_pages.tolist())
        last = self._last_pool_snapshots.get(pool.name)
        if last is None or last.free_pages != free or (last.page_size, last.num_pages) != (pool.page_size,
                                                                                           pool.num_pages):
            last = pool_snapshot(pool.page_size, pool.num_pages, free)
            self._last_pool_snapshots[pool.name] = last
        return last

    # ------------------------------------------------------------ allocation

    def alloc(self, need_size: int) -> Tensor:
        """``need_size`` tokens in whole pages, 1:1 in both pools (kvproof allows any P, page aligned)."""
        self._invalidate_at(P.ALLOC)
        op, p, need_size = "alloc", self.page_size, int(need_size)
        require(need_size >= 0, op, "need_size", lambda: f"must be >= 0, got {need_size}")
        # the paged bulk alloc takes whole pages
        require(need_size % p == 0, op, "need_size", lambda: f"{need_size} is not a multiple of page_size {p}")
        if self._ring:  # full pages only, M unwritten (upstream's alloc has no ring branch: F8)
            self._check_capacity(op, need_size // p, 0)
            full, _ = self.full_attn_allocator.alloc_pages(need_size)
            return full
        self._check_capacity(op, need_size // p, need_size // p)
        full, fpages = self.full_attn_allocator.alloc_pages(need_size)
        swa, spages = self.swa_attn_allocator.alloc_pages(need_size, keep=False)  # only mapped, below
        self._owners.claim_pages(fpages, spages, self._owners.fresh())
        self._map(full, swa)
        return full

    def alloc_extend(self, prefix_lens: Tensor, prefix_lens_cpu: Tensor, seq_lens: Tensor, seq_lens_cpu: Tensor,
                     last_loc: Tensor, extend_num_tokens: int) -> Tensor:
        """Extend a batch from ``prefix_lens`` to ``seq_lens`` tokens, 1:1 in both pools (§1.3, §1.5)."""
        self._invalidate_at(P.ALLOC_EXTEND)
        op, extend_num_tokens = "alloc_extend", int(extend_num_tokens)
        args = self._extend_args(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc)
        host = host_batch(args)
        check_extend_args(self.full_attn_allocator, op, args, extend_num_tokens, host)
        if not self._ring:  # M5: a ring has no SWA page to continue
            check_swa_continuation(self.full_to_swa_index_mapping, self.page_size, op, args, host)
        plan = extend_plan(*args[:4], extend_num_tokens, self._count_new_pages(args[1], args[3]), self.page_size)
        return self._alloc_one_to_one(op, plan, args)

    def alloc_decode(self, seq_lens: Tensor, seq_lens_cpu: Tensor, last_loc: Tensor) -> Tensor:
        """One token per request at position ``s - 1``; atomic (unlike upstream, §2.11 R7)."""
        self._invalidate_at(P.ALLOC_DECODE)
        op = "alloc_decode"
        seq, seq_cpu = as_index(seq_lens, self.device), as_index(seq_lens_cpu, torch.device("cpu"))
        seq_l = seq_cpu.tolist()
        # the decoded token is at position s - 1
        require(all(s >= 1 for s in seq_l), op, "seq_lens", "must be >= 1")
        args = (seq - 1, seq_cpu - 1, seq, seq_cpu, as_index(last_loc, self.device))
        host = HostBatch([s - 1 for s in seq_l], seq_l)
        check_extend_args(self.full_attn_allocator, op, args, len(seq_l), host)
        if not self._ring:  # M5: a ring has no SWA page to continue
            check_swa_continuation(self.full_to_swa_index_mapping, self.page_size, op, args, host)
        return self._alloc_one_to_one(op, decode_plan(seq, seq_cpu, self.page_size), args)

    def alloc_extend_swa_tail(self, prefix_lens: Tensor, prefix_lens_cpu: Tensor, seq_lens: Tensor,
                              seq_lens_cpu: Tensor, last_loc: Tensor, extend_num_tokens: int,
                              swa_tail_len: int) -> Tensor:
        """Full slots for the whole extend, SWA slots for the last ``swa_tail_len`` only (§2.7, post-#25805)."""
        self._invalidate_at(P.ALLOC_EXTEND_SWA_TAIL)
        op, p = "alloc_extend_swa_tail", self.page_size
        extend_num_tokens, swa_tail_len = int(extend_num_tokens), int(swa_tail_len)
        args = self._extend_args(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc)
        # upstream asserts bs == 1
        require(args[3].numel() == 1, op, "seq_lens",
                lambda: f"tail allocation takes one request, got {args[3].numel()}")
        host = host_batch(args)
        check_extend_args(self.full_attn_allocator, op, args, extend_num_tokens, host)
        require(0 <= swa_tail_len <= extend_num_tokens, op, "swa_tail_len",
                lambda: f"{swa_tail_len} is outside [0, extend_num_tokens={extend_num_tokens}]")
        start = host.seq[0] - swa_tail_len
        # U1: the tail starts on a page boundary, so SWA offsets match position offsets
        require(start % p == 0, op, "swa_tail_len",
                lambda: f"tail start {start} is not a multiple of page_size {p} (U1)")
        plan = extend_plan(*args[:4], extend_num_tokens, self._count_new_pages(args[1], args[3]), p)
        if self._ring:  # full KV for the whole extend, M unwritten (0.5.23's ring branch)
            return self._alloc_full_only(op, plan, args)
        swa_pages = -(-swa_tail_len // p)
        self._check_capacity(op, plan.num_new_pages, swa_pages)
        owner = self._owners.of_requests(args[0], args[1], args[4], p)
        full, fpages = self.full_attn_allocator.alloc_planned_pages(plan, args[4])
        spages = self.swa_attn_allocator.take_pages(swa_pages, copy=False)  # used below, before any release
        swa = page_slots(spages, p)
        if swa.numel() > swa_tail_len:  # the last SWA page is partly used
            swa = swa[:swa_tail_len]
        self.swa_attn_allocator.mark_pages(spages, swa.numel())
        self._owners.claim_pages(fpages, spages, owner)
        head, tail = self._split_tail(full, swa_tail_len)
        self._clear_head_mapping(head)
        self._map(tail, swa)
        return full

    def set_full_to_swa_mapping(self, full_indices: Tensor, swa_indices: Tensor) -> None:
        """``M[full_indices] = swa_indices``: re-attach SWA slots to live full slots (HiCache load-back, §1.5).

        The new live mapping must stay well formed (M2 with owners, M5, no stranded SWA
        page), as the reference's; an empty call is a no-op and does not invalidate. A
        backup taken before a remap is stale (``restore_state`` never restores M).
        """
        op = "set_full_to_swa_mapping"
        f, s = as_index(full_indices, self.device), as_index(swa_indices, self.device)
        require(f.numel() == s.numel(), op, "swa_indices",
                lambda: f"{s.numel()} SWA slots for {f.numel()} full slots")
        if f.numel() == 0:
            return
        self._invalidate_at(P.SET_FULL_TO_SWA_MAPPING)  # upstream: after the empty / length checks
        self.full_attn_allocator.check_live(op, "full_indices", f, duplicates_ok=False)
        p, top = self.page_size, self.swa_attn_allocator.end_slot
        # M1: 0 (no SWA slot) or a real SWA slot: clamping into [P, top) keeps a real one, the mask keeps 0
        require(torch.equal(s.clamp(p, top - 1).mul_(s != 0), s), op, "swa_indices",
                lambda: f"{_first_unreal(s, p, top)} is neither 0 nor an SWA slot in [{p}, {top})")
        candidate = self.full_to_swa_index_mapping.clone()
        candidate.index_copy_(0, f, s)
        try:
            check_live_mapping(self.full_attn_allocator, self.swa_attn_allocator, candidate, self._owners)
        except InvariantViolation as err:
            raise InvalidOperation(op, "swa_indices", f"the mapping would break {err}") from None
        self._map(f, s)  # in place: the pool and any captured graph hold this tensor
        self._epoch += 1  # restore_state never restores M, so it cannot undo a remap: older backups are stale

    # ------------------------------------------------------------ release

    def free(self, free_index: Tensor) -> None:
        """Release the SWA side, then the full pages touched (0.5.23 order). Not idempotent."""
        self._invalidate_at(P.FREE_SWA)  # free reaches free_swa's point
        pages = self._check_release("free", free_index)
        if not self._ring:  # the ring owns no paged SWA peer
            self._release_swa(pages)
        self._release_full(pages)

    def free_swa(self, free_index: Tensor) -> None:
        """Release the SWA pages of the full pages ``free_index`` touches; zero their M (M3). Window eviction."""
        self._invalidate_at(P.FREE_SWA)
        pages = self._check_release("free_swa", free_index)
        if not self._ring:  # ring: validated, nothing released, nothing credited
            self._release_swa(pages)

    def free_full(self, free_index: Tensor) -> None:
        """Release full pages whose SWA side is already released (0.5.23 ``free_full``). No invalidation: M stays."""
        op = "free_full"
        pages = self._check_release(op, free_index)
        slots, live = self.full_attn_allocator.live_slots_of(pages)
        # a live SWA peer would be stranded (0.5.23 guard swa.peer_released)
        peers = self.full_to_swa_index_mapping.index_select(0, slots).mul_(live)  # M where live, else 0
        require(not int(torch.count_nonzero(peers)), op, "free_index",
                "a live slot still maps to an SWA slot: use free or free_swa first")
        self._release_full(pages)

    # ------------------------------------------------------------ free groups and kv-row segments (§1.5a)

    def free_group_begin(self) -> None:
        """Hold releases back until :meth:`free_group_end`; the mapping and the live slots are cleared at once."""
        require(self._group is None, "free_group_begin", "state",
                "a free group is already open (free groups cannot be nested)")
        self._group = _FreeGroup()

    def free_group_end(self) -> None:
        """Give the group's pages back in 0.5.23's order (``reference.swa_allocator.free_group_end``)."""
        group = self._group
        if group is None:
            raise InvalidOperation("free_group_end", "state", "no free group is open (call free_group_begin first)")
        self._group = None
        full, swa, p = self.full_attn_allocator, self.swa_attn_allocator, self.page_size
        if group.swa_ids:
            swa.release_pages(torch.cat(group.swa_ids))
        if group.swa_set:
            swa.release_pages(torch.unique(torch.cat(group.swa_set)))
        if group.full_set:
            both = torch.cat(group.full_set)
            full.release_pages(torch.unique(both) if p > 1 else both)
        if group.full_ids:
            full.release_pages(torch.cat(group.full_ids))
        self._epoch += 1

    def free_segment(self, free_index: Tensor, *, start_pos: int) -> None:
        """Release ``kv_row[start_pos : start_pos + n]`` of one request, both sides, pages in the segment's order."""
        self._segment("free_segment", free_index, start_pos, swa=not self._ring, full=True)

    def free_swa_segment(self, free_index: Tensor, *, start_pos: int) -> None:
        """The SWA side of :meth:`free_segment` alone."""
        self._segment("free_swa_segment", free_index, start_pos, swa=not self._ring, full=False)

    def free_full_segment(self, free_index: Tensor, *, start_pos: int) -> None:
        """The full side of :meth:`free_segment`, for positions whose SWA peers are released."""
        self._segment("free_full_segment", free_index, start_pos, swa=False, full=True)

    def free_kv_row_segments(self, segments: list[tuple[Tensor, int]], *, swa_evicted_seqlen: int,
                             swa_dead_lo: int = 0) -> None:
        """0.5.23 ``free_kv_row_segments``: ``[swa_dead_lo, swa_evicted_seqlen)`` full side only, the rest both
        sides. Every piece is validated before any is released (all or nothing)."""
        dead, alive = split_kv_row_segments([(as_index(t, self.device), s) for t, s in segments], swa_evicted_seqlen,
                                            swa_dead_lo, self.page_size)
        plans = [self._segment_plan("free_full_segment", t, s, swa=False) for t, s in dead if t.numel()]
        plans += [self._segment_plan("free_segment", t, s, swa=not self._ring) for t, s in alive if t.numel()]
        seen = [plan[0] for plan in plans]  # the pieces of one row must not overlap
        if len(seen) > 1:
            both = torch.cat(seen)
            require(torch.unique(both).numel() == both.numel(), "free_kv_row_segments", "segments",
                    "two segments hold the same slot")
        for plan in plans:
            self._segment_apply(*plan, full=True)

    def _segment(self, op: str, free_index: Tensor, start_pos: int, *, swa: bool, full: bool) -> None:
        idx = as_index(free_index, self.device)
        if not idx.numel():
            return
        if not (swa or full):  # ring mode's free_swa_segment: the checks of a segment, then nothing released
            self._segment_plan(op, idx, start_pos, swa=False, peers_checked=False)
            return
        self._segment_apply(*self._segment_plan(op, idx, start_pos, swa=swa), full=full)

    def _segment_plan(self, op: str, idx: Tensor, start_pos: int, *, swa: bool,
                      peers_checked: bool = True) -> tuple[Tensor, Tensor | None]:
        """Validate one segment: ``(its representative slots, their SWA pages or None)``."""
        p, m = self.page_size, self.full_to_swa_index_mapping
        self.full_attn_allocator.check_live(op, "free_index", idx, duplicates_ok=False,
                                            freed_means="is already free (double free)")
        require(start_pos >= 0 and start_pos % p == 0, op, "start_pos",
                f"segment start {start_pos} is not page-aligned (page_size {p})")
        k = torch.arange(idx.numel(), device=idx.device)
        head = idx.index_select(0, k - k % p)  # the first slot of each position's page chunk
        require(bool(((idx % p == k % p) & (idx // p == head // p)).all()), op, "free_index",
                "not a kv-row segment from a page boundary (position k must sit at in-page offset k % page_size, "
                "page_size positions per page)")
        reps = idx[::p]
        if not swa:
            require(not peers_checked or not bool(m.index_select(0, idx).any()), op, "free_index",
                    "a slot still maps to an SWA slot: use free_segment")
            return reps, None
        peers = m.index_select(0, reps)
        self._require_peers(op, peers)
        return reps, torch.div(peers, p, rounding_mode="floor") if p > 1 else peers

    def _require_peers(self, op: str, peers: Tensor) -> None:
        """Every page of a segment released on both sides still has its SWA peer (0.5.23 ``swa.peer_mapped``)."""
        require(bool((peers > 0).all()), op, "free_index",
                "a position has no SWA peer (released by window eviction): free it with free_full_segment")

    def _segment_apply(self, reps: Tensor, swa_pages: Tensor | None, *, full: bool) -> None:
        p, group = self.page_size, self._group
        if swa_pages is not None:
            self._invalidate_at(P.FREE_SWA)
            self._zero_released_mapping(self.full_attn_allocator.page_slots(torch.div(reps, p, rounding_mode="floor"))
                                        if p > 1 else reps)
            if group is None:
                self.swa_attn_allocator.release_pages(swa_pages)
            else:
                group.swa_ids.append(swa_pages.clone())
        if full:
            pages = torch.div(reps, p, rounding_mode="floor") if p > 1 else reps
            if group is None:
                self.full_attn_allocator.release_pages(pages)
            else:  # P > 1: free_page_ids' pile; P == 1: free's (the token allocator frees the slots)
                self._hold_full(pages, group.full_ids if p > 1 else group.full_set)
        self._epoch += 1

    def clear(self) -> None:
        """Both pools back to the initial free lists, M all 0 but the sentinel (in place: the pool holds M)."""
        self._invalidate_at(P.CLEAR)
        self.full_attn_allocator.clear()
        self.swa_attn_allocator.clear()
        self.full_to_swa_index_mapping[:-1] = 0
        self._group = None
        self._epoch += 1

    def register_mapping(self) -> None:
        """A fresh mapping tensor (every page free, M all 0 but the sentinel) registered with the same KV pool.

        What building a new allocator over an existing ``SWAKVPool`` does (#25889): the
        pool's ``register_mapping`` drops its cache (point ``register_mapping``); this
        allocator's ``clear`` point is not involved. KV rows stay, unreachable. A graph
        captured before follows the new tensor (``GraphRunner`` refreshes the old one).
        """
        self.full_attn_allocator.clear()
        self.swa_attn_allocator.clear()
        self.full_to_swa_index_mapping = self._fresh_mapping()
        self._epoch += 1  # every page was released: older backups are stale
        self._kvcache.register_mapping(self.full_to_swa_index_mapping)

    def backup_state(self) -> SWAAllocatorBackup:
        """Both free lists and fills (0.5.12.post1 semantics: M is NOT captured, R3)."""
        full, swa = self.full_attn_allocator, self.swa_attn_allocator
        return SWAAllocatorBackup(full.backup_state(), swa.backup_state(), self._epoch, (full.num_pages, swa.num_pages))

    def restore_state(self, state: object) -> None:
        """Give back every page allocated since ``state``; M keeps its entries (R3, §8 item 1): no invalidation."""
        op, full, swa = "restore_state", self.full_attn_allocator, self.swa_attn_allocator
        if not isinstance(state, SWAAllocatorBackup):
            raise InvalidOperation(op, "state", "not a backup_state() result")
        # only allocations may happen between backup_state and restore_state
        require(state.epoch == self._epoch, op, "state",
                f"pages were released since backup_state (epoch {state.epoch} -> {self._epoch})")
        require(state.num_pages == (full.num_pages, swa.num_pages), op, "state",
                "backup comes from a pool of another size")
        full.restore_state(state.full)
        swa.restore_state(state.swa)
        self._epoch += 1  # a restore releases pages too: any other backup is stale from now on

    # ------------------------------------------------------------ request slots of the per-request SWA ring

    def alloc_req_slots(self, need_size: int) -> list[int]:
        """Take ``need_size`` request slots from the tail of the free-slot list (``ReqToTokenPool.alloc_rows``)."""
        op, need_size = "alloc_req_slots", int(need_size)
        self._require_ring(op)
        require(need_size >= 0, op, "need_size", lambda: f"must be >= 0, got {need_size}")
        free = self._req_free
        if need_size > len(free):
            raise OutOfMemory(op, "req_slots", need_size, len(free))
        if need_size == 0:
            return []
        taken = free[-need_size:]
        del free[-need_size:]
        return taken

    def free_req_slots(self, indices: list[int]) -> None:
        """Give request slots back, appended in order (``ReqToTokenPool.free_rows``); each must be held."""
        op, n, slots = "free_req_slots", self.config.num_req_slots or 0, [int(x) for x in indices]
        self._require_ring(op)
        free = set(self._req_free)
        for i, slot in enumerate(slots):
            if not 1 <= slot <= n:
                raise InvalidOperation(op, "indices", f"request slot {slot} is outside [1, {n}]")
            if slot in free or slot in slots[:i]:
                raise InvalidOperation(op, "indices", f"request slot {slot} is not held (double free)")
        self._req_free.extend(slots)

    def _require_ring(self, op: str) -> None:
        require(self._ring, op, "state", "the allocator has no per-request SWA ring (PoolConfig.swa_ring_size is "
                                         "None): request slots are not its to count")

    # ------------------------------------------------------------ KV rows and CPU copies

    def get_cpu_copy(self, indices: Tensor) -> KVCpuCopy:
        return self._kvcache.get_cpu_copy(indices)

    def load_cpu_copy(self, kv_cache_cpu: KVCpuCopy, indices: Tensor) -> None:
        self._kvcache.load_cpu_copy(kv_cache_cpu, indices)

    # ------------------------------------------------------------ engine hooks (loc cache, §3.3)

    def forward(self, out_cache_loc: Tensor, cache_k: Mapping[int, Tensor], cache_v: Mapping[int, Tensor]) -> None:
        """One forward: invalidate (point ``forward``), then each layer's ``set_kv_buffer`` at ``out_cache_loc``."""
        self._model_runner.forward(out_cache_loc, cache_k, cache_v)

    def capture(self, static_loc: Tensor, static_k: Mapping[int, Tensor], static_v: Mapping[int, Tensor], *,
                warmups: int = 2) -> None:
        """Warm up and capture ``run_once`` on the static buffers (``static_loc`` all padding); replaces a graph."""
        self._graph_runner.capture(static_loc, static_k, static_v, warmups)

    def replay(self) -> None:
        """A forward that replays the captured graph on the static buffers' current contents."""
        self._graph_runner.replay()

    # ------------------------------------------------------------ self-check

    def check_invariants(self) -> None:
        """Structural self-check (``GenericCache.check_valid`` style): G1-G3 per pool, M1, M2, M5."""
        self.full_attn_allocator.check_invariants()
        self.swa_attn_allocator.check_invariants()
        self._check_mapping_values()
        check_live_mapping(self.full_attn_allocator, self.swa_attn_allocator, self.full_to_swa_index_mapping,
                           self._owners)

    # ------------------------------------------------------------ internals (mutants override these)

    def _extend_args(self, prefix_lens: Tensor, prefix_lens_cpu: Tensor, seq_lens: Tensor, seq_lens_cpu: Tensor,
                     last_loc: Tensor) -> ExtendArgs:
        dev, cpu = self.device, torch.device("cpu")
        return (as_index(prefix_lens, dev), as_index(prefix_lens_cpu, cpu), as_index(seq_lens, dev),
                as_index(seq_lens_cpu, cpu), as_index(last_loc, dev))

    def _count_new_pages(self, prefix_cpu: Tensor, seq_cpu: Tensor) -> int:
        """``Σ ceil(s/P) - ceil(p/P)`` from the host twins (``get_num_new_pages``)."""
        return count_new_pages(prefix_cpu, seq_cpu, self.page_size)

    def _check_capacity(self, op: str, full_pages: int, swa_pages: int) -> None:
        """Both pools before any mutation (G4: all-or-nothing)."""
        for pool, need in ((self.full_attn_allocator, full_pages), (self.swa_attn_allocator, swa_pages)):
            if need > pool.num_free_pages():
                raise OutOfMemory(op, pool.name, need, pool.num_free_pages())

    def _alloc_one_to_one(self, op: str, plan: Plan, args: ExtendArgs) -> Tensor:
        """The shared body of ``alloc_extend`` / ``alloc_decode`` after validation."""
        if self._ring:
            return self._alloc_full_only(op, plan, args)
        last_loc = args[4]
        self._check_capacity(op, plan.num_new_pages, plan.num_new_pages)
        swa_last_loc = self._swa_last_loc(last_loc)  # before this call writes M (C4)
        owners = self._owners.of_requests(args[0], args[1], last_loc, self.page_size)
        full, fpages = self.full_attn_allocator.alloc_planned_pages(plan, last_loc)
        swa, spages = self.swa_attn_allocator.alloc_planned_pages(plan, swa_last_loc, keep=False)  # only mapped
        self._claim(plan, owners, (full, fpages), (swa, spages))
        self._map(full, swa)
        return full

    def _alloc_full_only(self, op: str, plan: Plan, args: ExtendArgs) -> Tensor:
        """Ring mode's allocation: the full pages of ``plan``, capacity the full pool's, M unwritten."""
        self._check_capacity(op, plan.num_new_pages, 0)
        # no ghost owners: they pair full pages with SWA pages (M2), and a ring maps none
        full, _ = self.full_attn_allocator.alloc_planned_pages(plan, args[4])
        return full

    def _claim(self, plan: Plan, owners: int | Tensor, full: tuple[Tensor, Tensor], swa: tuple[Tensor, Tensor]) -> None:
        """Ghost owners of the pages a 1:1 allocation took (``(slots, pages)`` per pool); continued ones keep theirs."""
        fpages, spages = full[1], swa[1]
        if not isinstance(owners, Tensor) or owners.numel() == 1:  # one request: its new pages
            if plan.num_new_pages:
                self._owners.claim_pages(fpages, spages, owners)
            return
        if isinstance(plan, SinglePlan) or not (fpages.numel() or spages.numel()):
            return
        # a batch: each new page gets its request's label, spread on the host's page counts
        labels = plan.per_page(owners)
        if labels is not None and labels.numel() == fpages.numel() == spages.numel():
            self._owners.claim_pages(fpages, spages, labels)
        else:  # pages not as planned (a plan without host counts, or a broken one): label each new slot's page
            self._owners.claim_slots(full[0], swa[0], plan.per_token(owners), self.page_size)

    def _swa_last_loc(self, last_loc: Tensor) -> Tensor:
        """The SWA side continues from ``M[last_loc]`` through the pool's loc cache (C4; -1 stays -1).

        Taken after validation: a gather on an unchecked ``last_loc`` could index out of
        M (a device assert on CUDA), and the reference's error order must win.
        Nothing between the invalidation and here writes M, so the result is the same.
        """
        return self._kvcache.translate_loc_from_full_to_swa(last_loc)

    def _map(self, full: Tensor, swa: Tensor) -> None:
        self.full_to_swa_index_mapping.index_copy_(0, full, swa)

    def _split_tail(self, full: Tensor, swa_tail_len: int) -> tuple[Tensor, Tensor]:
        """``(head, tail)``: the tail is the last ``swa_tail_len`` new full slots."""
        n_head = full.numel() - swa_tail_len
        return full[:n_head], full[n_head:]

    def _clear_head_mapping(self, head: Tensor) -> None:
        """#25805: the non-tail slots get M = 0, so no stale mapping survives on a recycled page (R1)."""
        self.full_to_swa_index_mapping.index_fill_(0, head, 0)

    def _check_release(self, op: str, free_index: Tensor) -> Tensor:
        """Validate ``free_index`` (live, distinct) and return the full pages it touches, in release order."""
        idx, full = as_index(free_index, self.device), self.full_attn_allocator
        distinct = full.check_live(op, "free_index", idx, duplicates_ok=False,
                                   freed_means="is already free (double free)")
        return self._touched_pages(idx, distinct)

    def _touched_pages(self, idx: Tensor, distinct: Tensor | None) -> Tensor:
        """Sorted set of pages at P > 1 (from the sorted distinct slots), the slots as given at P == 1."""
        p = self.page_size
        if p == 1:
            return idx
        sorted_slots = distinct if distinct is not None else torch.unique(idx)
        pages = torch.div(sorted_slots, p, rounding_mode="floor")
        return pages if pages.numel() < 2 else torch.unique_consecutive(pages)

    def _release_swa(self, pages: Tensor) -> None:
        """Release the SWA pages of the live slots of full ``pages``; zero M on those whole pages."""
        slots, live = self.full_attn_allocator.live_slots_of(pages)
        swa_slots = self.full_to_swa_index_mapping.index_select(0, slots)
        # stale entries on never-handed-out slots are ignored
        swa_slots = swa_slots.index_select(0, live.logical_and_(swa_slots > 0).nonzero().view(-1))
        self._zero_released_mapping(slots)
        if not swa_slots.numel():
            return
        p = self.page_size
        if p > 1:
            swa_slots = torch.div(swa_slots, p, rounding_mode="floor")
            if swa_slots.numel() > 1:
                swa_slots = torch.unique(swa_slots)
        if self._group is None:
            self.swa_attn_allocator.release_pages(swa_slots)
        else:  # held back: at P > 1 given back as a sorted set at the end, at P == 1 in order (the page-id path)
            (self._group.swa_set if p > 1 else self._group.swa_ids).append(swa_slots.clone())
        self._epoch += 1

    def _zero_released_mapping(self, slots: Tensor) -> None:
        self.full_to_swa_index_mapping.index_fill_(0, slots, 0)

    def _release_full(self, pages: Tensor) -> None:
        if self._group is None:
            self.full_attn_allocator.release_pages(pages)
        elif pages.numel():
            self._hold_full(pages, self._group.full_set)
        self._epoch += bool(pages.numel())

    def _hold_full(self, pages: Tensor, pile: list[Tensor]) -> None:
        """An open free group holds full ``pages`` back on ``pile`` (released when the group ends): no longer live
        meanwhile, so a second free of them is misuse."""
        self.full_attn_allocator.fill.index_fill_(0, pages, 0)
        pile.append(pages.clone())

    def _check_mapping_values(self) -> None:
        """M1: sentinel, reserved page unmapped, values 0 or real SWA slots."""
        m, p, top = self.full_to_swa_index_mapping, self.page_size, self.swa_attn_allocator.end_slot
        ensure(m.numel() == self.config.mapping_len and int(m[-1]) == -1, "M1", "mapping lost its -1 sentinel")
        ensure(not bool(m[:p].any()), "M1", lambda: f"reserved page 0 is mapped: {m[:p].tolist()}")
        body = m[:-1]
        ensure(bool(((body == 0) | ((body >= p) & (body < top))).all()), "M1",
               f"entries outside {{0}} or [{p}, {top})")


def _first_unreal(s: Tensor, p: int, top: int) -> int:
    """The first entry of ``s`` that is neither 0 nor an SWA slot in ``[p, top)`` (error path only)."""
    return int(s[~((s == 0) | ((s >= p) & (s < top)))][0])
