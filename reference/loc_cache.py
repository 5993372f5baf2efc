"""``loc_cache``: the full->SWA location translation cache of SGLang PR #25824 / #26152 (sglang_semantics.md §3).

Theory of operation
-------------------
``SWAKVPool.translate_loc_from_full_to_swa(x)`` returns ``M[x]`` and memoises it under
a key made of the *address* of ``x`` and its length: ``(x.data_ptr(), x.numel())``
as merged (:attr:`KeyScheme.DATA_PTR`), or ``(x.untyped_storage().data_ptr(),
x.numel())`` in an intermediate revision (:attr:`KeyScheme.STORAGE_BASE`, scenario
S5: equal-length views of one storage collide). The cache cannot see what ``x``
holds, nor ``M``: it stays fresh only because it is dropped (``invalidate_loc_cache``)
at the *invalidation points* (§3.3):

* every allocator mutator of ``M``, at its start: ``alloc``, ``alloc_extend``,
  ``alloc_extend_swa_tail``, ``alloc_decode``, ``free_swa`` (reached by ``free``),
  ``set_full_to_swa_mapping``, ``clear``;
* ``register_mapping`` (a new mapping tensor replaces the old one; #25889);
* every forward, before the CUDA-graph branch (``model_runner._forward_raw``, #26152);
* every graph runner's ``run_once`` (warm-up and capture runs; scenario S6).

The points are a typed parameter (:class:`LocCachePolicy`): the upstream design is
one value, and each broken variant (a point removed, the storage-base key, one cache
shared by several pools) is another value of the same parameter.

Index tensors are modelled as *views* of *storages* at byte *addresses*
(:class:`IndexMemory`), so a view's key, its contents and the reuse of a freed
storage's address by a new one (the CUDA caching allocator's habit) are explicit.

The environment the design assumes (C1, §3.4), stated as the contract E1, per pool
(each pool's own forward ends its batch preparation; pool 1 here never runs one, so
the memory it translates is never rewritten). A run alternates two phases:

* *quiet* (after a forward): index memory is not rewritten; the scheduler may
  translate any view (``translate_loc_from_full_to_swa``, e.g. the PD transfer code)
  and call allocator mutators;
* *batch preparation* (from the first rewrite of index memory -- an in-place write,
  or a new storage at a freed storage's address -- until the next ``forward`` /
  ``replay``): mutators run (``alloc_extend`` / ``alloc_decode`` translate their
  ``last_loc`` right after their invalidation point), but nobody else translates.

Under E1 the upstream policy never returns a stale translation, and every one of its
points is needed: dropping any one of them has a stale-read trace (both proved in
``kvproof.spec.loc_cache``; the traces are fixed vectors in
``tests/reference/test_loc_cache.py``). A scheduler-side translation during batch
preparation breaks E1 and reads stale data even from the upstream design (R2-a),
which is why upstream later dropped the cache (#27091). ``restore_state`` and
``free_full`` never write the mapping and need no invalidation.

Truth and the ghost log: :func:`fresh_translation` is ``M[contents(view)]``. Every
translation the cache returns is compared with it; a difference is appended to
``stale_reads`` (ghost state), so "no stale read" is a checkable property of a run.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field

from kvproof.reference import index_memory as im
from kvproof.reference import swa_allocator as sa
from kvproof.reference.config import PoolConfig
from kvproof.reference.errors import InvalidOperation, require
from kvproof.reference.index_memory import (
    ELEMENT_BYTES,
    IndexMemory,
    IndexView,
    Storage,
    data_ptr,
    storage_ptr,
    view_contents,
)
from kvproof.reference.paged import Owner

__all__ = [
    "ELEMENT_BYTES",
    "UPSTREAM_POINTS",
    "CapturedGraph",
    "IndexMemory",
    "IndexView",
    "InvalidationPoint",
    "KeyScheme",
    "LocCache",
    "LocCachePolicy",
    "LocCacheSystem",
    "StaleRead",
    "Storage",
    "alloc",
    "alloc_decode",
    "alloc_extend",
    "alloc_extend_swa_tail",
    "backup_state",
    "cache_key",
    "capture",
    "clear",
    "data_ptr",
    "forward",
    "free",
    "free_full",
    "free_storage",
    "free_swa",
    "fresh_translation",
    "initial_system",
    "invalidate_loc_cache",
    "make_view",
    "new_storage",
    "register_mapping",
    "replay",
    "restore_state",
    "set_full_to_swa_mapping",
    "translate_loc_from_full_to_swa",
    "view_contents",
    "write_index",
]

_FROZEN = ConfigDict(frozen=True, extra="forbid")

Rows = Mapping[int, tuple[Sequence[Sequence[float]], Sequence[Sequence[float]]]]


class KeyScheme(str, enum.Enum):  # noqa: UP042 - StrEnum would change str() and f-strings (pytest ids, reports) from Class.MEMBER to the value
    """What the cache key is made of."""

    DATA_PTR = "data_ptr"  # (x.data_ptr(), x.numel()): the view's own address (#25824 as merged)
    STORAGE_BASE = "storage_base"  # (x.untyped_storage().data_ptr(), x.numel()): intermediate revision (S5)


class InvalidationPoint(str, enum.Enum):  # noqa: UP042 - StrEnum would change str() and f-strings (pytest ids, reports) from Class.MEMBER to the value
    """A place where upstream calls ``invalidate_loc_cache()`` (§3.3)."""

    ALLOC = "alloc"
    ALLOC_EXTEND = "alloc_extend"
    ALLOC_EXTEND_SWA_TAIL = "alloc_extend_swa_tail"
    ALLOC_DECODE = "alloc_decode"
    FREE_SWA = "free_swa"  # also reached by free
    SET_FULL_TO_SWA_MAPPING = "set_full_to_swa_mapping"
    CLEAR = "clear"
    REGISTER_MAPPING = "register_mapping"
    FORWARD = "forward"  # model_runner._forward_raw, before the graph branch (#26152)
    RUN_ONCE = "run_once"  # every graph runner's warm-up / capture closure


#: The upstream design after #26152: every point present.
UPSTREAM_POINTS: frozenset[InvalidationPoint] = frozenset(InvalidationPoint)


class LocCachePolicy(BaseModel):
    """The cache design: key scheme, invalidation points, and whether pools share one cache."""

    model_config = _FROZEN

    key_scheme: KeyScheme = KeyScheme.DATA_PTR
    invalidate_at: frozenset[InvalidationPoint] = UPSTREAM_POINTS
    shared_across_pools: bool = False  # a broken variant: one cache for every pool of the process

    def without(self, point: InvalidationPoint) -> LocCachePolicy:
        """This policy with one invalidation point removed."""
        return self.model_copy(update={"invalidate_at": self.invalidate_at - {point}})


def cache_key(memory: IndexMemory, view: IndexView, scheme: KeyScheme) -> tuple[int, int]:
    """The cache key of a view under ``scheme``: an address and the element count."""
    address = data_ptr(memory, view) if scheme is KeyScheme.DATA_PTR else storage_ptr(memory, view)
    return (address, view.numel)


# ---------------------------------------------------------------- the cache and the system


class LocCache(BaseModel):
    """``(_cached_loc_key, _cached_swa_loc)`` of one ``SWAKVPool``; ``pool`` says whose mapping produced it."""

    model_config = _FROZEN

    key: tuple[int, int] | None = None
    value: tuple[int, ...] | None = None
    pool: int = 0


class CapturedGraph(BaseModel):
    """A captured graph of ``run_once`` on the static buffer ``loc`` (§3.3, C3).

    If the capture run missed the cache, the gather ``M[loc]`` was recorded and every
    replay recomputes it from the live buffer and the live mapping. If it hit, nothing
    was recorded and every replay reuses ``constant``, the warm-up's translation (S6).
    """

    model_config = _FROZEN

    loc: IndexView
    recorded_gather: bool
    constant: tuple[int, ...]


class StaleRead(BaseModel):
    """Ghost record: a translation that differed from ``M[contents]`` at the time it was used."""

    model_config = _FROZEN

    op: str
    pool: int
    view: IndexView
    returned: tuple[int, ...]
    fresh: tuple[int, ...]


class LocCacheSystem(BaseModel):
    """The allocator (pool 0), a second SWA pool's mapping (pool 1), index memory, caches, ghost log."""

    model_config = _FROZEN

    policy: LocCachePolicy
    allocator: sa.SWAAllocatorState
    other_mapping: tuple[int, ...]  # pool 1: an idle SWA pool of the same geometry (e.g. a draft model's)
    memory: IndexMemory = IndexMemory()
    caches: tuple[LocCache, ...] = Field(default=(LocCache(), LocCache()))
    graph: CapturedGraph | None = None
    stale_reads: tuple[StaleRead, ...] = ()


