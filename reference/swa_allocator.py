"""``swa_allocator``: the SWA composite allocator as pure operations over frozen values.

Models SGLang 0.5.23's ``SWATokenToKVPoolAllocator`` over two paged pools plus the
``SWAKVPool`` CPU copy (sglang_semantics.md §1.5, §2.7, §2.8, invariants §7).

Theory of operation
-------------------
* Two pools, *full* and *SWA*, each a :class:`~kvproof.reference.paged.PagedPool`
  with page 0 reserved (§1.4).
* ``full_to_swa_index_mapping`` (M) has one entry per full slot plus a trailing
  ``-1`` sentinel, so ``M[-1] == -1`` (a ``last_loc`` of -1 stays -1 on the SWA side).
  ``M[f] == 0`` means "no SWA slot"; ``M[f] > 0`` is the SWA slot holding the
  sliding-window KV of the token at full slot ``f``.
* 1:1 allocations (``alloc``, ``alloc_extend``, ``alloc_decode``) drive both pools
  with the same page geometry; ``alloc_extend_swa_tail`` gives SWA slots only to a
  page-aligned tail (§2.7).
* Every operation validates all of its arguments before it changes anything and
  raises :class:`InvalidOperation` (misuse) or :class:`OutOfMemory` (capacity);
  a failed operation has no effect (G4: all-or-nothing).

Ghost state (kvproof's, not SGLang's): page owners in both pools, the number of
*live* (handed-out) slots of each full page (``fill``; always a prefix of the page),
and an ``epoch`` that every release bumps. They make G1-G5 and M1-M5 checkable
after every step (:mod:`kvproof.reference.invariants`). KV rows are ghost-tracked
too: a release forgets the rows of the pages it gives back, so only rows the
current owner wrote are defined (:mod:`kvproof.reference.kv`).

Where kvproof deliberately differs from SGLang 0.5.23, the code says
``[Differs from SGLang 0.5.23: ...]``:

* ``alloc_decode`` is atomic; upstream consumes full pages before it finds the SWA
  pool short and leaks them (§2.11 R7, §8 item 3).
* the tail allocation clears the non-tail mappings also when ``swa_tail_len == 0``;
  upstream returns early (§2.11 R2).
* ``backup_state``/``restore_state`` are modelled as in 0.5.12.post1 (free lists
  only, never the mapping: §1.5, §2.11 R3); 0.5.23 no longer has them.
* misuse that upstream leaves unchecked (double free, reserved slot, unaligned tail
  start U1, continuing a page whose SWA side was released M5 ...) is rejected.
* ``free_swa`` releases the SWA pages of the *live* slots of every full page it
  touches and clears the mapping of those whole pages (0.5.23's page expansion);
  stale entries on never-handed-out slots are ignored.

Ring mode (``PoolConfig.swa_ring_size``, 0.5.23's per-request SWA ring: ``BaseSWAKVPool.swa_req_ring_size``, set only
by DeepSeek-V4's pool; sglang_semantics.md §1.5, docs/sglang-findings.md "The per-request SWA ring"): every request
slot of ``ReqToTokenPool`` owns a ring of ``swa_ring_cost = ceil(ring / P) * P`` SWA tokens, addressed by the slot,
so the paged SWA pool and the mapping are not used:

* ``swa_available_size`` is free request slots x ``swa_ring_cost``; ``available_size`` is the full pool's alone;
* ``alloc``, ``alloc_extend``, ``alloc_decode``, ``alloc_extend_swa_tail`` take full pages only (the capacity check is
  the full pool's) and never write the mapping; M5 (continuing an SWA page) does not apply;
* ``free_swa`` and ``free_swa_segment`` release nothing (arguments still validated), ``free`` / ``free_segment`` only
  their full side: no release ever credits SWA capacity;
* request slots: :func:`alloc_req_slots` / :func:`free_req_slots` (``ReqToTokenPool.alloc_rows`` / ``free_rows``:
  ``alloc`` / ``free`` without a ``Req``): taken from the tail of the free-slot list, given back at its end; ``clear``
  leaves them (the allocator's ``clear`` does not touch ``ReqToTokenPool``).

[Differs from SGLang 0.5.23: ``alloc`` (P == 1) has no ring branch upstream: it still takes paged SWA slots and writes
the mapping, which the ring's ``free`` never clears nor gives back (finding F8, reachable by no 0.5.23 caller).]

Free groups (``free_group_begin`` / ``free_group_end``) and the kv-row segment releases (``free_segment``,
``free_swa_segment``, ``free_full_segment``, ``free_kv_row_segments``) are modelled as in 0.5.23
(sglang_semantics.md §1.2, §1.5, extended as "§1.5a" in docs/contract.md): inside a group a release clears the
mapping and the live slots at once and holds the pages back until the group ends; segments release pages in the
order given (one per page, no sort). ``need_sort`` (sorted release lists) is not modelled: an implementation with
it does not declare ``EXACT_PAGE_ORDER``.

Cost
----
The lockstep harness calls these operations thousands of times per second on tiny
pools (and checks the invariants after each), so each one validates its arguments
first and then builds its result once:

* :func:`initial_state` validates (``SWAAllocatorState(...)``) and is memoised per
  config object; every other state, pool, KV store, backup and CPU copy is derived
  from valid values and built without re-validation (:func:`~kvproof.reference.paged.trusted`,
  :func:`_replace`), as ``model_copy`` would build it: same fields in the same order,
  same ``model_fields_set``, so ``==``, hashing, ``repr`` and ``model_dump`` agree.
* an operation builds one new state (not one ``model_copy`` per step of its work);
  the KV store is rebuilt only where a row changes.
* checks raise :class:`InvalidOperation` directly (``if ...: raise``, what ``require``
  does), so no message is formatted unless the check fails; a per-slot check tests all
  its rules in one expression and spells them out one by one only for the slot that
  breaks one, which names the same rule with the same message, in the same order.
* :func:`check_live_mapping` first tests the page-aligned shape allocations build
  (:func:`_live_mapping_holds`); only another shape goes slot by slot.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from itertools import compress, repeat
from operator import is_not, lt
from typing import Any

from pydantic import BaseModel, ConfigDict

from kvproof.reference.arith import ceil_div, decode_opens_page, extend_parts, num_new_pages, split_kv_row_segments
from kvproof.reference.config import PoolConfig
from kvproof.reference.errors import InvalidOperation, InvariantViolation, OutOfMemory, ensure
from kvproof.reference.kv import KVStore, Row, any_defined, empty_store, forget_rows, read_rows, write_rows
from kvproof.reference.paged import (
    LEAKED,
    Owner,
    PagedPool,
    initial_pool,
    release_page_ids,
    release_pages,
    take_pages,
    trusted,
    trusted_pool,
)
from kvproof.reference.snapshot import AllocatorSnapshot, PoolSnapshot

__all__ = [
    "AllocatorBackup",
    "FreeGroup",
    "KVCpuCopy",
    "SWAAllocatorState",
    "alloc",
    "alloc_decode",
    "alloc_extend",
    "alloc_extend_swa_tail",
    "alloc_req_slots",
    "available_size",
    "backup_state",
    "check_live_mapping",
    "check_live_pairs",
    "clear",
    "free",
    "free_full",
    "free_full_segment",
    "free_group_begin",
    "free_group_end",
    "free_kv_row_segments",
    "free_req_slots",
    "free_segment",
    "free_swa",
    "free_swa_segment",
    "full_available_size",
    "get_cpu_copy",
    "initial_state",
    "is_live",
    "load_cpu_copy",
    "restore_state",
    "set_full_to_swa_mapping",
    "set_kv_buffer",
    "snapshot",
    "swa_available_size",
    "translate_loc_from_full_to_swa",
]

_FROZEN = ConfigDict(frozen=True, extra="forbid")
Slots = tuple[int, ...]


class FreeGroup(BaseModel):
    """The pages an open free group holds back until ``free_group_end`` (0.5.23, §1.5a; held by nobody and in no free
    list meanwhile), per pool and in the order they are given back there: the page-id path first (kv-row segments;
    every SWA release at P == 1), in the order given, then ``free``'s path (at P > 1 the sorted set of pages; at
    P == 1 the full slots in order)."""

    model_config = _FROZEN

    swa_ids: tuple[int, ...] = ()
    swa_set: tuple[int, ...] = ()
    full_set: tuple[int, ...] = ()
    full_ids: tuple[int, ...] = ()


class SWAAllocatorState(BaseModel):
    """The whole composite: both pools, the mapping, the KV rows, and ghost state."""

    model_config = _FROZEN

    config: PoolConfig
    full: PagedPool
    swa: PagedPool
    full_to_swa_index_mapping: tuple[int, ...]
    kv: KVStore
    fill: tuple[int, ...]  # ghost: live slots per full page (offsets 0..fill-1)
    epoch: int = 0  # ghost: bumped by every release (restores, clears) and remap; restore_state needs it unchanged
    next_owner: int = 1  # ghost: label for the next anonymous owner
    group: FreeGroup | None = None  # the open free group (free_group_begin), None outside one
    req_slots: tuple[int, ...] = ()  # ring mode: ReqToTokenPool's free request slots, in its order; () without a ring


class AllocatorBackup(BaseModel):
    """What ``backup_state`` captures: both free lists (and ghost fill / epoch)."""

    model_config = _FROZEN

    full_free_pages: tuple[int, ...]
    swa_free_pages: tuple[int, ...]
    fill: tuple[int, ...]
    epoch: int


class KVCpuCopy(BaseModel):
    """Result of ``get_cpu_copy`` (§2.8): full rows of every position, SWA rows of mapped ones.

    ``full[i]`` / ``swa[i]`` follow ``full_attention_layer_ids`` / ``swa_attention_layer_ids``.
    ``swa`` is ``None`` when no position had an SWA slot.
    """

    model_config = _FROZEN

    full: tuple[tuple[Row | None, ...], ...]
    swa: tuple[tuple[Row | None, ...], ...] | None
    swa_mask: tuple[bool, ...]


def _replace(state: SWAAllocatorState, **changes: Any) -> SWAAllocatorState:
    """``state.model_copy(update=changes)``: the changed fields are marked as set, as there."""
    return trusted(SWAAllocatorState, {**state.__dict__, **changes}, state.__pydantic_fields_set__ | changes.keys())


# ---------------------------------------------------------------- construction / queries

#: ``initial_state`` per config object (``id`` -> state, whose ``config`` keeps the id taken), oldest first.
_INITIAL: dict[int, SWAAllocatorState] = {}
_INITIAL_MAX = 64


def initial_state(config: PoolConfig) -> SWAAllocatorState:
    """The allocator right after construction (``clear()``): all pages free, M all 0 but the sentinel.

    Validated on the first call for ``config``; later calls with the same (frozen) config
    return that same frozen value.
    """
    state = _INITIAL.get(id(config))
    if state is not None and state.config is config:
        return state
    state = SWAAllocatorState(
        config=config,
        full=initial_pool(config.num_pages_full, config.page_size),
        swa=initial_pool(config.num_pages_swa, config.page_size),
        full_to_swa_index_mapping=(0,) * (config.mapping_len - 1) + (-1,),
        kv=empty_store(config),
        fill=(0,) * (config.num_pages_full + 1),
        req_slots=tuple(range(1, (config.num_req_slots or 0) + 1)),  # slot 0 is ReqToTokenPool's padding row
    )
    if len(_INITIAL) >= _INITIAL_MAX:
        _INITIAL.pop(next(iter(_INITIAL)), None)
    _INITIAL[id(config)] = state
    return state


def available_size(state: SWAAllocatorState) -> int:
    """``min(full, swa)`` free tokens (§1.5); in ring mode the full pool's alone (the ring never limits growth)."""
    if state.config.ring:
        return state.full.available_size
    return min(state.full.available_size, state.swa.available_size)


