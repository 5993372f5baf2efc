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

``need_sort`` (sorted release lists) and free groups are not modelled.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from pydantic import BaseModel, ConfigDict

from kvproof.reference.arith import ceil_div, extend_parts, num_new_pages
from kvproof.reference.config import PoolConfig
from kvproof.reference.errors import InvalidOperation, InvariantViolation, OutOfMemory, ensure, require
from kvproof.reference.kv import KVStore, Row, empty_store, forget_rows, read_rows, write_rows
from kvproof.reference.paged import Owner, PagedPool, initial_pool, release_pages, take_pages
from kvproof.reference.snapshot import AllocatorSnapshot, PoolSnapshot

__all__ = [
    "AllocatorBackup",
    "KVCpuCopy",
    "SWAAllocatorState",
    "alloc",
    "alloc_decode",
    "alloc_extend",
    "alloc_extend_swa_tail",
    "available_size",
    "backup_state",
    "check_live_mapping",
    "check_live_pairs",
    "clear",
    "free",
    "free_full",
    "free_swa",
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


# ---------------------------------------------------------------- construction / queries


def initial_state(config: PoolConfig) -> SWAAllocatorState:
    """The allocator right after construction (``clear()``): all pages free, M all 0 but the sentinel."""
    return SWAAllocatorState(
        config=config,
        full=initial_pool(config.num_pages_full, config.page_size),
        swa=initial_pool(config.num_pages_swa, config.page_size),
        full_to_swa_index_mapping=(0,) * (config.mapping_len - 1) + (-1,),
        kv=empty_store(config),
        fill=(0,) * (config.num_pages_full + 1),
    )


def available_size(state: SWAAllocatorState) -> int:
    """``min(full, swa)`` free tokens (§1.5)."""
    return min(state.full.available_size, state.swa.available_size)


def full_available_size(state: SWAAllocatorState) -> int:
    return state.full.available_size


def swa_available_size(state: SWAAllocatorState) -> int:
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
        require(-1 <= f < n, op, "loc", f"{f} is outside [-1, {n})")
    return tuple(state.full_to_swa_index_mapping[f] for f in loc)


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
    require(need_size >= 0, op, "need_size", f"must be >= 0, got {need_size}")
    # the paged bulk alloc takes whole pages
    require(need_size % p == 0, op, "need_size", f"{need_size} is not a multiple of page_size {p}")
    k = need_size // p
    _check_capacity(state, op, k, k)
    who, next_owner = (owner, state.next_owner) if owner is not None else (state.next_owner, state.next_owner + 1)
    full, fpages = take_pages(state.full, [who] * k)
    swa, spages = take_pages(state.swa, [who] * k)
    fslots = tuple(g * p + o for g in fpages for o in range(p))
    sslots = tuple(h * p + o for h in spages for o in range(p))
    state = state.model_copy(update={"full": full, "swa": swa, "next_owner": next_owner})
    return _hand_out(state, fslots, sslots, fslots), fslots


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
    return _extend_one_to_one(state.model_copy(update={"next_owner": next_owner}), op,
                              prefix_lens, seq_lens, last_loc, owners)


def alloc_decode(state: SWAAllocatorState, seq_lens: Sequence[int], last_loc: Sequence[int], *,
                 owners: Sequence[Owner] | None = None) -> tuple[SWAAllocatorState, Slots]:
    """One token per request at position ``s - 1``; opens a page iff ``(s - 1) mod P == 0`` (§1.3).

    [Differs from SGLang 0.5.23: atomic. Upstream allocates full, then SWA, and leaks
    the full pages when the SWA pool is short (§2.11 R7).]
    """
    op = "alloc_decode"
    for s in seq_lens:
        # the decoded token is at position s - 1
        require(s >= 1, op, "seq_lens", f"must be >= 1, got {s}")
    prefix_lens = tuple(s - 1 for s in seq_lens)
    _check_extend_args(state, op, prefix_lens, seq_lens, last_loc, len(seq_lens))
    _check_swa_continuation(state, op, prefix_lens, seq_lens, last_loc)
    owners, next_owner = _resolve_owners(state, op, prefix_lens, last_loc, owners)
    return _extend_one_to_one(state.model_copy(update={"next_owner": next_owner}), op,
                              prefix_lens, seq_lens, last_loc, owners)


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
    require(len(seq_lens) == 1, op, "seq_lens", f"tail allocation takes one request, got {len(seq_lens)}")
    _check_extend_args(state, op, prefix_lens, seq_lens, last_loc, extend_num_tokens)
    p, (s,) = state.config.page_size, seq_lens
    require(0 <= swa_tail_len <= extend_num_tokens, op, "swa_tail_len",
            f"{swa_tail_len} is outside [0, extend_num_tokens={extend_num_tokens}]")
    # U1: the tail starts on a page boundary, so SWA offsets match position offsets
    require((s - swa_tail_len) % p == 0, op, "swa_tail_len",
            f"tail start seq_len - swa_tail_len = {s - swa_tail_len} is not a multiple of page_size {p} (U1)")
    (who,), next_owner = _resolve_owners(state, op, prefix_lens, last_loc, owners)
    kf, ks = num_new_pages(prefix_lens[0], s, p), ceil_div(swa_tail_len, p)
    _check_capacity(state, op, kf, ks)
    full, fpages = take_pages(state.full, [who] * kf)
    swa, spages = take_pages(state.swa, [who] * ks)
    fslots = tuple(_extend_slots(prefix_lens[0], s, last_loc[0], fpages, p))
    sslots = tuple(_extend_slots(0, swa_tail_len, -1, spages, p))
    n_head = len(fslots) - swa_tail_len
    state = state.model_copy(update={"full": full, "swa": swa, "next_owner": next_owner})
    state = _set_mapping(state, fslots[:n_head], (0,) * n_head)
    return _hand_out(state, fslots[n_head:], sslots, fslots), fslots


# ---------------------------------------------------------------- release


def free(state: SWAAllocatorState, free_index: Sequence[int]) -> SWAAllocatorState:
    """Release the SWA side, then the full pages touched by ``free_index`` (0.5.23 order).

    Not idempotent: a second ``free`` of the same slots is a double free. Slots whose
    SWA side is already released are accepted (their M is 0).
    """
    op = "free"
    _check_release_args(state, op, free_index)
    state = _release_swa(state, free_index)
    return _release_full(state, free_index)


def free_swa(state: SWAAllocatorState, free_index: Sequence[int]) -> SWAAllocatorState:
    """Release the SWA pages of the full pages ``free_index`` touches and zero their M (M3).

    Used by window eviction (``_evict_swa``, §1.6). Idempotent on the SWA side: a
    second call finds M == 0 and releases nothing.
    """
    _check_release_args(state, "free_swa", free_index)
    return _release_swa(state, free_index)


def free_full(state: SWAAllocatorState, free_index: Sequence[int]) -> SWAAllocatorState:
    """Release full pages whose SWA side the caller already released (0.5.23 ``free_full``)."""
    op, p, mapping = "free_full", state.config.page_size, state.full_to_swa_index_mapping
    _check_release_args(state, op, free_index)
    for g in sorted({f // p for f in free_index}):
        for f in range(g * p, g * p + state.fill[g]):
            # a live SWA peer would be stranded (0.5.23 guard swa.peer_released)
            require(mapping[f] == 0, op, "free_index",
                    f"slot {f} (page {g}) still maps to SWA slot {mapping[f]}: use free or free_swa first")
    return _release_full(state, free_index)


def clear(state: SWAAllocatorState) -> SWAAllocatorState:
    """Back to the initial pools and mapping (keeps the sentinel); every KV row becomes undefined."""
    fresh = initial_state(state.config)
    return fresh.model_copy(update={"epoch": state.epoch + 1, "next_owner": state.next_owner})


def backup_state(state: SWAAllocatorState) -> AllocatorBackup:
    """Capture both free lists (0.5.12.post1 semantics; the mapping is NOT captured, R3)."""
    return AllocatorBackup(full_free_pages=state.full.free_pages, swa_free_pages=state.swa.free_pages,
                           fill=state.fill, epoch=state.epoch)


def restore_state(state: SWAAllocatorState, backup: AllocatorBackup) -> SWAAllocatorState:
    """Give back every page allocated since ``backup``; the mapping keeps its entries (R3, §8 item 1).

    Speculative decoding uses this to drop draft allocations. Only allocations may
    happen in between: a release since the backup would be resurrected as allocated.
    """
    op = "restore_state"
    # only allocations may happen between backup_state and restore_state
    require(backup.epoch == state.epoch, op, "state",
            f"pages were released since backup_state (epoch {backup.epoch} -> {state.epoch})")
    require(len(backup.fill) == len(state.fill), op, "state", "backup comes from a pool of another size")
    full = _roll_back(state.full, backup.full_free_pages)
    swa = _roll_back(state.swa, backup.swa_free_pages)
    # the pages the roll-back releases lose their rows, as on any release
    kv = _forget_pages(state, state.kv, "full", _newly_free(state.full, full))
    kv = _forget_pages(state, kv, "swa", _newly_free(state.swa, swa))
    # a restore releases pages too: any other backup is stale from now on
    return state.model_copy(update={"full": full, "swa": swa, "fill": backup.fill, "kv": kv,
                                    "epoch": state.epoch + 1})


def set_full_to_swa_mapping(state: SWAAllocatorState, full_indices: Sequence[int],
                            swa_indices: Sequence[int]) -> SWAAllocatorState:
    """``M[full] = swa``: re-attach SWA slots to live full slots (HiCache load-back, §1.5).

    The new live mapping must stay well formed (M2, M5, no stranded SWA page); an
    empty call is a no-op (upstream returns before anything else). ``restore_state``
    cannot undo a remap (it never restores M): a backup taken before one is stale.
    """
    op = "set_full_to_swa_mapping"
    require(len(full_indices) == len(swa_indices), op, "swa_indices",
            f"{len(swa_indices)} SWA slots for {len(full_indices)} full slots")
    if not full_indices:
        return state
    _check_live(state, op, "full_indices", full_indices, duplicates_ok=False)
    p, top = state.config.page_size, (state.config.num_pages_swa + 1) * state.config.page_size
    for s in swa_indices:
        # M1: 0 (no SWA slot) or a real SWA slot
        require(s == 0 or p <= s < top, op, "swa_indices", f"{s} is neither 0 nor an SWA slot in [{p}, {top})")
    new = _set_mapping(state, full_indices, swa_indices)
    try:
        check_live_mapping(new)
    except InvariantViolation as err:
        raise InvalidOperation(op, "swa_indices", f"the mapping would break {err}") from None
    return new.model_copy(update={"epoch": new.epoch + 1})


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
    require(0 <= layer_id < geo.num_layers, op, "layer_id", f"{layer_id} is outside [0, {geo.num_layers})")
    require(len(cache_k) == len(loc) == len(cache_v), op, "cache_k",
            f"{len(cache_k)} K rows and {len(cache_v)} V rows for {len(loc)} slots")
    for row in (*cache_k, *cache_v):
        require(len(row) == geo.row_width, op, "cache_k", f"row of {len(row)} values, expected {geo.row_width}")
    # live slots, or 0 for padding tokens (CUDA-graph padding writes into the reserved slot by design, §1.4)
    _check_live(state, op, "loc", [f for f in loc if f != 0], duplicates_ok=False)
    if swa_loc is not None:
        require(len(swa_loc) == len(loc), op, "swa_loc", f"{len(swa_loc)} SWA slots for {len(loc)} slots")
    if not geo.is_swa_layer(layer_id):
        dest = tuple(loc)
    else:
        dest = tuple(swa_loc) if swa_loc is not None else tuple(state.full_to_swa_index_mapping[f] for f in loc)
    rows = [tuple(float(x) for x in k) + tuple(float(x) for x in v) for k, v in zip(cache_k, cache_v, strict=True)]
    return state.model_copy(update={"kv": write_rows(state.kv, layer_id, dest, rows)})


def kv_rows(state: SWAAllocatorState, layer_id: int, slots: Sequence[int]) -> tuple[Row | None, ...]:
    """Rows of one layer at pool slots (SWA slots for SWA layers); ``None`` = undefined."""
    return read_rows(state.kv, layer_id, slots)


def get_cpu_copy(state: SWAAllocatorState, indices: Sequence[int]) -> KVCpuCopy:
    """Copy the KV of the tokens at full slots ``indices`` (§2.8).

    ``swa_mask[j] = M[indices[j]] > 0``; SWA rows are saved for the true entries only.
    """
    op, geo = "get_cpu_copy", state.config.kv
    _check_live(state, op, "indices", indices, duplicates_ok=True)
    swa_slots = tuple(state.full_to_swa_index_mapping[f] for f in indices)
    mask = tuple(s > 0 for s in swa_slots)
    full = tuple(read_rows(state.kv, layer, indices) for layer in geo.full_attention_layer_ids)
    mapped = [s for s in swa_slots if s > 0]
    swa = tuple(read_rows(state.kv, layer, mapped) for layer in geo.swa_attention_layer_ids) if mapped else None
    return KVCpuCopy(full=full, swa=swa, swa_mask=mask)


def load_cpu_copy(state: SWAAllocatorState, kv_cpu: KVCpuCopy, indices: Sequence[int]) -> SWAAllocatorState:
    """Load a CPU copy into new full slots ``indices`` of the same positions (§2.8).

    Full rows go to every position. A saved SWA row is restored iff its position is
    mapped at load time too (``row_mask = new_mask[old_mask]``); positions mapped
    only now get no data (mask symmetry, proved in ``kvproof.spec.swa_mask``).
    """
    op, geo = "load_cpu_copy", state.config.kv
    # position alignment: the copy and the destination cover the same positions
    require(len(indices) == len(kv_cpu.swa_mask), op, "indices",
            f"{len(indices)} destination slots for a copy of {len(kv_cpu.swa_mask)} positions")
    require(len(kv_cpu.full) == len(geo.full_attention_layer_ids), op, "kv_cache_cpu",
            "copy has a different number of full layers")
    _check_live(state, op, "indices", indices, duplicates_ok=False)
    kv = state.kv
    for layer, rows in zip(geo.full_attention_layer_ids, kv_cpu.full, strict=True):
        kv = write_rows(kv, layer, indices, rows)
    if kv_cpu.swa is not None:
        new = tuple(state.full_to_swa_index_mapping[f] for f in indices)
        old_mapped = [j for j, m in enumerate(kv_cpu.swa_mask) if m]
        keep = [k for k, j in enumerate(old_mapped) if new[j] > 0]  # row_mask = new_mask[old_mask]
        dest = [new[old_mapped[k]] for k in keep]
        for layer, rows in zip(geo.swa_attention_layer_ids, kv_cpu.swa, strict=True):
            kv = write_rows(kv, layer, dest, [rows[k] for k in keep])
    return state.model_copy(update={"kv": kv})


# ---------------------------------------------------------------- internals


def _check_capacity(state: SWAAllocatorState, op: str, full_pages: int, swa_pages: int) -> None:
    if full_pages > len(state.full.free_pages):
        raise OutOfMemory(op, "full", full_pages, len(state.full.free_pages))
    if swa_pages > len(state.swa.free_pages):
        raise OutOfMemory(op, "swa", swa_pages, len(state.swa.free_pages))


def _check_live(state: SWAAllocatorState, op: str, arg: str, slots: Sequence[int], *, duplicates_ok: bool,
                freed_means: str = "is not allocated") -> None:
    """Each slot is a handed-out full slot: in range, not in page 0, page allocated, offset live."""
    p, end = state.config.page_size, (state.config.num_pages_full + 1) * state.config.page_size
    seen: set[int] = set()
    for f in slots:
        require(0 <= f < end, op, arg, f"slot {f} is outside the full pool [0, {end})")
        require(f >= p, op, arg, f"slot {f} lies in the reserved page 0")
        require(state.full.is_allocated(f // p), op, arg, f"slot {f} is in page {f // p}, which {freed_means}")
        require(f % p < state.fill[f // p], op, arg,
                f"slot {f} was never handed out (page {f // p} has {state.fill[f // p]} live slots)")
        require(duplicates_ok or f not in seen, op, arg, f"slot {f} appears twice")
        seen.add(f)


def _check_release_args(state: SWAAllocatorState, op: str, free_index: Sequence[int]) -> None:
    _check_live(state, op, "free_index", free_index, duplicates_ok=False,
                freed_means="is already free (double free)")


def _check_extend_args(state: SWAAllocatorState, op: str, prefix_lens: Sequence[int], seq_lens: Sequence[int],
                       last_loc: Sequence[int], extend_num_tokens: int) -> None:
    """Preconditions shared by the paged extends (§1.3), stated for the full side."""
    p = state.config.page_size
    require(len(prefix_lens) == len(seq_lens) == len(last_loc), op, "seq_lens",
            f"prefix_lens, seq_lens, last_loc have lengths {len(prefix_lens)}, {len(seq_lens)}, {len(last_loc)}")
    for pre, seq in zip(prefix_lens, seq_lens, strict=True):
        require(0 <= pre <= seq, op, "seq_lens", f"need 0 <= prefix_len <= seq_len, got {pre} and {seq}")
    # U2: the caller's token count matches the batch
    total = sum(seq_lens) - sum(prefix_lens)
    require(extend_num_tokens == total, op, "extend_num_tokens", f"{extend_num_tokens} != sum(seq - prefix) = {total}")
    pages = []
    for pre, seq, loc in zip(prefix_lens, seq_lens, last_loc, strict=True):
        # last_loc is -1 exactly for requests without a prefix
        require((loc == -1) == (pre == 0), op, "last_loc", f"{loc} for prefix_len {pre}")
        if pre == 0:
            continue
        _check_live(state, op, "last_loc", (loc,), duplicates_ok=True)
        # the new token continues right after last_loc (SGLang's debug-mode check)
        require((loc + 1) % p == pre % p, op, "last_loc",
                f"(last_loc + 1) mod P = {(loc + 1) % p} != prefix_len mod P = {pre % p}")
        require(state.fill[loc // p] == loc % p + 1, op, "last_loc",
                f"slot {loc} is not the last live slot of page {loc // p}")
        if pre % p and seq > pre:
            pages.append(loc // p)
    # two requests cannot continue the same partial page
    require(len(pages) == len(set(pages)), op, "last_loc", f"two requests continue the same page: {sorted(pages)}")


def _check_swa_continuation(state: SWAAllocatorState, op: str, prefix_lens: Sequence[int],
                            seq_lens: Sequence[int], last_loc: Sequence[int]) -> None:
    p, mapping = state.config.page_size, state.full_to_swa_index_mapping
    for pre, seq, loc in zip(prefix_lens, seq_lens, last_loc, strict=True):
        # M5: a 1:1 extend that continues a page continues its SWA page too
        require(not (pre % p and seq > pre) or mapping[loc] > 0, op, "last_loc",
                f"continues page {loc // p} but its SWA side is released (M[{loc}] == 0)")


def _resolve_owners(state: SWAAllocatorState, op: str, prefix_lens: Sequence[int], last_loc: Sequence[int],
                    owners: Sequence[Owner] | None) -> tuple[tuple[Owner, ...], int]:
    """Ghost owners per request: given, or the owner of ``last_loc``'s page, or fresh labels."""
    p, nxt, out = state.config.page_size, state.next_owner, []
    for i, (pre, loc) in enumerate(zip(prefix_lens, last_loc, strict=True)):
        current = state.full.owner[loc // p] if pre > 0 else None
        if owners is None:
            who = current if current is not None else nxt
            nxt += current is None
        else:
            require(len(owners) == len(prefix_lens), op, "owners",
                    f"{len(owners)} owners for {len(prefix_lens)} requests")
            who = owners[i]
            require(current is None or current == who, op, "owners", f"page {loc // p} belongs to {current}, not {who}")
        out.append(who)
    return tuple(out), nxt


def _extend_slots(prefix_len: int, seq_len: int, last_loc: int, new_pages: Sequence[int], p: int) -> list[int]:
    """Slots of one request's extend: part 1 after ``last_loc``, then the new pages in order (§1.3)."""
    n1, n2, n3 = extend_parts(prefix_len, seq_len, p)
    # G4: the capacity check took exactly the pages the geometry needs
    ensure(len(new_pages) == n2 // p + (n3 > 0), "G4", f"extend {prefix_len}->{seq_len} got {len(new_pages)} pages")
    slots = [last_loc + 1 + i for i in range(n1)]
    for page in new_pages[: n2 // p]:
        slots.extend(range(page * p, page * p + p))
    if n3:
        page = new_pages[n2 // p]
        slots.extend(range(page * p, page * p + n3))
    return slots


def _extend_one_to_one(state: SWAAllocatorState, op: str, prefix_lens: Sequence[int], seq_lens: Sequence[int],
                       last_loc: Sequence[int], owners: Sequence[Owner]) -> tuple[SWAAllocatorState, Slots]:
    """The shared body of ``alloc_extend`` / ``alloc_decode`` after validation."""
    p, mapping = state.config.page_size, state.full_to_swa_index_mapping
    counts = [num_new_pages(pre, seq, p) for pre, seq in zip(prefix_lens, seq_lens, strict=True)]
    _check_capacity(state, op, sum(counts), sum(counts))
    page_owners = [who for who, c in zip(owners, counts, strict=True) for _ in range(c)]
    full, fpages = take_pages(state.full, page_owners)
    swa, spages = take_pages(state.swa, page_owners)
    fslots: list[int] = []
    sslots: list[int] = []
    start = 0
    for pre, seq, loc, c in zip(prefix_lens, seq_lens, last_loc, counts, strict=True):
        fslots += _extend_slots(pre, seq, loc, fpages[start:start + c], p)
        sslots += _extend_slots(pre, seq, mapping[loc] if pre % p else -1, spages[start:start + c], p)
        start += c
    state = state.model_copy(update={"full": full, "swa": swa})
    return _hand_out(state, tuple(fslots), tuple(sslots), tuple(fslots)), tuple(fslots)


def _set_mapping(state: SWAAllocatorState, full_slots: Sequence[int], values: Sequence[int]) -> SWAAllocatorState:
    mapping = list(state.full_to_swa_index_mapping)
    for f, v in zip(full_slots, values, strict=True):
        mapping[f] = v
    return state.model_copy(update={"full_to_swa_index_mapping": tuple(mapping)})


def _hand_out(state: SWAAllocatorState, mapped_full: Slots, swa_slots: Slots, all_full: Slots) -> SWAAllocatorState:
    """Map ``mapped_full`` 1:1 onto ``swa_slots``, mark ``all_full`` live, and undefine their KV rows."""
    p, geo = state.config.page_size, state.config.kv
    state = _set_mapping(state, mapped_full, swa_slots)
    fill = list(state.fill)
    for f in all_full:
        fill[f // p] = max(fill[f // p], f % p + 1)
    kv = forget_rows(state.kv, geo.full_attention_layer_ids, all_full)
    kv = forget_rows(kv, geo.swa_attention_layer_ids, swa_slots)
    return state.model_copy(update={"fill": tuple(fill), "kv": kv})


def _release_swa(state: SWAAllocatorState, free_index: Sequence[int]) -> SWAAllocatorState:
    """Release the SWA pages of the live slots of the touched full pages; zero M on those pages."""
    p, mapping = state.config.page_size, state.full_to_swa_index_mapping
    touched = sorted({f // p for f in free_index}) if p > 1 else list(free_index)
    swa_pages = []
    for g in touched:
        for f in range(g * p, g * p + state.fill[g]):
            s = mapping[f]
            if s <= 0:
                continue
            # M2: the SWA page released with a live full slot is held by the same owner
            ensure(state.swa.is_allocated(s // p) and state.swa.owner[s // p] == state.full.owner[g], "M2",
                   f"free_swa: SWA slot {s} of full slot {f} is not held by its owner")
            swa_pages.append(s // p)
    zeroed = [f for g in touched for f in range(g * p, g * p + p)]
    state = _set_mapping(state, zeroed, (0,) * len(zeroed))
    return state.model_copy(update={"swa": release_pages(state.swa, swa_pages),
                                    "kv": _forget_pages(state, state.kv, "swa", swa_pages),
                                    "epoch": state.epoch + bool(swa_pages)})


def _release_full(state: SWAAllocatorState, free_index: Sequence[int]) -> SWAAllocatorState:
    p = state.config.page_size
    pages = [f // p for f in free_index]
    fill = list(state.fill)
    for g in pages:
        fill[g] = 0
    return state.model_copy(update={"full": release_pages(state.full, pages), "fill": tuple(fill),
                                    "kv": _forget_pages(state, state.kv, "full", pages),
                                    "epoch": state.epoch + bool(pages)})


def _forget_pages(state: SWAAllocatorState, kv: KVStore, pool: str, pages: Iterable[int]) -> KVStore:
    """Released pages lose their rows (every slot): a later owner of the page never reads what an earlier one
    wrote, whichever page an implementation reuses (rows are compared only where the current owner wrote)."""
    p, geo = state.config.page_size, state.config.kv
    layers = geo.full_attention_layer_ids if pool == "full" else geo.swa_attention_layer_ids
    return forget_rows(kv, layers, sorted({g * p + o for g in pages for o in range(p)}))


def _newly_free(before: PagedPool, after: PagedPool) -> list[int]:
    """Pages allocated in ``before`` and free in ``after``."""
    return [g for g in range(1, before.num_pages + 1) if before.owner[g] is not None and after.owner[g] is None]


def _roll_back(pool: PagedPool, free_pages: tuple[int, ...]) -> PagedPool:
    owner = list(pool.owner)
    for page in free_pages:
        owner[page] = None
    return pool.model_copy(update={"free_pages": free_pages, "owner": tuple(owner)})


def check_live_mapping(state: SWAAllocatorState) -> None:
    """M2 (as maintained) and M5 over live slots, plus: every owned SWA page is reachable (G3).

    Raises :class:`InvariantViolation` (:func:`check_live_pairs`); :mod:`kvproof.reference.invariants`
    runs it with the pool checks, and ``set_full_to_swa_mapping`` uses it as its precondition.
    """
    mapping, swa = state.full_to_swa_index_mapping, state.swa
    live = [(f, s) for f, s in enumerate(mapping[:-1]) if s > 0 and is_live(state, f)]
    swa_owner = {h: who for h in range(1, swa.num_pages + 1) if (who := swa.owner[h]) is not None}
    check_live_pairs(state.config.page_size, live, state.full.owner, swa_owner)


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