def initial_system(config: PoolConfig, policy: LocCachePolicy | None = None) -> LocCacheSystem:
    policy = policy or LocCachePolicy()
    allocator = sa.initial_state(config)
    caches = (LocCache(),) if policy.shared_across_pools else (LocCache(), LocCache())
    return LocCacheSystem(policy=policy, allocator=allocator, other_mapping=allocator.full_to_swa_index_mapping,
                          caches=caches)


def _cache_slot(system: LocCacheSystem, pool: int) -> int:
    return 0 if system.policy.shared_across_pools else pool


def _mapping(system: LocCacheSystem, pool: int) -> tuple[int, ...]:
    return system.allocator.full_to_swa_index_mapping if pool == 0 else system.other_mapping


# ---------------------------------------------------------------- memory operations (system level)


def new_storage(system: LocCacheSystem, base: int, contents: Sequence[int]) -> tuple[LocCacheSystem, int]:
    """Allocate index memory at ``base`` (a freed storage's address may be reused)."""
    memory, sid = im.new_storage(system.memory, base, contents)
    return system.model_copy(update={"memory": memory}), sid


def free_storage(system: LocCacheSystem, storage: int) -> LocCacheSystem:
    return system.model_copy(update={"memory": im.free_storage(system.memory, storage)})


def write_index(system: LocCacheSystem, storage: int, offset: int, values: Sequence[int]) -> LocCacheSystem:
    return system.model_copy(update={"memory": im.write_index(system.memory, storage, offset, values)})