def full_available_size(state: SWAAllocatorState) -> int:
    return state.full.available_size


def swa_available_size(state: SWAAllocatorState) -> int:
    """Free SWA tokens: the paged SWA pool's, or in ring mode free request slots x ``swa_ring_cost``."""
    if state.config.ring:
        return len(state.req_slots) * state.config.swa_ring_cost
    return state.swa.available_size


def is_live(state: SWAAllocatorState, slot: int) -> bool:
    """Whether full ``slot`` is handed out and not released (ghost)."""
    p = state.config.page_size
    page = slot // p
    return state.full.is_allocated(page) and slot % p < state.fill[page]


def translate_loc_from_full_to_swa(state: SWAAllocatorState, loc: Sequence[int]) -> Slots:
    """``M[loc]``; ``-1`` translates to ``-1`` through the sentinel (§1.5)."""
    op, n = "translate_loc_from_full_to_swa", len(state.full_to_swa_index_mapping) - 1
    for f in loc:
        # -1 (no prefix) or a full slot id
        if not -1 <= f < n:
            raise InvalidOperation(op, "loc", f"{f} is outside [-1, {n})")
    return tuple(map(state.full_to_swa_index_mapping.__getitem__, loc))


def snapshot(state: SWAAllocatorState) -> AllocatorSnapshot:
    """The observable state, in the shape every implementation reports."""
    return AllocatorSnapshot(
        full=PoolSnapshot(page_size=state.full.page_size, num_pages=state.full.num_pages,
                          free_pages=state.full.free_pages),
        swa=PoolSnapshot(page_size=state.swa.page_size, num_pages=state.swa.num_pages,
                         free_pages=state.swa.free_pages),
        full_to_swa_index_mapping=state.full_to_swa_index_mapping,
    )


# ---------------------------------------------------------------- allocation


def alloc(state: SWAAllocatorState, need_size: int, *, owner: Owner | None = None
          ) -> tuple[SWAAllocatorState, Slots]:
    """Bulk allocation of ``need_size`` tokens in whole pages, 1:1 in both pools (§1.5).

    SGLang's composite ``alloc`` exists at P == 1 only; kvproof allows any page size
    as long as ``need_size`` is page aligned (the paged ``alloc`` contract).
    """
    op, p = "alloc", state.config.page_size
    if need_size < 0:
        raise InvalidOperation(op, "need_size", f"must be >= 0, got {need_size}")
    # the paged bulk alloc takes whole pages
    if need_size % p:
        raise InvalidOperation(op, "need_size", f"{need_size} is not a multiple of page_size {p}")
    k = need_size // p
    ring = state.config.ring  # ring mode: full pages only, no mapping ([Differs from SGLang 0.5.23]: F8)
    _check_capacity(state, op, k, 0 if ring else k)
    who, next_owner = (owner, state.next_owner) if owner is not None else (state.next_owner, state.next_owner + 1)
    full, fpages = take_pages(state.full, [who] * k)
    swa, spages = (state.swa, ()) if ring else take_pages(state.swa, [who] * k)
    fslots = tuple(g * p + o for g in fpages for o in range(p))
    sslots = tuple(h * p + o for h in spages for o in range(p))
    return _hand_out(state, full, swa, next_owner, () if ring else fslots, sslots, fslots), fslots


def alloc_extend(state: SWAAllocatorState, prefix_lens: Sequence[int], seq_lens: Sequence[int],
                 last_loc: Sequence[int], extend_num_tokens: int, *,
                 owners: Sequence[Owner] | None = None) -> tuple[SWAAllocatorState, Slots]:
    """Extend a batch of requests from ``prefix_lens`` to ``seq_lens`` tokens, 1:1 in both pools.

    Per request: part 1 continues the page of ``last_loc``, part 2 fills whole new
    pages, part 3 starts the last new page (§1.3). The SWA side continues from
    ``M[last_loc]`` with the same geometry (M5). Takes exactly ``get_num_new_pages``
    pages from the front of each free list.
    """
    op = "alloc_extend"
    _check_extend_args(state, op, prefix_lens, seq_lens, last_loc, extend_num_tokens)
    _check_swa_continuation(state, op, prefix_lens, seq_lens, last_loc)
    owners, next_owner = _resolve_owners(state, op, prefix_lens, last_loc, owners)
    return _extend_one_to_one(state, op, prefix_lens, seq_lens, last_loc, owners, next_owner)


