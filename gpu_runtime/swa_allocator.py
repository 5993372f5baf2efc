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
  restore would resurrect released pages as allocated.

Throughput: allocation and release are a fixed number of tensor ops per call (no
per-token or per-request Python loop); errors cost a few reductions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvproof.conformance.protocol import Capability
from kvproof.gpu_runtime._geometry import Plan, count_new_pages, decode_plan, extend_plan
from kvproof.gpu_runtime._validate import ExtendArgs, check_extend_args, check_swa_continuation, require
from kvproof.gpu_runtime.paged import PagedBackup, PagedTokenToKVPoolAllocator, as_index, resolve_device
from kvproof.gpu_runtime.swa_kv_pool import KVCpuCopy, SWAKVPool
from kvproof.reference.config import PoolConfig
from kvproof.reference.errors import InvariantViolation, OutOfMemory
from kvproof.reference.snapshot import AllocatorSnapshot, PoolSnapshot

__all__ = ["SWATokenToKVPoolAllocator", "SWAAllocatorBackup"]

Tensor = torch.Tensor


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
    capabilities: frozenset[Capability] = frozenset(Capability)

    def __init__(self, config: PoolConfig, device: torch.device | str | None = None) -> None:
        self.config, self.page_size = config, config.page_size
        self.device = resolve_device(device)
        self._size_full, self._size_swa = config.size_full, config.size_swa
        self.full_attn_allocator = self.pool_class(config.size_full, self.page_size, self.device, "full")
        self.swa_attn_allocator = self.pool_class(config.size_swa, self.page_size, self.device, "swa")
        # trailing -1: a last_loc of -1 (no prefix) translates to -1 on the SWA side
        self.full_to_swa_index_mapping = torch.zeros(config.mapping_len, dtype=torch.int64, device=self.device)
        self.full_to_swa_index_mapping[-1] = -1
        self._epoch = 0  # bumped by every release; restore_state needs it unchanged
        self._kvcache = self.kv_pool_class(config, self.device)
        self._kvcache.register_mapping(self.full_to_swa_index_mapping)
        self._kvcache.register_slot_check(self.full_attn_allocator.check_live)
        self.clear()

    # ------------------------------------------------------------ queries

    def available_size(self) -> int:
        """``min(full, swa)`` free tokens (§1.5)."""
        return min(self.full_available_size(), self.swa_available_size())

    def full_available_size(self) -> int:
        return self.full_attn_allocator.available_size()

    def swa_available_size(self) -> int:
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
        """``M[kv_indices]`` (any shape); -1 translates to -1 through the sentinel (§1.5)."""
        op, n = "translate_loc_from_full_to_swa", self.full_to_swa_index_mapping.numel() - 1
        idx = torch.as_tensor(kv_indices, dtype=torch.int64, device=self.device)
        # -1 (no prefix) or a full slot id
        require(bool(((idx >= -1) & (idx < n)).all()), op, "loc", f"entries outside [-1, {n})")
        return self._kvcache.translate_loc_from_full_to_swa(idx)

    def snapshot(self) -> AllocatorSnapshot:
        """Free lists in hand-out order and the whole mapping, in the shape every implementation reports."""
        return AllocatorSnapshot(full=self._pool_snapshot(self.full_attn_allocator),
                                 swa=self._pool_snapshot(self.swa_attn_allocator),
                                 full_to_swa_index_mapping=tuple(self.full_to_swa_index_mapping.tolist()))

    @staticmethod
    def _pool_snapshot(pool: PagedTokenToKVPoolAllocator) -> PoolSnapshot:
        return PoolSnapshot(page_size=pool.page_size, num_pages=pool.num_pages,
                            free_pages=tuple(pool.free_pages.tolist()))

    # ------------------------------------------------------------ allocation

    def alloc(self, need_size: int) -> Tensor:
        """``need_size`` tokens in whole pages, 1:1 in both pools (kvproof allows any P, page aligned)."""
        op, p, need_size = "alloc", self.page_size, int(need_size)
        require(need_size >= 0, op, "need_size", f"must be >= 0, got {need_size}")
        # the paged bulk alloc takes whole pages
        require(need_size % p == 0, op, "need_size", f"{need_size} is not a multiple of page_size {p}")
        self._check_capacity(op, need_size // p, need_size // p)
        full = self.full_attn_allocator.alloc(need_size)
        self._map(full, self.swa_attn_allocator.alloc(need_size))
        return full

    def alloc_extend(self, prefix_lens: Tensor, prefix_lens_cpu: Tensor, seq_lens: Tensor, seq_lens_cpu: Tensor,
                     last_loc: Tensor, extend_num_tokens: int) -> Tensor:
        """Extend a batch from ``prefix_lens`` to ``seq_lens`` tokens, 1:1 in both pools (§1.3, §1.5)."""
        op, extend_num_tokens = "alloc_extend", int(extend_num_tokens)
        args = self._extend_args(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc)
        check_extend_args(self.full_attn_allocator, op, args, extend_num_tokens)
        check_swa_continuation(self.full_to_swa_index_mapping, self.page_size, op, args)
        plan = extend_plan(*args[:4], extend_num_tokens, self._count_new_pages(args[1], args[3]), self.page_size)
        return self._alloc_one_to_one(op, plan, args[4])

    def alloc_decode(self, seq_lens: Tensor, seq_lens_cpu: Tensor, last_loc: Tensor) -> Tensor:
        """One token per request at position ``s - 1``; atomic (unlike upstream, §2.11 R7)."""
        op = "alloc_decode"
        seq, seq_cpu = as_index(seq_lens, self.device), as_index(seq_lens_cpu, torch.device("cpu"))
        # the decoded token is at position s - 1
        require(not bool((seq_cpu < 1).any()), op, "seq_lens", "must be >= 1")
        args = (seq - 1, seq_cpu - 1, seq, seq_cpu, as_index(last_loc, self.device))
        check_extend_args(self.full_attn_allocator, op, args, seq_cpu.numel())
        check_swa_continuation(self.full_to_swa_index_mapping, self.page_size, op, args)
        return self._alloc_one_to_one(op, decode_plan(seq, seq_cpu, self.page_size), args[4])

    def alloc_extend_swa_tail(self, prefix_lens: Tensor, prefix_lens_cpu: Tensor, seq_lens: Tensor,
                              seq_lens_cpu: Tensor, last_loc: Tensor, extend_num_tokens: int,
                              swa_tail_len: int) -> Tensor:
        """Full slots for the whole extend, SWA slots for the last ``swa_tail_len`` only (§2.7, post-#25805)."""
        op, p = "alloc_extend_swa_tail", self.page_size
        extend_num_tokens, swa_tail_len = int(extend_num_tokens), int(swa_tail_len)
        args = self._extend_args(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc)
        # upstream asserts bs == 1
        require(args[3].numel() == 1, op, "seq_lens", f"tail allocation takes one request, got {args[3].numel()}")
        check_extend_args(self.full_attn_allocator, op, args, extend_num_tokens)
        require(0 <= swa_tail_len <= extend_num_tokens, op, "swa_tail_len",
                f"{swa_tail_len} is outside [0, extend_num_tokens={extend_num_tokens}]")
        start = args[3].tolist()[0] - swa_tail_len
        # U1: the tail starts on a page boundary, so SWA offsets match position offsets
        require(start % p == 0, op, "swa_tail_len", f"tail start {start} is not a multiple of page_size {p} (U1)")
        plan = extend_plan(*args[:4], extend_num_tokens, self._count_new_pages(args[1], args[3]), p)
        swa_pages = -(-swa_tail_len // p)
        self._check_capacity(op, plan.num_new_pages, swa_pages)
        full = self.full_attn_allocator.alloc_planned(plan, args[4])
        swa = self.swa_attn_allocator.page_slots(self.swa_attn_allocator.take_pages(swa_pages))[:swa_tail_len]
        self.swa_attn_allocator.mark_live(swa)
        head, tail = self._split_tail(full, swa_tail_len)
        self._clear_head_mapping(head)
        self._map(tail, swa)
        return full

    def set_full_to_swa_mapping(self, full_indices: Tensor, swa_indices: Tensor) -> None:
        """``M[full_indices] = swa_indices`` (HiCache load-back). Trusts the caller on ownership, as upstream."""
        op, p = "set_full_to_swa_mapping", self.page_size
        f, s = as_index(full_indices, self.device), as_index(swa_indices, self.device)
        require(f.numel() == s.numel(), op, "swa_indices", f"{s.numel()} SWA slots for {f.numel()} full slots")
        # never the reserved page, never the sentinel
        require(bool(((f >= p) & (f < self.full_attn_allocator.end_slot)).all()), op, "full_indices", "not full slots")
        top = self.swa_attn_allocator.end_slot
        require(bool(((s == 0) | ((s >= p) & (s < top))).all()), op, "swa_indices", f"not 0 or in [{p}, {top})")
        self._map(f, s)

    # ------------------------------------------------------------ release

    def free(self, free_index: Tensor) -> None:
        """Release the SWA side, then the full pages touched (0.5.23 order). Not idempotent."""
        pages = self._check_release("free", free_index)
        self._release_swa(pages)
        self._release_full(pages)

    def free_swa(self, free_index: Tensor) -> None:
        """Release the SWA pages of the full pages ``free_index`` touches; zero their M (M3). Window eviction."""
        self._release_swa(self._check_release("free_swa", free_index))

    def free_full(self, free_index: Tensor) -> None:
        """Release full pages whose SWA side is already released (0.5.23 ``free_full``)."""
        op = "free_full"
        pages = self._check_release(op, free_index)
        slots, live = self.full_attn_allocator.live_slots_of(pages)
        # a live SWA peer would be stranded (0.5.23 guard swa.peer_released)
        require(not bool(((self.full_to_swa_index_mapping[slots] != 0) & live).any()), op, "free_index",
                "a live slot still maps to an SWA slot: use free or free_swa first")
        self._release_full(pages)

    def clear(self) -> None:
        """Both pools back to the initial free lists, M all 0 but the sentinel (in place: the pool holds M)."""
        self.full_attn_allocator.clear()
        self.swa_attn_allocator.clear()
        self.full_to_swa_index_mapping[:-1] = 0
        self._epoch += 1

    def backup_state(self) -> SWAAllocatorBackup:
        """Both free lists and fills (0.5.12.post1 semantics: M is NOT captured, R3)."""
        full, swa = self.full_attn_allocator, self.swa_attn_allocator
        return SWAAllocatorBackup(full.backup_state(), swa.backup_state(), self._epoch, (full.num_pages, swa.num_pages))

    def restore_state(self, state: object) -> None:
        """Give back every page allocated since ``state``; M keeps its entries (R3, §8 item 1)."""
        op, full, swa = "restore_state", self.full_attn_allocator, self.swa_attn_allocator
        require(isinstance(state, SWAAllocatorBackup), op, "state", "not a backup_state() result")
        assert isinstance(state, SWAAllocatorBackup)
        # only allocations may happen between backup_state and restore_state
        require(state.epoch == self._epoch, op, "state",
                f"pages were released since backup_state (epoch {state.epoch} -> {self._epoch})")
        require(state.num_pages == (full.num_pages, swa.num_pages), op, "state",
                "backup comes from a pool of another size")
        full.restore_state(state.full)
        swa.restore_state(state.swa)
        self._epoch += 1  # a restore releases pages too: any other backup is stale from now on

    # ------------------------------------------------------------ KV rows and CPU copies

    def get_cpu_copy(self, indices: Tensor) -> KVCpuCopy:
        return self._kvcache.get_cpu_copy(indices)

    def load_cpu_copy(self, kv_cache_cpu: KVCpuCopy, indices: Tensor) -> None:
        self._kvcache.load_cpu_copy(kv_cache_cpu, indices)

    # ------------------------------------------------------------ self-check

    def check_invariants(self) -> None:
        """Structural self-check (``GenericCache.check_valid`` style): G1-G3 per pool, M1, M2, M5."""
        self.full_attn_allocator.check_invariants()
        self.swa_attn_allocator.check_invariants()
        self._check_mapping_values()
        self._check_live_mapping()

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

    def _alloc_one_to_one(self, op: str, plan: Plan, last_loc: Tensor) -> Tensor:
        """The shared body of ``alloc_extend`` / ``alloc_decode`` after validation."""
        self._check_capacity(op, plan.num_new_pages, plan.num_new_pages)
        swa_last_loc = self._swa_last_loc(last_loc)  # read M before this call writes it
        full = self.full_attn_allocator.alloc_planned(plan, last_loc)
        self._map(full, self.swa_attn_allocator.alloc_planned(plan, swa_last_loc))
        return full

    def _swa_last_loc(self, last_loc: Tensor) -> Tensor:
        """The SWA side continues from ``M[last_loc]`` (-1 stays -1 through the sentinel)."""
        return self.full_to_swa_index_mapping[last_loc]

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
        if self.page_size == 1:
            return idx
        sorted_slots = distinct if distinct is not None else torch.unique(idx)
        pages: Tensor = torch.unique_consecutive(sorted_slots // self.page_size)
        return pages

    def _release_swa(self, pages: Tensor) -> None:
        """Release the SWA pages of the live slots of full ``pages``; zero M on those whole pages."""
        slots, live = self.full_attn_allocator.live_slots_of(pages)
        swa_slots = self.full_to_swa_index_mapping.index_select(0, slots)
        swa_slots = swa_slots[live & (swa_slots > 0)]  # stale entries on never-handed-out slots are ignored
        self._zero_released_mapping(slots)
        swa = self.swa_attn_allocator
        swa.release_pages(torch.unique(swa_slots // self.page_size) if self.page_size > 1 else swa_slots)
        self._epoch += bool(swa_slots.numel())

    def _zero_released_mapping(self, slots: Tensor) -> None:
        self.full_to_swa_index_mapping.index_fill_(0, slots, 0)

    def _release_full(self, pages: Tensor) -> None:
        self.full_attn_allocator.release_pages(pages)
        self._epoch += bool(pages.numel())

    def _check_mapping_values(self) -> None:
        """M1: sentinel, reserved page unmapped, values 0 or real SWA slots."""
        m, p, top = self.full_to_swa_index_mapping, self.page_size, self.swa_attn_allocator.end_slot
        _ensure(m.numel() == self.config.mapping_len and int(m[-1]) == -1, "M1", "mapping lost its -1 sentinel")
        _ensure(not bool(m[:p].any()), "M1", f"reserved page 0 is mapped: {m[:p].tolist()}")
        body = m[:-1]
        _ensure(bool(((body == 0) | ((body >= p) & (body < top))).all()), "M1",
                f"entries outside {{0}} or [{p}, {top})")

    def _check_live_mapping(self) -> None:
        """M2 / M5 over live full slots, and G3 for the SWA pool: no SWA page unreachable."""
        full, swa, p = self.full_attn_allocator, self.swa_attn_allocator, self.page_size
        slots = torch.arange(p, full.end_slot, device=self.device)
        f = slots[full.live_mask(slots)]
        s = self.full_to_swa_index_mapping[f]
        f, s = f[s > 0], s[s > 0]
        # M2: a live slot maps to a live SWA slot, and no two live slots share one
        _ensure(bool(swa.live_mask(s).all()), "M2", "a live full slot maps to a free or never-handed-out SWA slot")
        _ensure(torch.unique(s).numel() == s.numel(), "M2", "two live full slots map to one SWA slot")
        # M5: same offset in page, one SWA page pairs with one full page
        _ensure(bool((s % p == f % p).all()), "M5", "a full slot and its SWA slot differ in page offset")
        pairs = torch.unique(torch.stack((s // p, f // p)), dim=1)
        _ensure(torch.unique(pairs[0]).numel() == pairs.shape[1], "M5", "an SWA page is shared by two full pages")
        reached = torch.zeros_like(swa.fill, dtype=torch.bool)
        reached[s // p] = True
        _ensure(not bool(((swa.fill > 0) & ~reached).any()), "G3", "SWA pages live but mapped from no live full slot")


def _ensure(condition: bool, invariant: str, message: str) -> None:
    if not condition:
        raise InvariantViolation(invariant, message)