def make_view(system: LocCacheSystem, storage: int, offset: int, numel: int) -> IndexView:
    return im.make_view(system.memory, storage, offset, numel)


def _live_view(system: LocCacheSystem, op: str, view: IndexView) -> tuple[int, ...]:
    storages = system.memory.storages
    require(0 <= view.storage < len(storages) and storages[view.storage].alive, op, "storage",
            f"storage {view.storage} is not allocated")
    return view_contents(system.memory, view)


# ---------------------------------------------------------------- translation


def fresh_translation(system: LocCacheSystem, view: IndexView, *, pool: int = 0) -> tuple[int, ...]:
    """The truth: ``M[contents(view)]`` of ``pool``'s current mapping (-1 stays -1)."""
    mapping = _mapping(system, pool)
    return tuple(mapping[f] for f in view_contents(system.memory, view))


def invalidate_loc_cache(system: LocCacheSystem, *, pool: int = 0) -> LocCacheSystem:
    """Drop the cached translation of ``pool`` (its shared cache, if pools share one)."""
    caches = list(system.caches)
    caches[_cache_slot(system, pool)] = LocCache()
    return system.model_copy(update={"caches": tuple(caches)})


def _at(system: LocCacheSystem, point: InvalidationPoint) -> LocCacheSystem:
    """The invalidation an operation performs at ``point`` -- if the policy has that point."""
    return invalidate_loc_cache(system) if point in system.policy.invalidate_at else system


def translate_loc_from_full_to_swa(system: LocCacheSystem, view: IndexView, *, pool: int = 0,
                                   op: str = "translate_loc_from_full_to_swa"
                                   ) -> tuple[LocCacheSystem, tuple[int, ...]]:
    """``M[view]`` through ``pool``'s cache: a hit returns the cached value, a miss gathers and caches."""
    contents = _live_view(system, op, view)
    n = len(_mapping(system, pool)) - 1
    for f in contents:
        # -1 (no prefix) or a full slot id
        require(-1 <= f < n, op, "loc", f"{f} is outside [-1, {n})")
    slot = _cache_slot(system, pool)
    cache, key = system.caches[slot], cache_key(system.memory, view, system.policy.key_scheme)
    if cache.key == key and cache.value is not None:
        value = cache.value
    else:
        value = fresh_translation(system, view, pool=pool)
        caches = list(system.caches)
        caches[slot] = LocCache(key=key, value=value, pool=pool)
        system = system.model_copy(update={"caches": tuple(caches)})
    return _note(system, op, pool, view, value), value


def _note(system: LocCacheSystem, op: str, pool: int, view: IndexView, value: tuple[int, ...]) -> LocCacheSystem:
    fresh = fresh_translation(system, view, pool=pool)
    if value == fresh:
        return system
    read = StaleRead(op=op, pool=pool, view=view, returned=value, fresh=fresh)
    return system.model_copy(update={"stale_reads": (*system.stale_reads, read)})


# ---------------------------------------------------------------- forward, capture, replay