def alloc_decode(state: SWAAllocatorState, seq_lens: Sequence[int], last_loc: Sequence[int], *,
                 owners: Sequence[Owner] | None = None) -> tuple[SWAAllocatorState, Slots]:
    """One token per request at position ``s - 1``; opens a page iff ``(s - 1) mod P == 0`` (§1.3).

    [Differs from SGLang 0.5.23: atomic. Upstream allocates full, then SWA, and leaks
    the full pages when the SWA pool is short (§2.11 R7).]
    """
    op = "alloc_decode"
    for s in seq_lens:
        # the decoded token is at position s - 1
        if s < 1:
            raise InvalidOperation(op, "seq_lens", f"must be >= 1, got {s}")
    prefix_lens = tuple(s - 1 for s in seq_lens)
    _check_extend_args(state, op, prefix_lens, seq_lens, last_loc, len(seq_lens))
    _check_swa_continuation(state, op, prefix_lens, seq_lens, last_loc)
    owners, next_owner = _resolve_owners(state, op, prefix_lens, last_loc, owners)
    return _extend_one_to_one(state, op, prefix_lens, seq_lens, last_loc, owners, next_owner)


def leak_failed_alloc_decode(state: SWAAllocatorState, seq_lens: Sequence[int],
                             last_loc: Sequence[int]) -> SWAAllocatorState:
    """What SGLang 0.5.23's non-atomic ``alloc_decode`` leaves behind when it fails: not a kvproof operation, the
    documented upstream behaviour a run follows to look past finding F1 (``docs/sglang-findings.md``).

    Upstream calls the full pool's and the SWA pool's ``alloc_decode`` one after the other and returns ``None`` if
    either was short, giving nothing back (§2.11 R7): each pool that had room for the batch's new pages (one per
    request whose token opens a page) took them from the front of its free list. Here those pages go to the ghost
    owner :data:`~kvproof.reference.paged.LEAKED`: no live slot, no mapping, held by nobody until ``clear``.
    ``alloc_decode`` must fail on this state (:class:`InvalidOperation` otherwise: there is nothing to follow).
    """
    op = "leak_failed_alloc_decode"
    try:
        alloc_decode(state, seq_lens, last_loc)
    except OutOfMemory:
        pass
    else:
        raise InvalidOperation(op, "seq_lens", "alloc_decode succeeds on this state: no failure to follow")
    p = state.config.page_size
    k = sum(decode_opens_page(s, p) for s in seq_lens)
    full, swa = state.full, state.swa
    if k <= len(full.free_pages):
        full, _ = take_pages(full, [LEAKED] * k)
    if k <= len(swa.free_pages) and not state.config.ring:
        swa, _ = take_pages(swa, [LEAKED] * k)
    return _replace(state, full=full, swa=swa)


def alloc_extend_swa_tail(state: SWAAllocatorState, prefix_lens: Sequence[int], seq_lens: Sequence[int],
                          last_loc: Sequence[int], extend_num_tokens: int, swa_tail_len: int, *,
                          owners: Sequence[Owner] | None = None) -> tuple[SWAAllocatorState, Slots]:
    """Full slots for the whole extend, SWA slots for the last ``swa_tail_len`` tokens only (§2.7).

    Post-#25805: the new non-tail slots get ``M = 0``, so no stale mapping survives
    on a recycled page (§2.11 R1). [Differs from SGLang 0.5.23: also when
    ``swa_tail_len == 0`` (R2).]
    """
    op = "alloc_extend_swa_tail"
    # upstream asserts bs == 1
    if len(seq_lens) != 1:
        raise InvalidOperation(op, "seq_lens", f"tail allocation takes one request, got {len(seq_lens)}")
    _check_extend_args(state, op, prefix_lens, seq_lens, last_loc, extend_num_tokens)
    p, (s,) = state.config.page_size, seq_lens
    if not 0 <= swa_tail_len <= extend_num_tokens:
        raise InvalidOperation(op, "swa_tail_len",
                               f"{swa_tail_len} is outside [0, extend_num_tokens={extend_num_tokens}]")
    # U1: the tail starts on a page boundary, so SWA offsets match position offsets
    if (s - swa_tail_len) % p:
        raise InvalidOperation(op, "swa_tail_len", f"tail start seq_len - swa_tail_len = {s - swa_tail_len} is not a "
                                                   f"multiple of page_size {p} (U1)")
    (who,), next_owner = _resolve_owners(state, op, prefix_lens, last_loc, owners)
    kf, ks = num_new_pages(prefix_lens[0], s, p), ceil_div(swa_tail_len, p)
    if state.config.ring:  # full KV only, the mapping stays unwritten (0.5.23's ring branch)
        _check_capacity(state, op, kf, 0)
        full, fpages = take_pages(state.full, [who] * kf)
        fslots = tuple(_extend_slots(prefix_lens[0], s, last_loc[0], fpages, p))
        return _hand_out(state, full, state.swa, next_owner, (), (), fslots), fslots
    _check_capacity(state, op, kf, ks)
    full, fpages = take_pages(state.full, [who] * kf)
    swa, spages = take_pages(state.swa, [who] * ks)
    fslots = tuple(_extend_slots(prefix_lens[0], s, last_loc[0], fpages, p))
    sslots = tuple(_extend_slots(0, swa_tail_len, -1, spages, p))
    n_head = len(fslots) - swa_tail_len
    return _hand_out(state, full, swa, next_owner, fslots[n_head:], sslots, fslots, unmapped=fslots[:n_head]), fslots


# ---------------------------------------------------------------- release


def free(state: SWAAllocatorState, free_index: Sequence[int]) -> SWAAllocatorState:
    """Release the SWA side, then the full pages touched by ``free_index`` (0.5.23 order).

    Not idempotent: a second ``free`` of the same slots is a double free. Slots whose
    SWA side is already released are accepted (their M is 0).
    """
    _check_release_args(state, "free", free_index)
    return _release(state, free_index, swa=not state.config.ring, full=True)  # ring: the full side only


def free_swa(state: SWAAllocatorState, free_index: Sequence[int]) -> SWAAllocatorState:
    """Release the SWA pages of the full pages ``free_index`` touches and zero their M (M3).

    Used by window eviction (``_evict_swa``, §1.6). Idempotent on the SWA side: a
    second call finds M == 0 and releases nothing.
    """
    _check_release_args(state, "free_swa", free_index)
    if state.config.ring:  # the ring owns no paged SWA peer: nothing to release, nothing credited
        return state
    return _release(state, free_index, swa=True, full=False)


def free_full(state: SWAAllocatorState, free_index: Sequence[int]) -> SWAAllocatorState:
    """Release full pages whose SWA side the caller already released (0.5.23 ``free_full``)."""
    op, p, mapping, fill = "free_full", state.config.page_size, state.full_to_swa_index_mapping, state.fill
    _check_release_args(state, op, free_index)
    for g in sorted({f // p for f in free_index}):
        if not any(mapping[g * p:g * p + fill[g]]):
            continue  # no live slot of the page is mapped
        for f in range(g * p, g * p + fill[g]):
            # a live SWA peer would be stranded (0.5.23 guard swa.peer_released)
            if mapping[f] != 0:
                raise InvalidOperation(op, "free_index", f"slot {f} (page {g}) still maps to SWA slot {mapping[f]}: "
                                                         "use free or free_swa first")
    return _release(state, free_index, swa=False, full=True)


def clear(state: SWAAllocatorState) -> SWAAllocatorState:
    """Back to the initial pools and mapping (keeps the sentinel); every KV row becomes undefined."""
    fresh = initial_state(state.config)
    # the request slots are ReqToTokenPool's: the allocator's clear leaves them
    return _replace(fresh, epoch=state.epoch + 1, next_owner=state.next_owner, req_slots=state.req_slots)


def backup_state(state: SWAAllocatorState) -> AllocatorBackup:
    """Capture both free lists (0.5.12.post1 semantics; the mapping is NOT captured, R3)."""
    return trusted(AllocatorBackup, {"full_free_pages": state.full.free_pages, "swa_free_pages": state.swa.free_pages,
                                      "fill": state.fill, "epoch": state.epoch},
                    {"full_free_pages", "swa_free_pages", "fill", "epoch"})


def restore_state(state: SWAAllocatorState, backup: AllocatorBackup) -> SWAAllocatorState:
    """Give back every page allocated since ``backup``; the mapping keeps its entries (R3, §8 item 1).

    Speculative decoding uses this to drop draft allocations. Only allocations may
    happen in between: a release since the backup would be resurrected as allocated.
    """
    op = "restore_state"
    # only allocations may happen between backup_state and restore_state
    if backup.epoch != state.epoch:
        raise InvalidOperation(op, "state", f"pages were released since backup_state (epoch {backup.epoch} -> "
                                            f"{state.epoch})")
    if len(backup.fill) != len(state.fill):
        raise InvalidOperation(op, "state", "backup comes from a pool of another size")
    full = _roll_back(state.full, backup.full_free_pages)
    swa = _roll_back(state.swa, backup.swa_free_pages)
    # the pages the roll-back releases lose their rows, as on any release
    kv = forget_rows(state.kv, _page_rows(state, "full", _newly_free(state.full, full)),
                     _page_rows(state, "swa", _newly_free(state.swa, swa)))
    # a restore releases pages too: any other backup is stale from now on
    return _replace(state, full=full, swa=swa, fill=backup.fill, kv=kv, epoch=state.epoch + 1)


def set_full_to_swa_mapping(state: SWAAllocatorState, full_indices: Sequence[int],
                            swa_indices: Sequence[int]) -> SWAAllocatorState:
    """``M[full] = swa``: re-attach SWA slots to live full slots (HiCache load-back, §1.5).

    The new live mapping must stay well formed (M2, M5, no stranded SWA page); an
    empty call is a no-op (upstream returns before anything else). ``restore_state``
    cannot undo a remap (it never restores M): a backup taken before one is stale.
    """
    op = "set_full_to_swa_mapping"
    if len(full_indices) != len(swa_indices):
        raise InvalidOperation(op, "swa_indices", f"{len(swa_indices)} SWA slots for {len(full_indices)} full slots")
    if not full_indices:
        return state
    _check_live(state, op, "full_indices", full_indices, duplicates_ok=False)
    p, top = state.config.page_size, (state.config.num_pages_swa + 1) * state.config.page_size
    for s in swa_indices:
        # M1: 0 (no SWA slot) or a real SWA slot
        if not (s == 0 or p <= s < top):
            raise InvalidOperation(op, "swa_indices", f"{s} is neither 0 nor an SWA slot in [{p}, {top})")
    new = _replace(state, full_to_swa_index_mapping=_with(state.full_to_swa_index_mapping, full_indices, swa_indices),
                   epoch=state.epoch + 1)
    try:
        check_live_mapping(new)
    except InvariantViolation as err:
        raise InvalidOperation(op, "swa_indices", f"the mapping would break {err}") from None
    return new


# ---------------------------------------------------------------- request slots of the per-request SWA ring


def alloc_req_slots(state: SWAAllocatorState, need_size: int) -> tuple[SWAAllocatorState, Slots]:
    """Take ``need_size`` request slots, each with its SWA ring (0.5.23 ``ReqToTokenPool.alloc_rows``, what
    ``alloc(reqs)`` does for new requests): the last ``need_size`` of the free-slot list, in its order. Ring mode
    only; ``swa_available_size`` drops by ``need_size * swa_ring_cost``."""
    op = "alloc_req_slots"
    _require_ring(state, op)
    if need_size < 0:
        raise InvalidOperation(op, "need_size", f"must be >= 0, got {need_size}")
    free = state.req_slots
    if need_size > len(free):
        raise OutOfMemory(op, "req_slots", need_size, len(free))
    if need_size == 0:
        return state, ()
    taken = free[len(free) - need_size:]
    return _replace(state, req_slots=free[:len(free) - need_size]), taken


def free_req_slots(state: SWAAllocatorState, indices: Sequence[int]) -> SWAAllocatorState:
    """Give request slots back, appended in the order given (0.5.23 ``ReqToTokenPool.free_rows``; ``free(req)`` for
    one). Ring mode only; each slot must be held (upstream does not check: a double free would hand a ring out
    twice)."""
    op, n = "free_req_slots", state.config.num_req_slots or 0
    _require_ring(state, op)
    free, seen = set(state.req_slots), set()
    for slot in indices:
        if not 1 <= slot <= n:
            raise InvalidOperation(op, "indices", f"request slot {slot} is outside [1, {n}]")
        if slot in free or slot in seen:
            raise InvalidOperation(op, "indices", f"request slot {slot} is not held (double free)")
        seen.add(slot)
    if not indices:
        return state
    return _replace(state, req_slots=state.req_slots + tuple(indices))


def _require_ring(state: SWAAllocatorState, op: str) -> None:
    if not state.config.ring:
        raise InvalidOperation(op, "state", "the allocator has no per-request SWA ring (PoolConfig.swa_ring_size is "
                                            "None): request slots are not its to count")


# ---------------------------------------------------------------- KV rows and CPU copies


def set_kv_buffer(state: SWAAllocatorState, layer_id: int, loc: Sequence[int],
                  cache_k: Sequence[Sequence[float]], cache_v: Sequence[Sequence[float]], *,
                  swa_loc: Sequence[int] | None = None) -> SWAAllocatorState:
    """Write K/V rows of tokens at full slots ``loc``; SWA layers write at ``swa_loc``.

    ``swa_loc`` is the caller's translation of ``loc`` (#27617 passes it in); by
    default ``M[loc]``. A cached translation may be stale (``kvproof.reference.loc_cache``):
    the rows then land wherever it points. ``loc`` may hold 0 for padding tokens;
    every write to slot 0 (padding, or an SWA write of an unmapped token) lands on
    the padding slot and is lost.
    """
    op, geo = "set_kv_buffer", state.config.kv
    if not 0 <= layer_id < geo.num_layers:
        raise InvalidOperation(op, "layer_id", f"{layer_id} is outside [0, {geo.num_layers})")
    if not len(cache_k) == len(loc) == len(cache_v):
        raise InvalidOperation(op, "cache_k", f"{len(cache_k)} K rows and {len(cache_v)} V rows for {len(loc)} slots")
    width = geo.row_width
    if not {*map(len, cache_k), *map(len, cache_v)} <= {width}:  # some row has another width: name the first
        bad = next(row for row in (*cache_k, *cache_v) if len(row) != width)
        raise InvalidOperation(op, "cache_k", f"row of {len(bad)} values, expected {width}")
    # live slots, or 0 for padding tokens (CUDA-graph padding writes into the reserved slot by design, §1.4)
    _check_live(state, op, "loc", [f for f in loc if f != 0], duplicates_ok=False)
    if swa_loc is not None and len(swa_loc) != len(loc):
        raise InvalidOperation(op, "swa_loc", f"{len(swa_loc)} SWA slots for {len(loc)} slots")
    if layer_id not in geo.swa_attention_layer_ids:
        dest = tuple(loc)
    else:
        dest = tuple(swa_loc) if swa_loc is not None else tuple(map(state.full_to_swa_index_mapping.__getitem__, loc))
    rows = [(*map(float, k), *map(float, v)) for k, v in zip(cache_k, cache_v, strict=True)]
    return _replace(state, kv=write_rows(state.kv, (layer_id, dest, rows)))


def kv_rows(state: SWAAllocatorState, layer_id: int, slots: Sequence[int]) -> tuple[Row | None, ...]:
    """Rows of one layer at pool slots (SWA slots for SWA layers); ``None`` = undefined."""
    return read_rows(state.kv, layer_id, slots)


def kv_written(state: SWAAllocatorState, layer_id: int) -> bool:
    """Some row of the layer is defined (a comparison of every live row may skip a layer where none is)."""
    return any_defined(state.kv, layer_id)


def get_cpu_copy(state: SWAAllocatorState, indices: Sequence[int]) -> KVCpuCopy:
    """Copy the KV of the tokens at full slots ``indices`` (§2.8).

    ``swa_mask[j] = M[indices[j]] > 0``; SWA rows are saved for the true entries only.
    """
    op, geo = "get_cpu_copy", state.config.kv
    _check_live(state, op, "indices", indices, duplicates_ok=True)
    swa_slots = tuple(map(state.full_to_swa_index_mapping.__getitem__, indices))
    mask = tuple(s > 0 for s in swa_slots)
    full = tuple(read_rows(state.kv, layer, indices) for layer in geo.full_attention_layer_ids)
    mapped = [s for s in swa_slots if s > 0]
    swa = tuple(read_rows(state.kv, layer, mapped) for layer in geo.swa_attention_layer_ids) if mapped else None
    return trusted(KVCpuCopy, {"full": full, "swa": swa, "swa_mask": mask}, {"full", "swa", "swa_mask"})


def load_cpu_copy(state: SWAAllocatorState, kv_cpu: KVCpuCopy, indices: Sequence[int]) -> SWAAllocatorState:
    """Load a CPU copy into new full slots ``indices`` of the same positions (§2.8).

    Full rows go to every position. A saved SWA row is restored iff its position is
    mapped at load time too (``row_mask = new_mask[old_mask]``); positions mapped
    only now get no data (mask symmetry, proved in ``kvproof.spec.swa_mask``).
    """
    op, geo = "load_cpu_copy", state.config.kv
    # position alignment: the copy and the destination cover the same positions
    if len(indices) != len(kv_cpu.swa_mask):
        raise InvalidOperation(op, "indices",
                               f"{len(indices)} destination slots for a copy of {len(kv_cpu.swa_mask)} positions")
    if len(kv_cpu.full) != len(geo.full_attention_layer_ids):
        raise InvalidOperation(op, "kv_cache_cpu", "copy has a different number of full layers")
    _check_live(state, op, "indices", indices, duplicates_ok=False)
    writes: list[tuple[int, Sequence[int], Sequence[Row | None]]] = [
        (layer, indices, rows) for layer, rows in zip(geo.full_attention_layer_ids, kv_cpu.full, strict=True)]
    if kv_cpu.swa is not None:
        new = tuple(map(state.full_to_swa_index_mapping.__getitem__, indices))
        old_mapped = [j for j, m in enumerate(kv_cpu.swa_mask) if m]
        keep = [k for k, j in enumerate(old_mapped) if new[j] > 0]  # row_mask = new_mask[old_mask]
        dest = [new[old_mapped[k]] for k in keep]
        writes += [(layer, dest, [rows[k] for k in keep])
                   for layer, rows in zip(geo.swa_attention_layer_ids, kv_cpu.swa, strict=True)]
    return _replace(state, kv=write_rows(state.kv, *writes))


# ---------------------------------------------------------------- internals


def _check_capacity(state: SWAAllocatorState, op: str, full_pages: int, swa_pages: int) -> None:
    if full_pages > len(state.full.free_pages):
        raise OutOfMemory(op, "full", full_pages, len(state.full.free_pages))
    if swa_pages > len(state.swa.free_pages):
        raise OutOfMemory(op, "swa", swa_pages, len(state.swa.free_pages))


def _check_live(state: SWAAllocatorState, op: str, arg: str, slots: Iterable[int], *, duplicates_ok: bool,
                freed_means: str = "is not allocated") -> None:
    """Each slot is a handed-out full slot: in range, not in page 0, page allocated, offset live."""
    cfg, fill, full = state.config, state.fill, state.full
    p = cfg.page_size
    live_end, owner, seen = (min(cfg.size_full // p, full.num_pages) + 1) * p, full.owner, set()  # _live_end
    for f in slots:
        # all rules at once; a slot that breaks one is checked rule by rule, for the message
        if (p <= f < live_end and owner[f // p] is not None and f % p < fill[f // p]
                and (duplicates_ok or f not in seen)):
            seen.add(f)
            continue
        end = (cfg.num_pages_full + 1) * p
        if not 0 <= f < end:
            raise InvalidOperation(op, arg, f"slot {f} is outside the full pool [0, {end})")
        if f < p:
            raise InvalidOperation(op, arg, f"slot {f} lies in the reserved page 0")
        if not full.is_allocated(f // p):
            raise InvalidOperation(op, arg, f"slot {f} is in page {f // p}, which {freed_means}")
        if not f % p < fill[f // p]:
            raise InvalidOperation(op, arg, f"slot {f} was never handed out (page {f // p} has {fill[f // p]} live "
                                            "slots)")
        if not duplicates_ok and f in seen:
            raise InvalidOperation(op, arg, f"slot {f} appears twice")
        seen.add(f)


def _live_end(state: SWAAllocatorState) -> int:
    """Slots below this lie in the full pool and in a page ``is_allocated`` may accept (1..num_pages)."""
    p = state.config.page_size
    return (min(state.config.size_full // p, state.full.num_pages) + 1) * p  # size_full // p: num_pages_full


def _check_release_args(state: SWAAllocatorState, op: str, free_index: Sequence[int]) -> None:
    _check_live(state, op, "free_index", free_index, duplicates_ok=False,
                freed_means="is already free (double free)")


def _check_extend_args(state: SWAAllocatorState, op: str, prefix_lens: Sequence[int], seq_lens: Sequence[int],
                       last_loc: Sequence[int], extend_num_tokens: int) -> None:
    """Preconditions shared by the paged extends (§1.3), stated for the full side."""
    p, fill, owner = state.config.page_size, state.fill, state.full.owner
    if not len(prefix_lens) == len(seq_lens) == len(last_loc):
        raise InvalidOperation(op, "seq_lens", f"prefix_lens, seq_lens, last_loc have lengths {len(prefix_lens)}, "
                                               f"{len(seq_lens)}, {len(last_loc)}")
    for pre, seq in zip(prefix_lens, seq_lens, strict=True):
        if not 0 <= pre <= seq:
            raise InvalidOperation(op, "seq_lens", f"need 0 <= prefix_len <= seq_len, got {pre} and {seq}")
    # U2: the caller's token count matches the batch
    total = sum(seq_lens) - sum(prefix_lens)
    if extend_num_tokens != total:
        raise InvalidOperation(op, "extend_num_tokens", f"{extend_num_tokens} != sum(seq - prefix) = {total}")
    pages = []
    for pre, seq, loc in zip(prefix_lens, seq_lens, last_loc, strict=True):
        # last_loc is -1 exactly for requests without a prefix
        if (loc == -1) != (pre == 0):
            raise InvalidOperation(op, "last_loc", f"{loc} for prefix_len {pre}")
        if pre == 0:
            continue
        if not (p <= loc < _live_end(state) and owner[loc // p] is not None and loc % p < fill[loc // p]):
            _check_live(state, op, "last_loc", (loc,), duplicates_ok=True)  # names the broken rule
        # the new token continues right after last_loc (SGLang's debug-mode check)
        if (loc + 1) % p != pre % p:
            raise InvalidOperation(op, "last_loc",
                                   f"(last_loc + 1) mod P = {(loc + 1) % p} != prefix_len mod P = {pre % p}")
        if fill[loc // p] != loc % p + 1:
            raise InvalidOperation(op, "last_loc", f"slot {loc} is not the last live slot of page {loc // p}")
        if pre % p and seq > pre:
            pages.append(loc // p)
    # two requests cannot continue the same partial page
    if len(pages) != len(set(pages)):
        raise InvalidOperation(op, "last_loc", f"two requests continue the same page: {sorted(pages)}")


def _check_swa_continuation(state: SWAAllocatorState, op: str, prefix_lens: Sequence[int],
                            seq_lens: Sequence[int], last_loc: Sequence[int]) -> None:
    p, mapping = state.config.page_size, state.full_to_swa_index_mapping
    if state.config.ring:  # no SWA page to continue: the ring is the request slot's
        return
    for pre, seq, loc in zip(prefix_lens, seq_lens, last_loc, strict=True):
        # M5: a 1:1 extend that continues a page continues its SWA page too
        if pre % p and seq > pre and not mapping[loc] > 0:
            raise InvalidOperation(op, "last_loc",
                                   f"continues page {loc // p} but its SWA side is released (M[{loc}] == 0)")


def _resolve_owners(state: SWAAllocatorState, op: str, prefix_lens: Sequence[int], last_loc: Sequence[int],
                    owners: Sequence[Owner] | None) -> tuple[tuple[Owner, ...], int]:
    """Ghost owners per request: given, or the owner of ``last_loc``'s page, or fresh labels."""
    p, nxt, out, page_owner = state.config.page_size, state.next_owner, [], state.full.owner
    for i, (pre, loc) in enumerate(zip(prefix_lens, last_loc, strict=True)):
        current = page_owner[loc // p] if pre > 0 else None
        if owners is None:
            who = current if current is not None else nxt
            nxt += current is None
        else:
            if len(owners) != len(prefix_lens):
                raise InvalidOperation(op, "owners", f"{len(owners)} owners for {len(prefix_lens)} requests")
            who = owners[i]
            if not (current is None or current == who):
                raise InvalidOperation(op, "owners", f"page {loc // p} belongs to {current}, not {who}")
        out.append(who)
    return tuple(out), nxt


def _extend_slots(prefix_len: int, seq_len: int, last_loc: int, new_pages: Sequence[int], p: int) -> list[int]:
    """Slots of one request's extend: part 1 after ``last_loc``, then the new pages in order (§1.3)."""
    n1, n2, n3 = extend_parts(prefix_len, seq_len, p)
    whole = n2 // p
    # G4: the capacity check took exactly the pages the geometry needs
    if len(new_pages) != whole + (n3 > 0):
        raise InvariantViolation("G4", f"extend {prefix_len}->{seq_len} got {len(new_pages)} pages")
    if p == 1:
        return list(new_pages)  # no part 1 or 3: a page is a slot
    slots = list(range(last_loc + 1, last_loc + 1 + n1))
    for page in new_pages[:whole]:
        slots += range(page * p, page * p + p)
    if n3:
        page = new_pages[whole]
        slots += range(page * p, page * p + n3)
    return slots


def _extend_one_to_one(state: SWAAllocatorState, op: str, prefix_lens: Sequence[int], seq_lens: Sequence[int],
                       last_loc: Sequence[int], owners: Sequence[Owner], next_owner: int
                       ) -> tuple[SWAAllocatorState, Slots]:
    """The shared body of ``alloc_extend`` / ``alloc_decode`` after validation."""
    p, mapping = state.config.page_size, state.full_to_swa_index_mapping
    counts = [num_new_pages(pre, seq, p) for pre, seq in zip(prefix_lens, seq_lens, strict=True)]
    page_owners = [who for who, c in zip(owners, counts, strict=True) for _ in range(c)]
    if state.config.ring:  # full pages only, the mapping stays unwritten (0.5.23's ring branch)
        _check_capacity(state, op, sum(counts), 0)
        full, fpages = take_pages(state.full, page_owners)
        ring_slots: list[int] = []
        start = 0
        for pre, seq, loc, c in zip(prefix_lens, seq_lens, last_loc, counts, strict=True):
            ring_slots += _extend_slots(pre, seq, loc, fpages[start:start + c], p)
            start += c
        return _hand_out(state, full, state.swa, next_owner, (), (), tuple(ring_slots)), tuple(ring_slots)
    _check_capacity(state, op, sum(counts), sum(counts))
    full, fpages = take_pages(state.full, page_owners)
    swa, spages = take_pages(state.swa, page_owners)
    fslots: list[int] = []
    sslots: list[int] = []
    start = 0
    for pre, seq, loc, c in zip(prefix_lens, seq_lens, last_loc, counts, strict=True):
        fslots += _extend_slots(pre, seq, loc, fpages[start:start + c], p)
        sslots += _extend_slots(pre, seq, mapping[loc] if pre % p else -1, spages[start:start + c], p)
        start += c
    handed_out = tuple(fslots)
    return _hand_out(state, full, swa, next_owner, handed_out, tuple(sslots), handed_out), handed_out


def _with(values: tuple[int, ...], at: Iterable[int], new: Iterable[int]) -> tuple[int, ...]:
    """``values`` with ``values[at[i]] = new[i]``."""
    out = list(values)
    for i, v in zip(at, new, strict=True):
        out[i] = v
    return tuple(out)


def _hand_out(state: SWAAllocatorState, full: PagedPool, swa: PagedPool, next_owner: int, mapped_full: Slots,
              swa_slots: Slots, all_full: Slots, *, unmapped: Slots = ()) -> SWAAllocatorState:
    """The state after an allocation took pages into ``full`` / ``swa``.

    Maps ``mapped_full`` 1:1 onto ``swa_slots`` and ``unmapped`` to 0, marks ``all_full`` live,
    and undefines their KV rows.
    """
    p, geo = state.config.page_size, state.config.kv
    mapping = list(state.full_to_swa_index_mapping)
    for f in unmapped:
        mapping[f] = 0
    for f, s in zip(mapped_full, swa_slots, strict=True):
        mapping[f] = s
    fill = list(state.fill)
    for f in all_full:
        g, live = f // p, f % p + 1
        if live > fill[g]:
            fill[g] = live
    kv = forget_rows(state.kv, (geo.full_attention_layer_ids, all_full), (geo.swa_attention_layer_ids, swa_slots))
    return _replace(state, full=full, swa=swa, next_owner=next_owner, full_to_swa_index_mapping=tuple(mapping),
                    fill=tuple(fill), kv=kv)


def _release(state: SWAAllocatorState, free_index: Sequence[int], *, swa: bool, full: bool) -> SWAAllocatorState:
    """The SWA side (``free_swa``), then the full pages (``free_full``) of validated ``free_index``.

    SWA side: release the SWA pages of the live slots of the touched full pages and zero M on
    those pages. Full side: release the touched full pages; they have no live slot left.
    """
    p, epoch = state.config.page_size, state.epoch
    changes: dict[str, Any] = {}
    forget: list[tuple[tuple[int, ...], list[int]]] = []
    if swa:
        mapping, fill, full_owner = state.full_to_swa_index_mapping, state.fill, state.full.owner
        n_swa, swa_owner = state.swa.num_pages, state.swa.owner
        touched = sorted({f // p for f in free_index}) if p > 1 else list(free_index)
        swa_pages: list[int] = []
        for g in touched:
            base = g * p
            for f in range(base, base + fill[g]):
                s = mapping[f]
                if s <= 0:
                    continue
                # M2: the SWA page released with a live full slot is held by the same owner
                h = s // p
                if not (1 <= h <= n_swa and swa_owner[h] is not None and swa_owner[h] == full_owner[g]):
                    raise InvariantViolation("M2", f"free_swa: SWA slot {s} of full slot {f} is not held by its owner")
                swa_pages.append(h)
        epoch += bool(swa_pages)
        changes["full_to_swa_index_mapping"] = _cleared(mapping, touched, p)
        if state.group is None:
            forget.append(_page_rows(state, "swa", swa_pages))
            changes["swa"] = release_pages(state.swa, swa_pages)
        elif p > 1:  # held back: free_swa's pile, given back as a sorted set at the end (§1.5a)
            changes["group"], changes["swa"] = _hold(state.group, swa_set=swa_pages), _disown(state.swa, swa_pages)
        else:  # at P == 1 free_swa takes the page-id path
            changes["group"], changes["swa"] = _hold(state.group, swa_ids=swa_pages), _disown(state.swa, swa_pages)
    if full:
        pages = [f // p for f in free_index]
        epoch += bool(pages)
        changes["fill"] = _cleared(state.fill, pages)
        if state.group is None:
            forget.append(_page_rows(state, "full", pages))
            changes["full"] = release_pages(state.full, pages)
        else:  # the full allocator's own group: free(cat(pending)) at the end
            changes["group"] = _hold(changes.get("group", state.group), full_set=pages)
            changes["full"] = _disown(state.full, pages)
    return _replace(state, **changes, kv=forget_rows(state.kv, *forget) if forget else state.kv, epoch=epoch)


def _cleared(values: tuple[int, ...], pages: Iterable[int], width: int = 1) -> tuple[int, ...]:
    """``values`` with the ``width`` entries of each page zeroed: the mapping of released full pages (``width`` P),
    their fills (``width`` 1)."""
    out = list(values)
    for g in pages:
        out[g * width:(g + 1) * width] = [0] * width
    return tuple(out)


def _disown(pool: PagedPool, pages: Iterable[int]) -> PagedPool:
    """``pool`` with ``pages`` held by nobody and still out of the free list (held back by a free group)."""
    owner = list(pool.owner)
    for page in pages:
        owner[page] = None
    return trusted_pool(pool.page_size, pool.num_pages, pool.free_pages, tuple(owner))


def _hold(group: FreeGroup, **more: Sequence[int]) -> FreeGroup:
    """``group`` with ``more`` pages held back in the named piles."""
    now = {**group.__dict__}
    for pile, pages in more.items():
        now[pile] = now[pile] + tuple(pages)
    return trusted(FreeGroup, now, group.__pydantic_fields_set__ | more.keys())


# ---------------------------------------------------------------- free groups and kv-row segments (§1.5a)


def free_group_begin(state: SWAAllocatorState) -> SWAAllocatorState:
    """Open a free group: releases until :func:`free_group_end` clear the mapping and the live slots at once and
    hold their pages back (0.5.23 ``free_group_begin``; groups do not nest)."""
    if state.group is not None:
        raise InvalidOperation("free_group_begin", "state", "a free group is already open (free groups cannot be "
                                                            "nested)")
    return _replace(state, group=FreeGroup())


def free_group_end(state: SWAAllocatorState) -> SWAAllocatorState:
    """Close the free group and give its pages back, in 0.5.23's order: SWA page ids (in order), then ``free``'s SWA
    pages (sorted set), then the full pages of ``free`` (sorted set; P == 1: in order), then full page ids (in
    order). At P > 1 each pile is prepended, so the last given back is handed out first."""
    group = state.group
    if group is None:
        raise InvalidOperation("free_group_end", "state", "no free group is open (call free_group_begin first)")
    swa = release_pages(release_page_ids(state.swa, group.swa_ids), group.swa_set)
    full = release_page_ids(release_pages(state.full, group.full_set), group.full_ids)
    kv = forget_rows(state.kv, _page_rows(state, "swa", group.swa_ids + group.swa_set),
                     _page_rows(state, "full", group.full_set + group.full_ids))  # P == 1: slots are pages
    released = bool(group.swa_ids or group.swa_set or group.full_set or group.full_ids)
    return _replace(state, swa=swa, full=full, kv=kv, group=None, epoch=state.epoch + released)


def free_segment(state: SWAAllocatorState, free_index: Sequence[int], start_pos: int) -> SWAAllocatorState:
    """Release ``kv_row[start_pos : start_pos + n]`` of one request, both sides (0.5.23 ``free_segment``): the SWA
    pages of the segment's pages (every one must still have its SWA peer), then its full pages, each pool's pages in
    the segment's order (one representative slot per page, no sort)."""
    return _segment(state, "free_segment", free_index, start_pos, swa=not state.config.ring, full=True)


def free_swa_segment(state: SWAAllocatorState, free_index: Sequence[int], start_pos: int) -> SWAAllocatorState:
    """The SWA side of :func:`free_segment` alone (window eviction of a kv-row segment); the full slots stay."""
    return _segment(state, "free_swa_segment", free_index, start_pos, swa=not state.config.ring, full=False)


def free_full_segment(state: SWAAllocatorState, free_index: Sequence[int], start_pos: int) -> SWAAllocatorState:
    """The full side of :func:`free_segment` for positions whose SWA peers are already released."""
    return _segment(state, "free_full_segment", free_index, start_pos, swa=False, full=True)


def free_kv_row_segments(state: SWAAllocatorState, segments: Sequence[tuple[Sequence[int], int]],
                         swa_evicted_seqlen: int, swa_dead_lo: int = 0) -> SWAAllocatorState:
    """0.5.23 ``mem_cache.common.free_kv_row_segments``: ascending, page-disjoint ``(slots, start_pos)`` segments of
    one request's kv row; the positions in ``[swa_dead_lo, swa_evicted_seqlen)`` (SWA already released by window
    eviction) go back full side only (:func:`free_full_segment`), the rest both sides (:func:`free_segment`). A
    cursor that splits a page between the two is misuse. All or nothing."""
    dead, alive = split_kv_row_segments(segments, swa_evicted_seqlen, swa_dead_lo, state.config.page_size)
    for slots, start in dead:
        state = free_full_segment(state, slots, start) if slots else state
    for slots, start in alive:
        state = free_segment(state, slots, start) if slots else state
    return state


def _segment(state: SWAAllocatorState, op: str, free_index: Sequence[int], start_pos: int, *, swa: bool,
             full: bool) -> SWAAllocatorState:
    p, mapping = state.config.page_size, state.full_to_swa_index_mapping
    if not free_index:
        return state
    _check_release_args(state, op, free_index)
    if start_pos < 0 or start_pos % p:
        raise InvalidOperation(op, "start_pos", f"segment start {start_pos} is not page-aligned (page_size {p})")
    for k, f in enumerate(free_index):  # kv_row[start_pos + k]: in-page offset k % P, one page per P positions
        if f % p != k % p or f // p != free_index[k - k % p] // p:
            raise InvalidOperation(op, "free_index", f"not a kv-row segment from a page boundary: position "
                                                     f"{start_pos + k} is at slot {f}")
    reps = list(free_index[::p])
    if not (swa or full):  # ring mode's free_swa_segment: validated, releases nothing
        return state
    if swa:
        for r in reps:
            if mapping[r] <= 0:
                raise InvalidOperation(op, "free_index", f"slot {r} has no SWA peer (released by window eviction): "
                                                         "free those positions with free_full_segment")
    elif any(mapping[f] != 0 for f in free_index):
        f = next(f for f in free_index if mapping[f] != 0)
        raise InvalidOperation(op, "free_index", f"slot {f} still maps to SWA slot {mapping[f]}: use free_segment")
    changes: dict[str, Any] = {}
    group, forget = state.group, []
    if swa:
        swa_pages = [mapping[r] // p for r in reps]
        changes["full_to_swa_index_mapping"] = _cleared(mapping, [r // p for r in reps], p)
        if group is None:
            changes["swa"] = release_page_ids(state.swa, swa_pages)
            forget.append(_page_rows(state, "swa", swa_pages))
        else:
            group = _hold(group, swa_ids=swa_pages)
            changes["swa"] = _disown(state.swa, swa_pages)
    if full:
        pages = [r // p for r in reps]
        changes["fill"] = _cleared(state.fill, pages)
        if group is None:
            changes["full"] = release_page_ids(state.full, pages)
            forget.append(_page_rows(state, "full", pages))
        else:  # P > 1: free_page_ids' pile; P == 1: the slots join free's pile (the token allocator frees them)
            group = _hold(group, **{"full_ids" if p > 1 else "full_set": pages})
            changes["full"] = _disown(state.full, pages)
    if group is not state.group:
        changes["group"] = group
    return _replace(state, **changes, kv=forget_rows(state.kv, *forget) if forget else state.kv,
                    epoch=state.epoch + 1)


def _page_rows(state: SWAAllocatorState, pool: str, pages: Iterable[int]) -> tuple[tuple[int, ...], list[int]]:
    """``(layers, slots)`` of every slot of ``pages`` in ``pool``, for :func:`forget_rows`.

    Released pages lose their rows (every slot): a later owner of the page never reads what an earlier one
    wrote, whichever page an implementation reuses (rows are compared only where the current owner wrote).
    """
    p, geo = state.config.page_size, state.config.kv
    layers = geo.full_attention_layer_ids if pool == "full" else geo.swa_attention_layer_ids
    return layers, [s for g in set(pages) for s in range(g * p, g * p + p)]


def _roll_back(pool: PagedPool, free_pages: tuple[int, ...]) -> PagedPool:
    """``pool`` with the free list ``free_pages``, those pages unowned (its ``owner`` object when none was owned)."""
    owner = list(pool.owner)
    for page in free_pages:
        owner[page] = None
    after = tuple(owner)
    if after == pool.owner:  # nothing was allocated since the backup
        if free_pages == pool.free_pages:
            return pool
        after = pool.owner
    return trusted_pool(pool.page_size, pool.num_pages, free_pages, after)


def _newly_free(before: PagedPool, after: PagedPool) -> list[int]:
    """Pages allocated in ``before`` and free in ``after`` (``before`` rolled back)."""
    n, owner = before.num_pages, before.owner
    if not len(owner) == len(after.owner) == n + 1:
        return [g for g in range(1, n + 1) if owner[g] is not None and after.owner[g] is None]
    if after.owner is owner:
        return []  # no owner changed
    # the owners the roll-back changed: the allocated pages it set to None
    return [g for g in compress(range(n + 1), map(is_not, owner, after.owner)) if g]


def check_live_mapping(state: SWAAllocatorState) -> None:
    """M2 (as maintained) and M5 over live slots, plus: every owned SWA page is reachable (G3).

    Raises :class:`InvariantViolation` (:func:`check_live_pairs`); :mod:`kvproof.reference.invariants`
    runs it with the pool checks, and ``set_full_to_swa_mapping`` uses it as its precondition.
    """
    if _live_mapping_holds(state):
        return
    swa = state.swa
    # a leaked SWA page is held by nobody: no live slot may map into it, and it need not be reached
    swa_owner = {h: who for h in range(1, swa.num_pages + 1) if (who := swa.owner[h]) is not None and who != LEAKED}
    check_live_pairs(state.config.page_size, _live_pairs(state), state.full.owner, swa_owner)


def _live_pairs(state: SWAAllocatorState) -> list[tuple[int, int]]:
    """``(f, M[f])`` for every live full slot ``f`` with ``M[f] > 0``, ascending (:func:`is_live`, inlined)."""
    p, n, owner, fill, mapping = (state.config.page_size, state.full.num_pages, state.full.owner, state.fill,
                                  state.full_to_swa_index_mapping)
    mapped = compress(range(len(mapping) - 1), map(lt, repeat(0), mapping))  # M[f] > 0, the sentinel left out
    return [(f, mapping[f]) for f in mapped if 1 <= f // p <= n and owner[f // p] is not None and f % p < fill[f // p]]


def _live_mapping_holds(state: SWAAllocatorState) -> bool:
    """Whether :func:`check_live_mapping` passes, decided page by page for the shape allocations build.

    That shape: each allocated full page has 1..P live slots, all unmapped or mapped in order
    onto one SWA page of the same owner, from its offset 0, no SWA page reached twice, every
    owned SWA page reached. ``True`` only if the rules hold; ``False`` also for a valid mapping
    of another shape (a remap can build one): :func:`check_live_pairs` then decides.
    """
    p, fill, mapping = state.config.page_size, state.fill, state.full_to_swa_index_mapping
    n, owner, n_swa, swa_owner = state.full.num_pages, state.full.owner, state.swa.num_pages, state.swa.owner
    if not (len(owner) == len(fill) == n + 1 and len(swa_owner) == n_swa + 1 and len(mapping) > (n + 1) * p):
        return False
    reached: set[int] = set()
    # the allocated pages (is_allocated: 1..n with an owner)
    for g in compress(range(n + 1), map(is_not, owner, repeat(None))):
        live = fill[g]
        if owner[g] == LEAKED:  # a leaked page (leak_failed_alloc_decode): nothing live, nothing mapped
            if not g or live or any(mapping[g * p:g * p + p]):
                return False
            continue
        if not (g and 0 < live <= p):
            return False
        base = g * p
        s = mapping[base]
        if s <= 0:
            if live > 1 and any(mapping[base + 1:base + live]):
                return False
            continue
        h = s // p
        # M5: offset 0 and the same offsets, one full page per SWA page; M2: held by the owner, once
        if (s % p or h > n_swa or h in reached or swa_owner[h] != owner[g]
                or (live > 1 and mapping[base:base + live] != tuple(range(s, s + live)))):
            return False
        reached.add(h)
    # G3: every owned SWA page is reached (a leaked one is held by nobody)
    return len(reached) == n_swa - swa_owner[1:].count(None) - swa_owner[1:].count(LEAKED)


def check_live_pairs(page_size: int, live: Iterable[tuple[int, int]], full_owner: Sequence[Owner | None],
                     swa_owner: Mapping[int, Owner]) -> None:
    """The rules of :func:`check_live_mapping` over plain values, shared with the torch runtime.

    ``live``: ``(f, M[f])`` for every live full slot ``f`` with ``M[f] > 0``, ascending;
    ``full_owner[g]``: the owner of full page ``g``; ``swa_owner``: the owner of every
    allocated SWA page (labels are only compared for equality). Raises
    :class:`InvariantViolation` for the first slot that breaks a rule, in slot order, then G3.
    """
    p = page_size
    seen: dict[int, int] = {}
    page_of_swa_page: dict[int, int] = {}
    for f, s in live:
        g, h = f // p, s // p
        # M2: a live slot maps to an SWA slot held by the same owner, and no two live slots share one;
        # M5: same offset in page, and one SWA page pairs with one full page
        if (h in swa_owner and swa_owner[h] == full_owner[g] and s not in seen and s % p == f % p
                and page_of_swa_page.setdefault(h, g) == g):
            seen[s] = f
            continue
        # a rule is broken (the messages are built only here: this loop runs after every lockstep step)
        ensure(h in swa_owner, "M2", f"live full slot {f} maps to SWA slot {s} in free page {h}")
        ensure(swa_owner[h] == full_owner[g], "M2",
               f"full slot {f} (page {g}) maps to SWA slot {s} in page {h} of another owner")
        ensure(s not in seen, "M2", f"full slots {seen.get(s)} and {f} both map to SWA slot {s}")
        ensure(s % p == f % p, "M5", f"full slot {f} (offset {f % p}) maps to SWA slot {s} (offset {s % p})")
        ensure(False, "M5", f"SWA page {h} is shared by full pages {page_of_swa_page[h]} and {g}")
    orphans = [h for h in swa_owner if h not in page_of_swa_page]
    # G3 (SWA side): an owned SWA page is reachable from a live full slot, else it leaked
    ensure(not orphans, "G3", lambda: f"SWA pages owned but mapped from no live full slot: {sorted(orphans)}")