def forward(system: LocCacheSystem, loc: IndexView, rows: Rows) -> LocCacheSystem:
    """One forward of a batch whose new tokens are at full slots ``loc`` (``out_cache_loc``).

    Invalidates (point ``forward``), then every layer with rows writes them:
    full layers at ``loc``, SWA layers at the cached translation of ``loc``
    (the first SWA layer misses, the others hit: C2).
    """
    _check_batch(system, "forward", loc)
    system = _at(system, InvalidationPoint.FORWARD)
    return _write_layers(system, "forward", loc, rows, translated=None)


def _check_batch(system: LocCacheSystem, op: str, loc: IndexView) -> None:
    """out_cache_loc holds distinct live full slots, or 0 for padding tokens."""
    slots = [f for f in _live_view(system, op, loc) if f != 0]
    for f in slots:
        require(sa.is_live(system.allocator, f), op, "out_cache_loc", f"slot {f} is not a live full slot")
    require(len(set(slots)) == len(slots), op, "out_cache_loc", f"a slot appears twice in {slots}")


def _write_layers(system: LocCacheSystem, op: str, loc: IndexView, rows: Rows,
                  translated: tuple[int, ...] | None) -> LocCacheSystem:
    slots, geo = list(_live_view(system, op, loc)), system.allocator.config.kv
    state = system.allocator
    for layer_id in sorted(rows):
        k, v = rows[layer_id]
        swa_loc = None
        if geo.is_swa_layer(layer_id):
            if translated is None:
                system, value = translate_loc_from_full_to_swa(system.model_copy(update={"allocator": state}),
                                                               loc, op=op)
            else:
                value = translated
            swa_loc = list(value)
        state = sa.set_kv_buffer(state, layer_id, slots, k, v, swa_loc=swa_loc)
    return system.model_copy(update={"allocator": state})


def capture(system: LocCacheSystem, loc: IndexView, *, warmups: int = 2) -> LocCacheSystem:
    """Capture ``run_once`` on the static buffer ``loc``: ``warmups`` warm-up runs, then the capture run.

    Each run first invalidates (point ``run_once``), then translates ``loc``. The static
    buffer holds padding (slot 0) while capturing, as the runners' buffers do, so the
    runs write no KV that anyone reads.
    """
    op = "capture"
    require(set(_live_view(system, op, loc)) <= {0}, op, "loc", "capture runs on a padding buffer (all 0)")
    require(warmups >= 0, op, "warmups", f"must be >= 0, got {warmups}")
    hit = False
    value: tuple[int, ...] = ()
    for _ in range(warmups + 1):
        system = _at(system, InvalidationPoint.RUN_ONCE)
        slot = _cache_slot(system, 0)
        cache, key = system.caches[slot], cache_key(system.memory, loc, system.policy.key_scheme)
        hit = cache.key == key and cache.value is not None
        system, value = translate_loc_from_full_to_swa(system, loc, op=op)
    graph = CapturedGraph(loc=loc, recorded_gather=not hit, constant=value)
    return system.model_copy(update={"graph": graph})


def replay(system: LocCacheSystem, rows: Rows) -> LocCacheSystem:
    """A forward that replays the captured graph on the static buffer's current contents.

    Invalidates first (point ``forward``: #26152 moved it before the graph branch), then
    the graph writes every layer's rows; SWA layers use the recorded gather (fresh) or
    the constant captured with it.
    """
    op, graph = "replay", system.graph
    if graph is None:
        raise InvalidOperation(op, "graph", "nothing was captured")
    _check_batch(system, op, graph.loc)
    system = _at(system, InvalidationPoint.FORWARD)
    value = fresh_translation(system, graph.loc) if graph.recorded_gather else graph.constant
    if any(system.allocator.config.kv.is_swa_layer(layer) for layer in rows):
        system = _note(system, op, 0, graph.loc, value)
    return _write_layers(system, op, graph.loc, rows, translated=value)


# ---------------------------------------------------------------- allocator operations with their points


def _with_allocator(system: LocCacheSystem, state: sa.SWAAllocatorState) -> LocCacheSystem:
    return system.model_copy(update={"allocator": state})


def _internal_translate(system: LocCacheSystem, op: str, last_loc: IndexView) -> LocCacheSystem:
    """``alloc_extend`` / ``alloc_decode`` translate ``last_loc`` through the cache (C4)."""
    system, _ = translate_loc_from_full_to_swa(system, last_loc, op=op)
    return system


def alloc(system: LocCacheSystem, need_size: int, *, owner: Owner | None = None
          ) -> tuple[LocCacheSystem, tuple[int, ...]]:
    system = _at(system, InvalidationPoint.ALLOC)
    state, slots = sa.alloc(system.allocator, need_size, owner=owner)
    return _with_allocator(system, state), slots


def alloc_extend(system: LocCacheSystem, prefix_lens: Sequence[int], seq_lens: Sequence[int], last_loc: IndexView,
                 extend_num_tokens: int, *, owners: Sequence[Owner] | None = None
                 ) -> tuple[LocCacheSystem, tuple[int, ...]]:
    """Invalidate, then the composite ``alloc_extend``, whose SWA side continues from ``last_loc``
    translated through the cache (C4: the refilled entry stays fresh, the new slots are not in ``last_loc``).

    The composite validates first, so a bad call raises the composite's error and changes nothing.
    """
    op = "alloc_extend"
    system = _at(system, InvalidationPoint.ALLOC_EXTEND)
    loc = list(_live_view(system, op, last_loc))
    state, slots = sa.alloc_extend(system.allocator, prefix_lens, seq_lens, loc, extend_num_tokens, owners=owners)
    return _with_allocator(_internal_translate(system, op, last_loc), state), slots


def alloc_decode(system: LocCacheSystem, seq_lens: Sequence[int], last_loc: IndexView, *,
                 owners: Sequence[Owner] | None = None) -> tuple[LocCacheSystem, tuple[int, ...]]:
    op = "alloc_decode"
    system = _at(system, InvalidationPoint.ALLOC_DECODE)
    loc = list(_live_view(system, op, last_loc))
    state, slots = sa.alloc_decode(system.allocator, seq_lens, loc, owners=owners)
    return _with_allocator(_internal_translate(system, op, last_loc), state), slots


def alloc_extend_swa_tail(system: LocCacheSystem, prefix_lens: Sequence[int], seq_lens: Sequence[int],
                          last_loc: Sequence[int], extend_num_tokens: int, swa_tail_len: int, *,
                          owners: Sequence[Owner] | None = None) -> tuple[LocCacheSystem, tuple[int, ...]]:
    """The tail allocation allocates its SWA side fresh: it translates nothing."""
    system = _at(system, InvalidationPoint.ALLOC_EXTEND_SWA_TAIL)
    state, slots = sa.alloc_extend_swa_tail(system.allocator, prefix_lens, seq_lens, last_loc, extend_num_tokens,
                                            swa_tail_len, owners=owners)
    return _with_allocator(system, state), slots


def free(system: LocCacheSystem, free_index: Sequence[int]) -> LocCacheSystem:
    """``free`` reaches ``free_swa``'s invalidation point."""
    system = _at(system, InvalidationPoint.FREE_SWA)
    return _with_allocator(system, sa.free(system.allocator, free_index))


def free_swa(system: LocCacheSystem, free_index: Sequence[int]) -> LocCacheSystem:
    system = _at(system, InvalidationPoint.FREE_SWA)
    return _with_allocator(system, sa.free_swa(system.allocator, free_index))


def free_full(system: LocCacheSystem, free_index: Sequence[int]) -> LocCacheSystem:
    """No invalidation point: ``free_full`` never writes the mapping (proved unnecessary)."""
    return _with_allocator(system, sa.free_full(system.allocator, free_index))


def set_full_to_swa_mapping(system: LocCacheSystem, full_indices: Sequence[int],
                            swa_indices: Sequence[int]) -> LocCacheSystem:
    """Upstream invalidates after its empty / length checks: an empty call changes nothing."""
    if full_indices or swa_indices:
        system = _at(system, InvalidationPoint.SET_FULL_TO_SWA_MAPPING)
    return _with_allocator(system, sa.set_full_to_swa_mapping(system.allocator, full_indices, swa_indices))


def clear(system: LocCacheSystem) -> LocCacheSystem:
    system = _at(system, InvalidationPoint.CLEAR)
    return _with_allocator(system, sa.clear(system.allocator))


def backup_state(system: LocCacheSystem) -> sa.AllocatorBackup:
    return sa.backup_state(system.allocator)


def restore_state(system: LocCacheSystem, backup: sa.AllocatorBackup) -> LocCacheSystem:
    """No invalidation point: ``restore_state`` rolls back free lists, never the mapping (proved unnecessary)."""
    return _with_allocator(system, sa.restore_state(system.allocator, backup))


def register_mapping(system: LocCacheSystem) -> LocCacheSystem:
    """A new allocator over the same KV pool registers its fresh mapping (every page free, M all 0).

    The KV rows stay in the pool; no slot is live any more, so none is observable.
    """
    system = _at(system, InvalidationPoint.REGISTER_MAPPING)
    fresh = sa.clear(system.allocator)
    return _with_allocator(system, fresh)
