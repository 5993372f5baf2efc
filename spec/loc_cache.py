"""``loc_cache``: the full->SWA loc translation cache (#25824, #26152; sglang_semantics.md §3, §7 C1-C4, §9 S5 S6).

One :class:`~kvproof.spec._ts.TransitionSystem` (:data:`SYSTEM`, or :func:`system`
for a broken :class:`Variant`) mirroring ``kvproof.reference.loc_cache``, with a
transition named like **every** reference operation (:data:`OPS`), over a bounded
instance (small concrete sizes, symbolic contents):

* full slots ``0..5``; slots 0 and 1 are page 0 of the witnesses' page size 2, never
  handed out, ``M = 0`` there (M1); ``M[-1] = -1`` (the sentinel). Pool 0's mapping
  ``M`` and ghost liveness per slot; pool 1 (a second SWA pool, e.g. a draft model's)
  has its own mapping ``M2``, which nothing writes (as in the reference);
* index memory: three int64 elements at byte addresses 1024, 1032, 1040 (element
  address ``a`` is byte ``1024 + 8a``), each with contents (a full slot id or -1),
  liveness, the base address of the storage it belongs to, and a ghost "was ever
  allocated" flag. A *view* is ``(address, numel)`` with ``numel <= 2`` inside one
  live storage;
* one single-entry cache per pool (``valid``, key address, key numel, value per
  element; ghost: the view address and pool that filled it), or one cache for both
  pools (the broken ``shared_across_pools`` policy);
* the phase of the environment contract E1 per pool: *quiet* (index memory not
  rewritten since that pool's last forward) or *batch preparation*;
* the captured graph: ``captured``, ``recorded_gather``, its static buffer view and
  the constant used when no gather was recorded;
* what the caller holds: the latest ``backup_state()`` (the live slots then).

Transitions (the reference functions; every translation is a *read*, stale when it
differs from ``M[contents]`` at that moment, the reference's ghost log
``stale_reads``):

* ``new_storage`` / ``free_storage`` / ``write_index`` (a new storage over an address
  that was ever allocated, or an in-place write, starts batch preparation of both
  pools), ``make_view`` (no state: constrains its view to live elements of one
  storage);
* ``translate_loc_from_full_to_swa`` (the scheduler; quiet phase of its pool only,
  E1), ``invalidate_loc_cache`` (drops its pool's cache);
* ``forward`` (point ``forward``, translate ``loc``, end batch preparation; ``loc``
  holds live slots or padding 0, ``set_kv_buffer``'s check; pool 1's forward is its
  own model runner's ``_forward_raw``), ``capture`` (three ``run_once``: point
  ``run_once`` then translate, on a padding buffer), ``replay`` (point ``forward``,
  then the recorded gather or the constant);
* the mutators of ``M``, each preceded by its point: ``alloc``, ``alloc_extend``,
  ``alloc_decode``, ``alloc_extend_swa_tail`` (some free slots become live with new
  ``M`` values; ``alloc_extend`` / ``alloc_decode`` first translate a ``last_loc`` view
  of live slots or -1 right after their point, C4), ``free_swa`` (some slots get 0),
  ``free`` (some slots get 0 and are freed), ``set_full_to_swa_mapping`` (some live
  slots get new values; an empty call changes nothing, no point), ``clear`` /
  ``register_mapping`` (everything free, ``M`` all 0);
* no point: ``free_full`` (liveness only), ``backup_state`` (the caller now holds the
  live slots), ``restore_state`` (liveness back to the held backup, ``M`` kept).

The builder is parametrised by a :class:`Variant`: a :class:`Policy` (points present,
key scheme, shared cache) plus the environment (E1) and the deliberately broken parts
of the twins. The step over several ops shares one frame of ``If`` chains
(``combine``), which agrees with the per-op relations (``tests/spec/test_loc_cache.py``).

E1 per pool: the reference's ``forward`` invalidates pool 0's cache only and nothing
ever invalidates pool 1's, so under E1 as the reference states it a pool-1
translation after address reuse and a pool-0 forward is stale even upstream. The
model reads E1 per pool (a pool is quiet once *its own* forward followed the last
rewrite) and gives pool 1 its forward; for pool 0 this is exactly the reference's E1.

Obligations (all for this bounded instance), ``loc_cache.<op>.<claim>`` after the
operation they are about, ``loc_cache.no_stale_read.<claim>`` for the whole-state
invariant:

* ``no_stale_read.{initiation,consecution,safety}``: under the upstream policy (every
  point, ``data_ptr`` key, one cache per pool) and E1 no translation is ever stale, by
  the inductive invariant "a valid cache entry of a quiet pool equals that pool's
  ``M`` over the current contents at its key" (C1) plus "a captured graph recorded its
  gather" (C3) and well-formedness (value ranges, storage shape); twins: a cache that
  survives into the initial state, and ``no_stale_read.without_<point>`` for each of
  the ten points (a BMC trace of at most 8 steps from the initial state to a stale
  read once that point is removed);
* the findings, each under the op it is about (BMC twins of ``no_stale_read.safety``):
  ``translate_loc_from_full_to_swa.{e1_needed, s5_storage_base_key,
  cache_shared_across_pools}``, ``replay.{s6_capture_without_run_once,
  forward_point_eager_only}``;
* per op, each with a broken twin: ``<op>.keeps_invariant`` (the op preserves C1 + C3;
  twins: the op without its point, or a rewrite E1 does not see), ``free_full`` /
  ``restore_state.needs_no_point`` (preserved without a point), ``alloc_extend`` /
  ``alloc_decode.reads_fresh`` (their own ``last_loc`` translation is fresh even in
  batch preparation) and ``.c4_refill_fresh`` (the entry they refill is fresh after
  their ``M`` write), ``make_view.translatable``, ``invalidate_loc_cache.next_read_fresh``,
  ``backup_state.round_trip``.

The BMC twins search a narrower set of runs of the same relation (:class:`Search`):
the ops of the reference witness plus the setup ops, pool 0 only (except the shared
cache), allocations mapped 1:1, one-element storages and views, no -1 in forwarded
or translated views. Any run found is a run of the full model; the narrowing keeps
traces close to ``tests/reference/test_loc_cache.py`` and the queries fast.

Modelling notes: memory is address-based, so a graph or cache entry refers to
whatever storage now lives at its address (closer to raw CUDA pointers than the
reference's storage ids, and a superset of its behaviours); stored contents are
always in ``[-1, 6)``; new ``M`` values are in ``[0, 16)``; ``free`` / ``free_swa``
may zero any slots (the reference zeroes whole pages, live slots or not);
``restore_state`` accepts any held backup (the reference also needs no release since
it); ``capture`` runs two warm-ups (the reference's default). The drift tests
(``tests/spec/test_loc_cache.py``: the reference witnesses;
``tests/spec/test_drift_loc_cache.py``: seeded runs) check that every transition
accepts the steps the reference takes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

import z3

from kvproof.spec import _ts
from kvproof.spec._solver import Obligation, as_bool, as_int
from kvproof.spec._ts import Check, Clause, Search, Step, Target, TransitionSystem

__all__ = [
    "ADDRS",
    "BASE_BYTES",
    "COMPONENT",
    "ELEMENT_BYTES",
    "FAMILY",
    "MAX_DEPTH",
    "M_BOUND",
    "NF",
    "OBLIGATIONS",
    "OPS",
    "POINT_OF",
    "POINT_OPS",
    "READ_OPS",
    "REAL_SLOTS",
    "RESERVED",
    "RUNS",
    "SETUP",
    "SYSTEM",
    "SYSTEMS",
    "UPSTREAM",
    "Action",
    "Cache",
    "Effect",
    "Graph",
    "K",
    "KeyScheme",
    "Point",
    "Policy",
    "Read",
    "State",
    "Variant",
    "byte_address",
    "effect",
    "entry_fresh",
    "find_trace",
    "fresh_reads",
    "init",
    "invariant_clauses",
    "replay_stale",
    "stale",
    "stale_read",
    "system",
    "view_contents",
    "wellformed_clauses",
    "witness",
    "witness_search",
]

COMPONENT = "loc_cache"
FAMILY = "loc_cache"

NF = 6  # full slots 0..5
RESERVED = (0, 1)  # page 0 (page size 2): never handed out, M = 0
REAL_SLOTS = tuple(x for x in range(NF) if x not in RESERVED)
ADDRS = range(3)  # index-memory elements
K = 2  # the longest view
RUNS = 3  # capture: two warm-ups, then the capture run (the reference's warmups=2)
M_BOUND = 16  # new M values lie in [0, M_BOUND)
ELEMENT_BYTES = 8
BASE_BYTES = 1024
MAX_DEPTH = 8


def byte_address(a: int) -> int:
    """The byte address of index-memory element ``a``."""
    return BASE_BYTES + ELEMENT_BYTES * a


# ---- policy ------------------------------------------------------------------------------------


class Point(StrEnum):
    """Where upstream calls ``invalidate_loc_cache()`` (§3.3; same values as the reference)."""

    ALLOC = "alloc"
    ALLOC_EXTEND = "alloc_extend"
    ALLOC_EXTEND_SWA_TAIL = "alloc_extend_swa_tail"
    ALLOC_DECODE = "alloc_decode"
    FREE_SWA = "free_swa"
    SET_FULL_TO_SWA_MAPPING = "set_full_to_swa_mapping"
    CLEAR = "clear"
    REGISTER_MAPPING = "register_mapping"
    FORWARD = "forward"
    RUN_ONCE = "run_once"


class KeyScheme(StrEnum):
    DATA_PTR = "data_ptr"  # (x.data_ptr(), numel): the view's own address (#25824 as merged)
    STORAGE_BASE = "storage_base"  # (x.untyped_storage().data_ptr(), numel): intermediate revision (S5)


@dataclass(frozen=True)
class Policy:
    """The cache design (the reference's ``LocCachePolicy``)."""

    points: frozenset[Point] = frozenset(Point)
    key_scheme: KeyScheme = KeyScheme.DATA_PTR
    shared_across_pools: bool = False

    def without(self, point: Point) -> Policy:
        return dataclasses.replace(self, points=self.points - {point})


@dataclass(frozen=True)
class Variant:
    """A policy plus the environment (E1) and the deliberately broken parts of a twin (all sound by default)."""

    policy: Policy = Policy()
    e1: bool = True  # the scheduler translates only in its pool's quiet phase
    in_place_writes: bool = True  # write_index is available (off: rewrites are address reuse only)
    reuse_rewrites: bool = True  # E1 counts a new storage over a freed address as a rewrite
    write_rewrites: bool = True  # E1 counts an in-place write as a rewrite
    free_scrubs: bool = False  # twin: free_storage overwrites its elements (-1), a rewrite E1 does not see
    view_checks_live: bool = True  # make_view needs a live storage (off: a view of freed memory)
    invalidate_ignores_pool: bool = False  # twin: invalidate_loc_cache drops pool 0's cache whatever its pool
    c4_disjoint: bool = True  # the slots alloc_extend / alloc_decode write are free (so not in last_loc)
    free_full_writes_mapping: bool = False  # twin: free_full also zeroes M, without a point
    restore_writes_mapping: bool = False  # twin: restore_state also rolls M back, without a point
    replay_invalidates: bool = True  # off: #25824 as merged, the forward point only on the eager path (#26152)


UPSTREAM = Variant()

#: The transitions, named like the reference functions of kvproof.reference.loc_cache, in its order.
OPS = (
    "new_storage", "free_storage", "write_index", "make_view", "invalidate_loc_cache",
    "translate_loc_from_full_to_swa", "forward", "capture", "replay", "alloc", "alloc_extend", "alloc_decode",
    "alloc_extend_swa_tail", "free", "free_swa", "free_full", "set_full_to_swa_mapping", "clear", "backup_state",
    "restore_state", "register_mapping",
)

#: The invalidation point an op passes (replay: forward; capture: run_once, once per run; free: free_swa's).
POINT_OF: Mapping[str, Point] = {
    "forward": Point.FORWARD,
    "replay": Point.FORWARD,
    "capture": Point.RUN_ONCE,
    "alloc": Point.ALLOC,
    "alloc_extend": Point.ALLOC_EXTEND,
    "alloc_decode": Point.ALLOC_DECODE,
    "alloc_extend_swa_tail": Point.ALLOC_EXTEND_SWA_TAIL,
    "free_swa": Point.FREE_SWA,
    "free": Point.FREE_SWA,
    "set_full_to_swa_mapping": Point.SET_FULL_TO_SWA_MAPPING,
    "clear": Point.CLEAR,
    "register_mapping": Point.REGISTER_MAPPING,
}

#: The ops that translate (their reads may be stale).
READ_OPS = ("translate_loc_from_full_to_swa", "forward", "capture", "replay", "alloc_extend", "alloc_decode")
ALLOCATIONS = ("alloc", "alloc_extend", "alloc_decode", "alloc_extend_swa_tail")
VIEW_OPS = ("translate_loc_from_full_to_swa", "forward", "capture", "alloc_extend", "alloc_decode", "make_view")


# ---- state and action ---------------------------------------------------------------------


@dataclass(frozen=True)
class Cache:
    """``(_cached_loc_key, _cached_swa_loc)`` of one pool; ``src`` and ``pool`` are ghost."""

    valid: z3.BoolRef
    addr: z3.ArithRef  # key address (element index): data_ptr, or the storage base
    numel: z3.ArithRef
    value: tuple[z3.ArithRef, ...]  # K entries, 0 beyond numel
    src: z3.ArithRef  # ghost: data_ptr of the view whose translation filled it
    pool: z3.ArithRef  # ghost: whose mapping produced it

    @staticmethod
    def fresh(tag: str) -> Cache:
        return Cache(z3.Bool(f"valid{tag}"), z3.Int(f"key_addr{tag}"), z3.Int(f"key_numel{tag}"),
                     tuple(z3.Int(f"value{i}{tag}") for i in range(K)), z3.Int(f"src{tag}"), z3.Int(f"filled_by{tag}"))

    def dropped(self) -> Cache:
        return dataclasses.replace(self, valid=z3.BoolVal(False))

    def ite(self, cond: z3.BoolRef, other: Cache) -> Cache:
        """Field-wise ``If(cond, self, other)``."""
        return Cache(z3.If(cond, self.valid, other.valid), z3.If(cond, self.addr, other.addr),
                     z3.If(cond, self.numel, other.numel),
                     tuple(z3.If(cond, x, y) for x, y in zip(self.value, other.value, strict=True)),
                     z3.If(cond, self.src, other.src), z3.If(cond, self.pool, other.pool))


@dataclass(frozen=True)
class Graph:
    """The captured graph of ``run_once`` on a static buffer view."""

    captured: z3.BoolRef
    recorded: z3.BoolRef  # recorded_gather
    addr: z3.ArithRef
    numel: z3.ArithRef
    constant: tuple[z3.ArithRef, ...]

    @staticmethod
    def fresh(tag: str) -> Graph:
        return Graph(z3.Bool(f"captured{tag}"), z3.Bool(f"recorded_gather{tag}"), z3.Int(f"graph_addr{tag}"),
                     z3.Int(f"graph_numel{tag}"), tuple(z3.Int(f"constant{i}{tag}") for i in range(K)))


def _slots(name: str, make: Callable[[str], z3.ExprRef], reserved: z3.ExprRef, tag: str) -> tuple[z3.ExprRef, ...]:
    return tuple(reserved if x in RESERVED else make(f"{name}{x}@{tag}") for x in range(NF))


@dataclass(frozen=True)
class State:
    """One copy of the system as Z3 terms; reserved slots are constants."""

    M: tuple[z3.ArithRef, ...]  # pool 0's mapping over full slots 0..NF-1
    live: tuple[z3.BoolRef, ...]  # ghost: the full slot is handed out
    M2: tuple[z3.ArithRef, ...]  # pool 1's mapping (never written)
    cont: tuple[z3.ArithRef, ...]  # index memory contents per element
    alive: tuple[z3.BoolRef, ...]  # the element belongs to a live storage
    base: tuple[z3.ArithRef, ...]  # the element address of its storage's first element
    used: tuple[z3.BoolRef, ...]  # ghost: some storage ever covered the element
    caches: tuple[Cache, Cache]  # pool 0's, pool 1's (shared policy: index 0 for both)
    quiet: tuple[z3.BoolRef, z3.BoolRef]  # E1 phase per pool
    graph: Graph
    bk_held: z3.BoolRef  # the caller holds a backup_state()
    bk_live: tuple[z3.BoolRef, ...]  # ... of these live slots

    @staticmethod
    def fresh(tag: str) -> State:
        t = f"@{tag}"
        return State(
            M=_slots("M", z3.Int, z3.IntVal(0), tag),
            live=_slots("live", z3.Bool, z3.BoolVal(False), tag),
            M2=_slots("M2_", z3.Int, z3.IntVal(0), tag),
            cont=tuple(z3.Int(f"cont{a}{t}") for a in ADDRS),
            alive=tuple(z3.Bool(f"alive{a}{t}") for a in ADDRS),
            base=tuple(z3.Int(f"base{a}{t}") for a in ADDRS),
            used=tuple(z3.Bool(f"used{a}{t}") for a in ADDRS),
            caches=(Cache.fresh(f"_p0{t}"), Cache.fresh(f"_p1{t}")),
            quiet=(z3.Bool(f"quiet_p0{t}"), z3.Bool(f"quiet_p1{t}")),
            graph=Graph.fresh(t),
            bk_held=z3.Bool(f"bk_held{t}"),
            bk_live=_slots("bk_live", z3.Bool, z3.BoolVal(False), tag),
        )


@dataclass(frozen=True)
class Action:
    """The arguments of one step (those its op does not use are unconstrained)."""

    pool: z3.ArithRef  # translate / forward / invalidate_loc_cache
    addr: z3.ArithRef  # a view's data_ptr, a storage base, a written element
    numel: z3.ArithRef  # a view's or a new storage's length
    data: tuple[z3.ArithRef, ...]  # new storage contents (per element), write_index's value (data[0])
    pick: tuple[z3.BoolRef, ...]  # the full slots a mutator touches (reserved: never)
    value: tuple[z3.ArithRef, ...]  # the new M value per picked slot

    @staticmethod
    def fresh(tag: str) -> Action:
        t = f"@{tag}"
        return Action(
            z3.Int(f"pool{t}"), z3.Int(f"addr{t}"), z3.Int(f"numel{t}"),
            tuple(z3.Int(f"data{a}{t}") for a in ADDRS),
            _slots("pick", z3.Bool, z3.BoolVal(False), tag),
            _slots("new_M", z3.Int, z3.IntVal(0), tag),
        )


@dataclass(frozen=True)
class Read:
    """One translation: what it returned and ``M[contents]`` at that moment."""

    label: str
    pool: z3.ArithRef | int
    addr: z3.ArithRef
    numel: z3.ArithRef
    contents: tuple[z3.ArithRef, ...]
    returned: tuple[z3.ArithRef, ...]
    fresh: tuple[z3.ArithRef, ...]
    hit: z3.BoolRef

    @property
    def stale(self) -> z3.BoolRef:
        return z3.Or([z3.And(i < self.numel, self.returned[i] != self.fresh[i]) for i in range(K)])


@dataclass(frozen=True)
class Effect:
    """An op's enabling condition, its post-state (as terms over the pre-state) and its reads."""

    guard: z3.BoolRef
    post: State
    reads: tuple[Read, ...] = ()


# ---- term helpers ---------------------------------------------------------------------------


def _sel(xs: Sequence[z3.ExprRef], i: z3.ArithRef, default: z3.ExprRef) -> z3.ExprRef:
    """``xs[i]`` for a symbolic index, ``default`` out of range."""
    out = default
    for k in reversed(range(len(xs))):
        out = z3.If(i == k, xs[k], out)
    return out


def _and(*xs: z3.BoolRef) -> z3.BoolRef:
    """Conjunction that folds literal ``False`` (an invalidated cache never hits)."""
    if any(z3.is_false(x) for x in xs):
        return z3.BoolVal(False)
    return z3.And(*xs)


def _translate_slot(mapping: Sequence[z3.ArithRef], f: z3.ArithRef) -> z3.ArithRef:
    """``M[f]``; -1 maps to -1 through the sentinel."""
    return z3.If(f == -1, -1, _sel(mapping, f, z3.IntVal(0)))


def _mapping_of(s: State, pool: z3.ArithRef | int, f: z3.ArithRef) -> z3.ArithRef:
    if isinstance(pool, int):
        return _translate_slot(s.M if pool == 0 else s.M2, f)
    return z3.If(pool == 0, _translate_slot(s.M, f), _translate_slot(s.M2, f))


def view_contents(s: State, addr: z3.ArithRef, numel: z3.ArithRef) -> tuple[z3.ArithRef, ...]:
    """The view's elements, 0 beyond ``numel``."""
    return tuple(z3.If(i < numel, _sel(s.cont, addr + i, z3.IntVal(0)), 0) for i in range(K))


def in_slot_range(f: z3.ArithRef) -> z3.BoolRef:
    """-1 (no prefix) or a full slot id (the reference's translate check)."""
    return z3.And(f >= -1, f < NF)


def _position(addr: z3.ArithRef, numel: z3.ArithRef) -> z3.BoolRef:
    """``numel`` elements from ``addr`` lie inside index memory, ``1 <= numel <= K``."""
    return z3.And(numel >= 1, numel <= K, addr >= 0, addr + numel <= len(ADDRS))


def view_ok(s: State, addr: z3.ArithRef, numel: z3.ArithRef) -> z3.BoolRef:
    """``numel`` live elements from ``addr``, all in one storage."""
    first = _sel(s.base, addr, z3.IntVal(-1))
    inside = [z3.Implies(i < numel, z3.And(_sel(s.alive, addr + i, z3.BoolVal(False)),
                                           _sel(s.base, addr + i, z3.IntVal(-1)) == first)) for i in range(K)]
    return z3.And(_position(addr, numel), *inside)


def fresh_of(s: State, pool: z3.ArithRef | int, contents: Sequence[z3.ArithRef]) -> tuple[z3.ArithRef, ...]:
    return tuple(_mapping_of(s, pool, c) for c in contents)


def cache_key(s: State, addr: z3.ArithRef, scheme: KeyScheme) -> z3.ArithRef:
    return addr if scheme is KeyScheme.DATA_PTR else _sel(s.base, addr, z3.IntVal(-1))


def _slot(policy: Policy, pool: z3.ArithRef | int) -> z3.ArithRef | int:
    return 0 if policy.shared_across_pools else pool


def _get(caches: tuple[Cache, Cache], slot: z3.ArithRef | int) -> Cache:
    if isinstance(slot, int):
        return caches[slot]
    return caches[0].ite(slot == 0, caches[1])


def _put(caches: tuple[Cache, Cache], slot: z3.ArithRef | int, cache: Cache) -> tuple[Cache, Cache]:
    if isinstance(slot, int):
        return (cache, caches[1]) if slot == 0 else (caches[0], cache)
    return (cache.ite(slot == 0, caches[0]), cache.ite(slot == 1, caches[1]))


def _drop(v: Variant, caches: tuple[Cache, Cache], pool: z3.ArithRef | int) -> tuple[Cache, Cache]:
    """``invalidate_loc_cache(pool)``: drop ``pool``'s cache (the shared one, if pools share it)."""
    slot = _slot(v.policy, pool)
    return _put(caches, slot, _get(caches, slot).dropped())


def _invalidate(v: Variant, caches: tuple[Cache, Cache], point: Point, pool: z3.ArithRef | int = 0
                ) -> tuple[Cache, Cache]:
    """``_at(point)``: drop ``pool``'s cache if the policy has that point."""
    return _drop(v, caches, pool) if point in v.policy.points else caches


def _translate(v: Variant, s: State, caches: tuple[Cache, Cache], label: str, pool: z3.ArithRef | int,
               addr: z3.ArithRef, numel: z3.ArithRef) -> tuple[tuple[Cache, Cache], Read]:
    """``translate_loc_from_full_to_swa`` through ``caches``: a hit returns the entry, a miss gathers and caches."""
    slot = _slot(v.policy, pool)
    cache = _get(caches, slot)
    key = cache_key(s, addr, v.policy.key_scheme)
    hit = _and(cache.valid, cache.addr == key, cache.numel == numel)
    contents = view_contents(s, addr, numel)
    fresh = fresh_of(s, pool, contents)
    returned: tuple[z3.ArithRef, ...]
    owner: z3.ArithRef
    if z3.is_false(hit):
        returned, src, owner = fresh, addr, z3.IntVal(pool) if isinstance(pool, int) else pool
    else:
        returned = tuple(z3.If(hit, c, f) for c, f in zip(cache.value, fresh, strict=True))
        src, owner = z3.If(hit, cache.src, addr), z3.If(hit, cache.pool, pool)
    filled = Cache(z3.BoolVal(True), key, numel, returned, src, owner)
    read = Read(label, pool, addr, numel, contents, returned, fresh, hit)
    return _put(caches, slot, filled), read


_BATCH_PREP = (z3.BoolVal(False), z3.BoolVal(False))  # index memory rewritten: both pools prepare a batch


def _quiet_after_forward(s: State, pool: z3.ArithRef | int) -> tuple[z3.BoolRef, z3.BoolRef]:
    if isinstance(pool, int):
        return (z3.BoolVal(True), s.quiet[1]) if pool == 0 else (s.quiet[0], z3.BoolVal(True))
    return (z3.Or(s.quiet[0], pool == 0), z3.Or(s.quiet[1], pool == 1))


def _new_values(a: Action) -> list[z3.BoolRef]:
    return [z3.Implies(a.pick[x], z3.And(a.value[x] >= 0, a.value[x] < M_BOUND)) for x in REAL_SLOTS]


def _one_of_pools(a: Action) -> z3.BoolRef:
    return z3.Or(a.pool == 0, a.pool == 1)


# ---- effects: one per reference op ----------------------------------------------------------


def _new_storage(v: Variant, s: State, a: Action) -> Effect:
    """``numel`` elements at a free address ``addr`` (contents in ``[-1, 6)``); over an address that was ever
    allocated (reuse) both pools enter batch preparation."""
    inside = [z3.And(a.addr <= x, x < a.addr + a.numel) for x in ADDRS]
    reuse = z3.Or([z3.And(inside[x], s.used[x]) for x in ADDRS])
    guard = z3.And(a.numel >= 1, a.addr >= 0, a.addr + a.numel <= len(ADDRS),
                   *[z3.Implies(inside[x], z3.Not(s.alive[x])) for x in ADDRS],
                   *[z3.Implies(x < a.numel, in_slot_range(a.data[x])) for x in ADDRS])
    quiet = (z3.And(s.quiet[0], z3.Not(reuse)), z3.And(s.quiet[1], z3.Not(reuse))) if v.reuse_rewrites else s.quiet
    post = dataclasses.replace(
        s,
        cont=tuple(z3.If(inside[x], _sel(a.data, x - a.addr, z3.IntVal(0)), s.cont[x]) for x in ADDRS),
        alive=tuple(z3.Or(s.alive[x], inside[x]) for x in ADDRS),
        base=tuple(z3.If(inside[x], a.addr, s.base[x]) for x in ADDRS),
        used=tuple(z3.Or(s.used[x], inside[x]) for x in ADDRS),
        quiet=quiet,
    )
    return Effect(guard, post)


def _free_storage(v: Variant, s: State, a: Action) -> Effect:
    """The live storage at base ``addr`` is freed; its elements keep their contents (the twin scrubs them)."""
    guard = z3.And(_sel(s.alive, a.addr, z3.BoolVal(False)), _sel(s.base, a.addr, z3.IntVal(-1)) == a.addr)
    mine = [z3.And(s.alive[x], s.base[x] == a.addr) for x in ADDRS]
    post = dataclasses.replace(s, alive=tuple(z3.And(s.alive[x], z3.Not(mine[x])) for x in ADDRS))
    if v.free_scrubs:
        post = dataclasses.replace(post, cont=tuple(z3.If(mine[x], -1, s.cont[x]) for x in ADDRS))
    return Effect(guard, post)


def _write_index(v: Variant, s: State, a: Action) -> Effect:
    """One live element ``addr`` := ``data[0]`` in place; both pools enter batch preparation."""
    guard = z3.And(z3.BoolVal(v.in_place_writes), _sel(s.alive, a.addr, z3.BoolVal(False)), in_slot_range(a.data[0]))
    cont = tuple(z3.If(a.addr == x, a.data[0], s.cont[x]) for x in ADDRS)
    return Effect(guard, dataclasses.replace(s, cont=cont, quiet=_BATCH_PREP if v.write_rewrites else s.quiet))


def _make_view(v: Variant, s: State, a: Action) -> Effect:
    """No state: the view ``(addr, numel)`` lies in one live storage (the twin: anywhere in index memory)."""
    return Effect(view_ok(s, a.addr, a.numel) if v.view_checks_live else _position(a.addr, a.numel), s)


def _invalidate_loc_cache(v: Variant, s: State, a: Action) -> Effect:
    """Drop pool ``pool``'s cache (the shared one under the shared policy; the twin: always pool 0's)."""
    pool = 0 if v.invalidate_ignores_pool else a.pool
    return Effect(_one_of_pools(a), dataclasses.replace(s, caches=_drop(v, s.caches, pool)))


def _translate_loc_from_full_to_swa(v: Variant, s: State, a: Action) -> Effect:
    """The scheduler's translation of a view through its pool's cache, in that pool's quiet phase (E1)."""
    e1 = [z3.If(a.pool == 0, s.quiet[0], s.quiet[1])] if v.e1 else []
    caches, read = _translate(v, s, s.caches, "translate", a.pool, a.addr, a.numel)
    guard = z3.And(_one_of_pools(a), view_ok(s, a.addr, a.numel), *e1, *[in_slot_range(c) for c in read.contents])
    return Effect(guard, dataclasses.replace(s, caches=caches), (read,))


def _writable(s: State, contents: Sequence[z3.ArithRef], numel: z3.ArithRef) -> list[z3.BoolRef]:
    """``set_kv_buffer``'s check: live slots, or 0 for padding tokens, no slot twice."""
    live = [z3.Or(c == 0, _sel(s.live, c, z3.BoolVal(False))) for c in contents]
    distinct = [z3.Implies(z3.And(j < numel, contents[i] != 0), contents[i] != contents[j])
                for i in range(K) for j in range(i + 1, K)]
    return [*live, *distinct]


def _forward(v: Variant, s: State, a: Action) -> Effect:
    """Point ``forward``, translate ``loc``, end the pool's batch preparation. Pool 0's loc holds live slots or
    padding; pool 1's allocator is not modelled (any slot)."""
    caches = _invalidate(v, s.caches, Point.FORWARD, a.pool)
    caches, read = _translate(v, s, caches, "forward", a.pool, a.addr, a.numel)
    guard = z3.And(_one_of_pools(a), view_ok(s, a.addr, a.numel), *[in_slot_range(c) for c in read.contents],
                   z3.Implies(a.pool == 0, z3.And(_writable(s, read.contents, a.numel))))
    return Effect(guard, dataclasses.replace(s, caches=caches, quiet=_quiet_after_forward(s, a.pool)), (read,))


def _capture(v: Variant, s: State, a: Action) -> Effect:
    """Three ``run_once`` on a padding buffer: point ``run_once``, then translate; the capture run's miss records
    the gather, its hit the constant (S6)."""
    caches, reads = s.caches, []
    for r in range(RUNS):
        caches = _invalidate(v, caches, Point.RUN_ONCE)
        caches, read = _translate(v, s, caches, "warm-up" if r < RUNS - 1 else "capture run", 0, a.addr, a.numel)
        reads.append(read)
    last = reads[-1]
    graph = Graph(z3.BoolVal(True), z3.Not(last.hit), a.addr, a.numel, last.returned)
    padding = [c == 0 for c in last.contents]  # the static buffer holds padding (slot 0) while capturing
    guard = z3.And(view_ok(s, a.addr, a.numel), *padding)
    return Effect(guard, dataclasses.replace(s, caches=caches, graph=graph), tuple(reads))


def _replay(v: Variant, s: State, a: Action) -> Effect:
    """Point ``forward`` (the twin: none, #25824 as merged), then the recorded gather or the constant; ends pool 0's
    batch preparation."""
    g = s.graph
    caches = _invalidate(v, s.caches, Point.FORWARD) if v.replay_invalidates else s.caches
    contents = view_contents(s, g.addr, g.numel)
    fresh = fresh_of(s, 0, contents)
    returned = tuple(z3.If(g.recorded, f, c) for f, c in zip(fresh, g.constant, strict=True))
    read = Read("replay", 0, g.addr, g.numel, contents, returned, fresh, z3.Not(g.recorded))
    guard = z3.And(g.captured, view_ok(s, g.addr, g.numel), *_writable(s, contents, g.numel))
    quiet = (z3.BoolVal(True), s.quiet[1])
    return Effect(guard, dataclasses.replace(s, caches=caches, quiet=quiet), (read,))


def _hand_out(s: State, a: Action, caches: tuple[Cache, Cache], free_only: bool = True) -> tuple[z3.BoolRef, State]:
    """Some free slots become live with new M values."""
    guard = z3.And(*[z3.Implies(a.pick[x], z3.Not(s.live[x])) for x in REAL_SLOTS if free_only], *_new_values(a))
    post = dataclasses.replace(
        s, caches=caches,
        M=tuple(s.M[x] if x in RESERVED else z3.If(a.pick[x], a.value[x], s.M[x]) for x in range(NF)),
        live=tuple(s.live[x] if x in RESERVED else z3.Or(s.live[x], a.pick[x]) for x in range(NF)),
    )
    return guard, post


def _allocation(point: Point) -> Callable[[Variant, State, Action], Effect]:
    def effect(v: Variant, s: State, a: Action) -> Effect:
        guard, post = _hand_out(s, a, _invalidate(v, s.caches, point))
        return Effect(guard, post)

    effect.__doc__ = f"Point ``{point.value}``, then some free slots become live with new M values."
    return effect


def _allocation_from_last_loc(point: Point, label: str) -> Callable[[Variant, State, Action], Effect]:
    """``alloc_extend`` / ``alloc_decode``: point, translate ``last_loc`` (C4), then the M write."""

    def effect(v: Variant, s: State, a: Action) -> Effect:
        caches, read = _translate(v, s, _invalidate(v, s.caches, point), label, 0, a.addr, a.numel)
        last = [z3.Implies(i < a.numel, z3.Or(c == -1, _sel(s.live, c, z3.BoolVal(False))))
                for i, c in enumerate(read.contents)]
        guard, post = _hand_out(s, a, caches, free_only=v.c4_disjoint)
        return Effect(z3.And(view_ok(s, a.addr, a.numel), *last, guard), post, (read,))

    effect.__doc__ = (f"Point ``{point.value}``, translate the ``last_loc`` view (live slots or -1), then some free "
                      "slots become live with new M values (C4: not in ``last_loc``).")
    return effect


def _zero(s: State, a: Action) -> tuple[z3.ArithRef, ...]:
    return tuple(s.M[x] if x in RESERVED else z3.If(a.pick[x], 0, s.M[x]) for x in range(NF))


def _release(s: State, a: Action) -> tuple[z3.BoolRef, ...]:
    return tuple(s.live[x] if x in RESERVED else z3.And(s.live[x], z3.Not(a.pick[x])) for x in range(NF))


def _picks_live(s: State, a: Action) -> list[z3.BoolRef]:
    return [z3.Implies(a.pick[x], s.live[x]) for x in REAL_SLOTS]


def _free_swa(v: Variant, s: State, a: Action) -> Effect:
    """Point ``free_swa``; some slots get M = 0 (whole pages in the reference, live or not); liveness unchanged."""
    caches = _invalidate(v, s.caches, Point.FREE_SWA)
    return Effect(z3.BoolVal(True), dataclasses.replace(s, caches=caches, M=_zero(s, a)))


def _free(v: Variant, s: State, a: Action) -> Effect:
    """``free_swa``'s point, then some slots get M = 0 and are freed: the reference zeroes every slot of the pages it
    touches, live or not (a slot ``restore_state`` left dead keeps its M until then, R3)."""
    caches = _invalidate(v, s.caches, Point.FREE_SWA)
    return Effect(z3.BoolVal(True), dataclasses.replace(s, caches=caches, M=_zero(s, a), live=_release(s, a)))


def _free_full(v: Variant, s: State, a: Action) -> Effect:
    """No point: frees live slots whose SWA side is released (M = 0); the twin also zeroes M."""
    if v.free_full_writes_mapping:
        return Effect(z3.And(*_picks_live(s, a)), dataclasses.replace(s, M=_zero(s, a), live=_release(s, a)))
    guard = z3.And(*[z3.Implies(a.pick[x], z3.And(s.live[x], s.M[x] == 0)) for x in REAL_SLOTS])
    return Effect(guard, dataclasses.replace(s, live=_release(s, a)))


def _set_full_to_swa_mapping(v: Variant, s: State, a: Action) -> Effect:
    """After the point, some live slots get new values; an empty call (no slot) returns before the point and changes
    nothing, as upstream's does."""
    called = z3.Or([a.pick[x] for x in REAL_SLOTS])
    invalidated = _invalidate(v, s.caches, Point.SET_FULL_TO_SWA_MAPPING)
    caches = (invalidated[0].ite(called, s.caches[0]), invalidated[1].ite(called, s.caches[1]))
    guard = z3.And(*_picks_live(s, a), *_new_values(a))
    M = tuple(s.M[x] if x in RESERVED else z3.If(a.pick[x], a.value[x], s.M[x]) for x in range(NF))
    return Effect(guard, dataclasses.replace(s, caches=caches, M=M))


def _reset(point: Point) -> Callable[[Variant, State, Action], Effect]:
    def effect(v: Variant, s: State, a: Action) -> Effect:
        post = dataclasses.replace(
            s, caches=_invalidate(v, s.caches, point),
            M=tuple(z3.IntVal(0) for _ in range(NF)), live=tuple(z3.BoolVal(False) for _ in range(NF)))
        return Effect(z3.BoolVal(True), post)

    effect.__doc__ = f"Point ``{point.value}``, then every slot free, M all 0."
    return effect


def _backup_state(v: Variant, s: State, a: Action) -> Effect:
    """A read: the caller now holds the live slots (the reference's backup of the free lists and fill)."""
    return Effect(z3.BoolVal(True), dataclasses.replace(s, bk_held=z3.BoolVal(True), bk_live=s.live))


def _restore_state(v: Variant, s: State, a: Action) -> Effect:
    """No point: liveness rolls back to the held backup, M kept (R3); the twin rolls M back too (any values)."""
    post = dataclasses.replace(s, live=s.bk_live)
    if v.restore_writes_mapping:
        M = tuple(s.M[x] if x in RESERVED else a.value[x] for x in range(NF))
        return Effect(z3.And(s.bk_held, *[z3.And(a.value[x] >= 0, a.value[x] < M_BOUND) for x in REAL_SLOTS]),
                      dataclasses.replace(post, M=M))
    return Effect(s.bk_held, post)


_EFFECTS: Mapping[str, Callable[[Variant, State, Action], Effect]] = {
    "new_storage": _new_storage,
    "free_storage": _free_storage,
    "write_index": _write_index,
    "make_view": _make_view,
    "invalidate_loc_cache": _invalidate_loc_cache,
    "translate_loc_from_full_to_swa": _translate_loc_from_full_to_swa,
    "forward": _forward,
    "capture": _capture,
    "replay": _replay,
    "alloc": _allocation(Point.ALLOC),
    "alloc_extend": _allocation_from_last_loc(Point.ALLOC_EXTEND, "alloc_extend"),
    "alloc_decode": _allocation_from_last_loc(Point.ALLOC_DECODE, "alloc_decode"),
    "alloc_extend_swa_tail": _allocation(Point.ALLOC_EXTEND_SWA_TAIL),
    "free": _free,
    "free_swa": _free_swa,
    "free_full": _free_full,
    "set_full_to_swa_mapping": _set_full_to_swa_mapping,
    "clear": _reset(Point.CLEAR),
    "backup_state": _backup_state,
    "restore_state": _restore_state,
    "register_mapping": _reset(Point.REGISTER_MAPPING),
}


_MEMO_SIZE = 512
_memo: dict[tuple[object, ...], tuple[Effect, State, Action]] = {}


def effect(v: Variant, op: str, s: State, a: Action) -> Effect:
    """The effect of ``op`` with arguments ``a`` in ``s``: its guard, post-state terms and reads.

    Memoised on the identities of ``s``'s and ``a``'s terms (the step relation, the stale-read
    target and the trace renderer all ask for the same effect; building it is most of a BMC
    query's cost). An entry keeps its terms alive, so Z3 cannot recycle their ids while it is kept.
    """
    terms = [*_ts.terms_of(s), *_ts.terms_of(a)]
    key = (v, op, id(terms[0].ctx), *(t.get_id() for t in terms))
    found = _memo.get(key)
    if found is not None:
        return found[0]
    made = _EFFECTS[op](v, s, a)
    if len(_memo) >= _MEMO_SIZE:
        del _memo[next(iter(_memo))]
    _memo[key] = (made, s, a)
    return made


# ---- relations ------------------------------------------------------------------------------


def _is_variable(term: z3.ExprRef) -> bool:
    return bool(z3.is_const(term) and term.decl().kind() == z3.Z3_OP_UNINTERPRETED)


def _relation(v: Variant, op: str) -> Callable[[State, Action, State], z3.BoolRef]:
    """``transitions[op]``: the guard, and every post-state variable equal to the effect's term."""
    def relation(s: State, a: Action, t: State) -> z3.BoolRef:
        e = effect(v, op, s, a)
        frame = [x == y for x, y in zip(_ts.terms_of(t), _ts.terms_of(e.post), strict=True) if _is_variable(x)]
        return z3.And(e.guard, *frame)

    relation.__name__ = relation.__qualname__ = op
    relation.__doc__ = _EFFECTS[op].__doc__
    return relation


def _combine(v: Variant) -> Callable[[Step[State, Action], tuple[str, ...]], z3.BoolRef]:
    """The step over several ops: one frame, each post-state variable an ``If`` chain over the ops that write it.
    Agrees with ``transitions`` op by op (``tests/spec/test_loc_cache.py``)."""

    def combine(step: Step[State, Action], allowed: tuple[str, ...]) -> z3.BoolRef:
        s, a, t = step.pre, step.action, step.post
        eff = {op: effect(v, op, s, a) for op in allowed}
        enabled = z3.Or([z3.And(step.is_(op), e.guard) for op, e in eff.items()])
        posts = {op: _ts.terms_of(e.post) for op, e in eff.items()}
        frame = []
        for i, (pre, post) in enumerate(zip(_ts.terms_of(s), _ts.terms_of(t), strict=True)):
            if not _is_variable(post):
                continue  # a reserved-slot constant
            value: z3.ExprRef = pre
            for op in reversed(allowed):
                new = posts[op][i]
                if not new.eq(pre):
                    value = z3.If(step.is_(op), new, value)
            frame.append(post == value)
        return z3.And(enabled, *frame)

    return combine


# ---- init and the inductive invariant ---------------------------------------------------------


def init(s: State, cache_empty: bool = True) -> z3.BoolRef:
    """``initial_system``: M all 0, nothing live, no index memory, caches empty, quiet, nothing captured, no backup.

    ``cache_empty=False`` (a twin) lets the caches hold any entry at start.
    """
    if cache_empty:
        caches = [z3.Not(c.valid) for c in s.caches]
    else:  # a twin: entries left over from before (register_mapping without its invalidation)
        caches = [z3.Implies(c.valid, _position(c.addr, c.numel)) for c in s.caches]
    return z3.And(
        *[s.M[x] == 0 for x in REAL_SLOTS], *[s.M2[x] == 0 for x in REAL_SLOTS],
        *[z3.Not(s.live[x]) for x in REAL_SLOTS],
        *[z3.Not(s.alive[x]) for x in ADDRS], *[z3.Not(s.used[x]) for x in ADDRS],
        *caches, *s.quiet, z3.Not(s.graph.captured),
        z3.Not(s.bk_held), *[z3.Not(s.bk_live[x]) for x in REAL_SLOTS],
    )


def entry_fresh(s: State, pool: int) -> z3.BoolRef:
    """C1 for pool ``pool``'s cache: its key is a view of allocated memory whose translation it holds."""
    c = s.caches[pool]
    elems = [z3.Implies(i < c.numel, z3.And(
        _sel(s.used, c.addr + i, z3.BoolVal(False)),
        c.value[i] == _mapping_of(s, pool, _sel(s.cont, c.addr + i, z3.IntVal(0))))) for i in range(K)]
    return z3.And(_position(c.addr, c.numel), *elems)


def wellformed_clauses(s: State) -> list[Clause]:
    """Value ranges and storage shape: inductive, not needed by the proof, but they keep counterexamples readable."""
    clauses = [(f"M1: M[{x}] and M2[{x}] in [0, {M_BOUND})",
                z3.And(s.M[x] >= 0, s.M[x] < M_BOUND, s.M2[x] >= 0, s.M2[x] < M_BOUND)) for x in REAL_SLOTS]
    for x in ADDRS:
        clauses.append((f"memory: element {byte_address(x)}, once allocated, holds -1 or a full slot",
                        z3.Implies(s.used[x], in_slot_range(s.cont[x]))))
        clauses.append((f"memory: live element {byte_address(x)} was allocated, in a storage starting at or before it",
                        z3.Implies(s.alive[x], z3.And(s.used[x], s.base[x] >= 0, s.base[x] <= x))))
    for p in (0, 1):
        c = s.caches[p]
        clauses.append((f"pool {p}'s cache key is a view position", z3.Implies(c.valid, _position(c.addr, c.numel))))
    clauses.append(("the captured graph's static buffer is a view position",
                    z3.Implies(s.graph.captured, _position(s.graph.addr, s.graph.numel))))
    return clauses


def invariant_clauses(s: State) -> list[Clause]:
    """The inductive invariant of the upstream policy under E1 (C1, C3, well-formedness), each clause named."""
    clauses = []
    for p in (0, 1):
        mapping = "M" if p == 0 else "M2"
        clauses.append((f"C1: pool {p} quiet and its cache valid => the entry is {mapping}[contents at key]",
                        z3.Implies(z3.And(s.quiet[p], s.caches[p].valid), entry_fresh(s, p))))
    clauses.append(("C3: a captured graph recorded its gather", z3.Implies(s.graph.captured, s.graph.recorded)))
    return clauses + wellformed_clauses(s)


# ---- reads and what goes wrong ----------------------------------------------------------------


def _reads(v: Variant, step: Step[State, Action], op: str) -> tuple[Read, ...]:
    return effect(v, op, step.pre, step.action).reads


def stale_read(v: Variant, step: Step[State, Action], ops: Sequence[str] | None = None) -> z3.BoolRef:
    """Some translation of the step (performing one of ``ops``, default: any) returns other than ``M[contents]``."""
    chosen = [op for op in READ_OPS if ops is None or op in ops]
    return z3.Or([z3.And(step.is_(op), z3.Or([r.stale for r in _reads(v, step, op)])) for op in chosen])


def _ints(model: z3.ModelRef, terms: Sequence[z3.ArithRef], n: int) -> list[int]:
    return [as_int(model, x) for x in terms[:n]]


def _explain(v: Variant) -> Callable[[z3.ModelRef, Step[State, Action]], str]:
    def explain(model: z3.ModelRef, step: Step[State, Action]) -> str:
        op, n = step.op_name(model), step.index + 1
        for r in _reads(v, step, op) if op in _EFFECTS else ():
            if as_bool(model, r.stale):
                k = as_int(model, r.numel)
                got, fresh, cont = _ints(model, r.returned, k), _ints(model, r.fresh, k), _ints(model, r.contents, k)
                pool = r.pool if isinstance(r.pool, int) else as_int(model, r.pool)
                return (f"step {n}: {op} ({r.label}) of @{byte_address(as_int(model, r.addr))} = {cont} "
                        f"returned {got}, but M{'2' if pool else ''}{cont} = {fresh}: stale read")
        return f"step {n}: stale read"

    return explain


def stale(v: Variant = UPSTREAM, ops: Sequence[str] | None = None) -> Target[State, Action]:
    """The step reads a stale translation (among ``ops``' reads; default: any op's)."""
    return Target("stale read", lambda step: stale_read(v, step, ops), _explain(v))


def replay_stale(v: Variant = UPSTREAM) -> Target[State, Action]:
    """A replay uses a stale translation (S6: the warm-up's constant)."""
    return Target("stale replay", lambda step: stale_read(v, step, ("replay",)), _explain(v))


# ---- rendering ------------------------------------------------------------------------------

COLUMNS = ("phase", "cache key -> value", "index memory", "M (* = live)", "backup held")
STEP_COLUMNS = ("translations: returned vs fresh",)


def _view(model: z3.ModelRef, addr: z3.ArithRef, numel: z3.ArithRef, contents: Sequence[z3.ArithRef]) -> str:
    n = as_int(model, numel)
    return f"@{byte_address(as_int(model, addr))} numel {n} = {_ints(model, contents, n)}"


def _cache_text(model: z3.ModelRef, s: State, v: Variant) -> str:
    parts = []
    for p, c in enumerate(s.caches[: 1 if v.policy.shared_across_pools else 2]):
        if not as_bool(model, c.valid):
            continue
        n = as_int(model, c.numel)
        text = f"({byte_address(as_int(model, c.addr))},{n})->{_ints(model, c.value, n)}"
        src = byte_address(as_int(model, c.src))
        if v.policy.key_scheme is KeyScheme.STORAGE_BASE:
            text += f" from view @{src}"
        if v.policy.shared_across_pools:
            text += f" of pool {as_int(model, c.pool)}"
        elif p == 1:
            text = f"pool 1: {text}"
        parts.append(text)
    return "; ".join(parts) or "-"


def _memory_text(model: z3.ModelRef, s: State) -> str:
    """Live storages by base, then freed elements that still hold contents (a cache key may point there)."""
    storages: dict[int, list[int]] = {}
    freed: list[str] = []
    for x in ADDRS:
        if as_bool(model, s.alive[x]):
            storages.setdefault(as_int(model, s.base[x]), []).append(as_int(model, s.cont[x]))
        elif as_bool(model, s.used[x]):
            freed.append(f"@{byte_address(x)}={as_int(model, s.cont[x])}")
    live = [f"@{byte_address(b)}={c}" for b, c in sorted(storages.items())]
    return " ".join(live + ([f"freed {' '.join(freed)}"] if freed else [])) or "-"


def _mapping_text(model: z3.ModelRef, s: State) -> str:
    cells = []
    for x in REAL_SLOTS:
        m, live = as_int(model, s.M[x]), as_bool(model, s.live[x])
        if m or live:
            cells.append(f"{x}->{m}{'*' if live else ''}")
    return " ".join(cells) or "-"


def _phase(model: z3.ModelRef, s: State, v: Variant) -> str:
    """Pool 0's E1 phase, and pool 1's where it differs and pool 1 has a cache entry."""
    q0, q1 = (as_bool(model, q) for q in s.quiet)
    text = "quiet" if q0 else "batch prep"
    shown = not v.policy.shared_across_pools and as_bool(model, s.caches[1].valid)
    return f"{text} (pool 1 {'quiet' if q1 else 'batch prep'})" if shown and q0 != q1 else text


def _cells(v: Variant) -> Callable[[z3.ModelRef, State], tuple[str, ...]]:
    def cells(model: z3.ModelRef, s: State) -> tuple[str, ...]:
        backup = ""
        if as_bool(model, s.bk_held):
            backup = f"live {[x for x in REAL_SLOTS if as_bool(model, s.bk_live[x])]}"
        return (_phase(model, s, v), _cache_text(model, s, v), _memory_text(model, s), _mapping_text(model, s),
                backup)

    return cells


def _read_text(model: z3.ModelRef, r: Read) -> str:
    n = as_int(model, r.numel)
    got, fresh = _ints(model, r.returned, n), _ints(model, r.fresh, n)
    pool = as_int(model, r.pool) if not isinstance(r.pool, int) else r.pool
    how = "hit" if as_bool(model, r.hit) else "miss"
    if r.label == "replay":
        how = "constant" if as_bool(model, r.hit) else "recorded gather"
    text = f"{how} {got}"
    if got != fresh:
        text += f" STALE: fresh M{'2' if pool else ''}{_ints(model, r.contents, n)} = {fresh}"
    return text


def _step_cells(v: Variant) -> Callable[[z3.ModelRef, Step[State, Action]], tuple[str, ...]]:
    def step_cells(model: z3.ModelRef, step: Step[State, Action]) -> tuple[str, ...]:
        op = step.op_name(model)
        reads = _reads(v, step, op) if op in _EFFECTS else ()
        return ("; ".join(f"{r.label}: {_read_text(model, r)}" for r in reads),)

    return step_cells


def _picked(model: z3.ModelRef, a: Action) -> list[int]:
    return [x for x in REAL_SLOTS if as_bool(model, a.pick[x])]


def _describe(v: Variant) -> Callable[[z3.ModelRef, Step[State, Action]], str]:
    def describe(model: z3.ModelRef, step: Step[State, Action]) -> str:
        """The call of one step with its arguments and what it did."""
        op, s, a = step.op_name(model), step.pre, step.action
        if op not in _EFFECTS:
            return f"{op}()"
        eff = effect(v, op, s, a)
        reads, picked = eff.reads, _picked(model, a)

        def new_m() -> str:
            return ", ".join(f"M[{x}]={as_int(model, a.value[x])}" for x in picked) or "no slot"

        pool = as_int(model, a.pool)
        if op in ("translate_loc_from_full_to_swa", "forward"):
            call = f"{op}({_view(model, a.addr, a.numel, reads[0].contents)}{', pool 1' if pool else ''})"
        elif op == "make_view":
            call = f"make_view({_view(model, a.addr, a.numel, view_contents(s, a.addr, a.numel))})"
        elif op == "invalidate_loc_cache":
            call = f"invalidate_loc_cache(pool {pool})"
            if v.invalidate_ignores_pool and pool:
                call += " [drops pool 0's cache]"
        elif op == "capture":
            runs = "/".join("hit" if as_bool(model, r.hit) else "miss" for r in reads)
            call = f"capture(static {_view(model, a.addr, a.numel, reads[0].contents)}): run_once x{RUNS} {runs}"
            g = eff.post.graph
            call += f" -> recorded_gather={as_bool(model, g.recorded)}"
            if not as_bool(model, g.recorded):
                call += f", constant {_ints(model, g.constant, as_int(model, a.numel))}"
        elif op == "replay":
            call = f"replay(static {_view(model, s.graph.addr, s.graph.numel, reads[0].contents)})"
        elif op == "new_storage":
            n, addr = as_int(model, a.numel), as_int(model, a.addr)
            reuse = any(as_bool(model, s.used[x]) for x in range(addr, addr + n) if x in ADDRS)
            call = f"new_storage(base {byte_address(addr)}, {_ints(model, a.data, n)})"
            call += " reuses a freed address" if reuse else ""
            call += " [not counted as a rewrite]" if reuse and not v.reuse_rewrites else ""
        elif op == "free_storage":
            call = f"free_storage(base {byte_address(as_int(model, a.addr))})"
            call += " [scrubs it to -1]" if v.free_scrubs else ""
        elif op == "write_index":
            call = f"write_index(@{byte_address(as_int(model, a.addr))} := {as_int(model, a.data[0])})"
            call += " [not counted as a rewrite]" if not v.write_rewrites else ""
        elif op in ("alloc", "alloc_extend_swa_tail"):
            call = f"{op}() -> {new_m()}"
        elif op in ("alloc_extend", "alloc_decode"):
            call = f"{op}(last_loc {_view(model, a.addr, a.numel, reads[0].contents)}) -> {new_m()}"
        elif op in ("free_swa", "free", "free_full"):
            call = f"{op}({picked})"
        elif op == "set_full_to_swa_mapping":
            call = f"{op}({picked}, {[as_int(model, a.value[x]) for x in picked]})"
        elif op == "backup_state":
            call = f"backup_state() -> holds live slots {[x for x in REAL_SLOTS if as_bool(model, s.live[x])]}"
        elif op == "restore_state":
            call = f"restore_state() -> live slots {[x for x in REAL_SLOTS if as_bool(model, s.bk_live[x])]}"
            if v.restore_writes_mapping:
                call += f", M rolled back to {[as_int(model, a.value[x]) for x in REAL_SLOTS]}"
        else:
            call = f"{op}()"
        if op == "set_full_to_swa_mapping" and not picked:
            return f"{op}([], []) (empty: returns before its point)"
        point = POINT_OF.get(op)
        removed = point is not None and point not in v.policy.points
        if removed or (op == "replay" and not v.replay_invalidates):
            name = point.value if point is not None else "forward"
            call += f" [point {name} removed: no invalidation]"
        return call

    return describe


# ---- the system -----------------------------------------------------------------------------


def system(v: Variant = UPSTREAM, *, cache_empty: bool = True) -> TransitionSystem[State, Action]:
    """The bounded loc_cache system with ``v``'s (possibly broken) parts; ``cache_empty=False``: the initial-state
    twin (left-over cache entries)."""
    return TransitionSystem(
        component=COMPONENT, state=State.fresh, action=Action.fresh, init=lambda s: init(s, cache_empty),
        transitions={op: _relation(v, op) for op in OPS}, invariant=invariant_clauses, columns=COLUMNS,
        cells=_cells(v), describe=_describe(v), step_columns=STEP_COLUMNS, step_cells=_step_cells(v),
        combine=_combine(v),
    )


SYSTEM = system(UPSTREAM)
SYSTEMS: tuple[TransitionSystem[State, Action], ...] = (SYSTEM,)


def _wellformed(v: Variant = UPSTREAM) -> TransitionSystem[State, Action]:
    """``system(v)`` whose "invariant" is well-formedness only: the premise of the claims from any state."""
    return dataclasses.replace(system(v), invariant=wellformed_clauses)


# ---- searches -------------------------------------------------------------------------------

#: The ops every witness trace sets up with: index memory, translations, forwards, allocations.
SETUP = ("new_storage", "free_storage", "write_index", "translate_loc_from_full_to_swa", "forward", "alloc")
#: Ops beyond SETUP that the trace without a point uses: the op that passes the point (capture adds replay).
POINT_OPS: Mapping[Point, tuple[str, ...]] = {
    Point.ALLOC: (),
    Point.ALLOC_EXTEND: ("alloc_extend",),
    Point.ALLOC_EXTEND_SWA_TAIL: ("alloc_extend_swa_tail",),
    Point.ALLOC_DECODE: ("alloc_decode",),
    Point.FREE_SWA: ("free_swa",),
    Point.SET_FULL_TO_SWA_MAPPING: ("set_full_to_swa_mapping",),
    Point.CLEAR: ("clear",),
    Point.REGISTER_MAPPING: ("register_mapping",),
    Point.FORWARD: (),
    Point.RUN_ONCE: ("capture", "replay"),
}


def witness_search(*extra: str, pools: tuple[int, ...] = (0,), max_storage: int = 1) -> Search[State, Action]:
    """Runs like the reference witnesses in ``tests/reference/test_loc_cache.py``: SETUP plus ``extra``, pools
    ``pools`` only, ``M`` handed out 1:1 (SWA slot = full slot, as the witnesses' first allocations are),
    translations of real slots or padding (no -1), storages of at most ``max_storage`` elements, one-element views.
    Every run found is a run of the full model."""
    ops = tuple(op for op in OPS if op in SETUP + extra)

    def any_of(step: Step[State, Action], names: Sequence[str]) -> z3.BoolRef | None:
        chosen = [op for op in names if op in ops]
        return step.performs(chosen) if chosen else None

    def real(c: z3.ArithRef) -> z3.BoolRef:
        return z3.Or(c == 0, c > RESERVED[-1])

    def facts(step: Step[State, Action]) -> list[z3.BoolRef]:
        s, a = step.pre, step.action
        out: list[z3.BoolRef] = []
        reading = any_of(step, ("translate_loc_from_full_to_swa", "forward"))
        if reading is not None:
            if pools != (0, 1):
                out.append(z3.Implies(reading, z3.Or([a.pool == p for p in pools])))
            out += [z3.Implies(reading, real(c)) for c in view_contents(s, a.addr, a.numel)]
        allocating = any_of(step, ALLOCATIONS)
        if allocating is not None:
            out += [z3.Implies(z3.And(allocating, a.pick[x]), a.value[x] == x) for x in REAL_SLOTS]
        if "set_full_to_swa_mapping" in ops:
            out += [z3.Implies(z3.And(step.is_("set_full_to_swa_mapping"), a.pick[x]),
                               z3.And(a.value[x] >= RESERVED[-1] + 1, a.value[x] < NF)) for x in REAL_SLOTS]
        if "replay" in ops:
            out += [z3.Implies(step.is_("replay"), real(c)) for c in view_contents(s, s.graph.addr, s.graph.numel)]
        if "new_storage" in ops:
            out += [z3.Implies(step.is_("new_storage"), z3.Or(real(c), c == -1)) for c in a.data]
            if max_storage < len(ADDRS):
                out.append(z3.Implies(step.is_("new_storage"), a.numel <= max_storage))
        if "write_index" in ops:
            out.append(z3.Implies(step.is_("write_index"), real(a.data[0])))
        viewing = any_of(step, VIEW_OPS)
        if viewing is not None:
            out.append(z3.Implies(viewing, a.numel <= 1))
        return out

    return Search(ops, facts)


def fresh_reads(v: Variant = UPSTREAM) -> Search[State, Action]:
    """Every step's translations are fresh (for :func:`witness`: runs that read nothing stale)."""
    return Search(facts=lambda step: [z3.Not(stale_read(v, step))])


def find_trace(v: Variant, target: Target[State, Action], search: Search[State, Action] = _ts.EVERYTHING,
               max_depth: int = MAX_DEPTH) -> _ts.Trace | None:
    """The shortest run of ``v`` (within ``search``) reaching ``target`` in ``max_depth`` steps, or None."""
    return _ts.find_trace(system(v), target, max_depth, search=search)


def witness(v: Variant, ops: Sequence[str], *, fresh: bool = True, changes: bool = False) -> _ts.Trace | None:
    """A run of ``v`` performing exactly ``ops`` from the initial state (non-vacuity), or None; with ``fresh`` every
    translation of the run is fresh, with ``changes`` every step changes the state."""
    return _ts.witness(system(v), ops, search=fresh_reads(v) if fresh else _ts.EVERYTHING, changes=changes)


# ---- claims beyond induction ------------------------------------------------------------------


def _calm(op: str | None = None, tag: str = "pre", action: str = "step", *, pool: int = 0
          ) -> Callable[[], list[z3.BoolRef]]:
    """For a twin (:meth:`Check.also`): state ``tag`` pins what its counterexample does not need, so the table shows
    only what it is about: the other pool idle (its ``M2 = 0`` or ``M = 0`` and no entry; the action serves
    ``pool``), ``M = 0`` on slots that are not live, cached values >= -1, storages as ``new_storage`` makes them
    (contiguous from a live base), never-allocated elements 0, no captured graph unless ``op`` is ``replay``, no
    backup unless it is ``restore_state``."""

    def facts() -> list[z3.BoolRef]:
        s, a = State.fresh(tag), Action.fresh(action)
        other = 1 - pool
        out = [z3.Not(s.caches[other].valid), a.pool == pool,
               *[(s.M2 if other else s.M)[x] == 0 for x in REAL_SLOTS],
               *[z3.Implies(z3.Not(s.live[x]), s.M[x] == 0) for x in REAL_SLOTS],
               *[z3.Implies(z3.Not(s.used[x]), s.cont[x] == 0) for x in ADDRS],
               *[value >= -1 for c in s.caches for value in c.value],
               *[z3.Implies(z3.And(s.alive[x], s.base[x] == b), z3.And([z3.And(s.alive[y], s.base[y] == b)
                                                                        for y in range(b, x)]))
                 for x in ADDRS for b in range(x)]]
        if op != "replay":
            out.append(z3.Not(s.graph.captured))
        if op != "restore_state":
            out.append(z3.Not(s.bk_held))
        return out

    return facts

WELLFORMED_START = "(any well-formed state)"


def _c4(v: Variant, op: str) -> Check:
    """From any well-formed state (any phase, any cache), after ``op`` pool 0's entry is ``M_new[last_loc]``."""

    def refilled(step: Step[State, Action]) -> z3.BoolRef:
        a, t = step.action, step.post
        contents = view_contents(t, a.addr, a.numel)
        fresh = [z3.Implies(i < a.numel, t.caches[0].value[i] == f) for i, f in enumerate(fresh_of(t, 0, contents))]
        return z3.And(t.caches[0].valid, t.caches[0].addr == a.addr, t.caches[0].numel == a.numel, *fresh)

    def explain(model: z3.ModelRef, step: Step[State, Action]) -> str:
        a, t = step.action, step.post
        n = as_int(model, a.numel)
        contents = view_contents(t, a.addr, a.numel)
        cont = _ints(model, contents, n)
        return (f"after step 1 the cache holds {_ints(model, t.caches[0].value, n)} for last_loc {cont}, "
                f"but M{cont} = {_ints(model, fresh_of(t, 0, contents), n)}: "
                "the mutator wrote M on a last_loc slot after the refill")

    return _ts.safety(_wellformed(v), refilled, explain, (op,), start=WELLFORMED_START)


def _translatable(v: Variant) -> Check:
    """From any invariant state, the view ``make_view`` returns passes translate's checks (live elements of one
    storage, contents -1 or a full slot)."""

    def good(step: Step[State, Action]) -> z3.BoolRef:
        s, a = step.pre, step.action
        return z3.And(view_ok(s, a.addr, a.numel),
                      *[z3.Implies(i < a.numel, in_slot_range(c))
                        for i, c in enumerate(view_contents(s, a.addr, a.numel))])

    def explain(model: z3.ModelRef, step: Step[State, Action]) -> str:
        s, a = step.pre, step.action
        addr, n = as_int(model, a.addr), as_int(model, a.numel)
        for x in range(addr, addr + n):
            if x in ADDRS and not as_bool(model, s.alive[x]):
                return (f"make_view returned a view of element @{byte_address(x)}, which no live storage holds: "
                        "translate_loc_from_full_to_swa rejects it (storage is not allocated)")
        return "make_view returned a view translate_loc_from_full_to_swa rejects"

    return _ts.safety(system(v), good, explain, ("make_view",))


def _next_read_fresh(v: Variant) -> Check:
    """From any well-formed state (whatever its caches hold), ``invalidate_loc_cache(pool)`` then a translation for
    the same pool returns ``M[contents]``."""
    sys = _wellformed(v)
    ops = ("invalidate_loc_cache", "translate_loc_from_full_to_swa")
    target = stale(v, ("translate_loc_from_full_to_swa",))

    def build() -> list[z3.BoolRef]:
        u = _ts.Unrolling.fresh(sys, 2)
        first, second = u.steps()
        return [sys.holds(u.states[0]), *u.run(ops), first.relation(ops[:1]), second.relation(ops[1:]),
                first.action.pool == second.action.pool, target.bad(second)]

    def render(model: z3.ModelRef) -> str:
        return _ts.trace_of(sys, model, target, start=WELLFORMED_START).table()

    return Check(build, render)


def _round_trip(v: Variant, *, whole_mapping: bool) -> Check:
    """From any invariant state, backup_state, one allocation, restore_state give back the live slots and leave
    ``M`` on the slots live before as it was (``whole_mapping``: ``M`` everywhere, which R3 breaks)."""
    sys = system(v)

    def goal(u: _ts.Unrolling[State, Action]) -> z3.BoolRef:
        s, t = u.states[0], u.states[-1]
        mapping = [s.M[x] == t.M[x] if whole_mapping else z3.Implies(s.live[x], s.M[x] == t.M[x])
                   for x in REAL_SLOTS]
        return z3.And(*[s.live[x] == t.live[x] for x in REAL_SLOTS], *mapping)

    def build() -> list[z3.BoolRef]:
        u = _ts.Unrolling.fresh(sys, 3)
        backup, allocation, restore = u.steps()
        return [sys.holds(u.states[0]), backup.relation(("backup_state",)), allocation.relation(ALLOCATIONS),
                restore.relation(("restore_state",)), z3.Not(goal(u))]

    def render(model: z3.ModelRef) -> str:
        u = _ts.Unrolling.fresh(sys, 3)
        s, t = u.states[0], u.states[-1]
        trace = _ts.trace_of(sys, model, start="(any invariant state)")
        verdict = "the allocator differs from the state before backup_state"
        for x in REAL_SLOTS:
            b, c = as_int(model, s.M[x]), as_int(model, t.M[x])
            if b != c:
                verdict = (f"after restore_state M[{x}] = {c}, before backup_state it was {b}: restore_state rolls "
                           "back liveness, never the mapping (R3)")
                break
        return _ts.Trace(trace.columns, trace.rows, verdict).table()

    return Check(build, render)


# ---- obligations ----------------------------------------------------------------------------

NAME = "no_stale_read"
INSTANCE = f"bounded instance: {NF} full slots, {len(ADDRS)} index elements, views of <= {K} elements, 2 pools"


def _ob(suffix: str, statement: str, check: Check, twin_of: str | None = None) -> Obligation:
    return _ts.obligation(SYSTEM, suffix, statement, check, family=FAMILY, twin_of=twin_of)


def _bmc(suffix: str, statement: str, v: Variant, twin_of: str, search: Search[State, Action],
         target: Target[State, Action] | None = None) -> Obligation:
    """A twin refuted by the shortest run (iterative deepening, at most MAX_DEPTH steps) reaching ``target``."""
    return _ob(suffix, statement, _ts.reachable(system(v), target or stale(v, search.ops), MAX_DEPTH, search=search,
                                                shortest=True), twin_of=twin_of)


def _without(point: Point) -> Obligation:
    return _bmc(f"{NAME}.without_{point.value}",
                f"upstream policy without the {point.value} invalidation point: a run of <= {MAX_DEPTH} steps "
                "respecting E1 reads a stale translation (BMC, iterative deepening)",
                Variant(policy=Policy().without(point)), f"{NAME}.consecution", witness_search(*POINT_OPS[point]))


def _keeps(op: str, statement: str, twin: str, twin_statement: str, broken: Variant) -> tuple[Obligation, ...]:
    """``<op>.keeps_invariant``: the op preserves C1 + C3 (upstream, E1); its twin breaks it in one step."""
    sound = f"{op}.keeps_invariant"
    return (
        _ob(sound, f"loc_cache ({INSTANCE}), upstream policy under E1: {op} preserves the invariant C1 + C3 "
            f"({statement})", _ts.consecution(SYSTEM, (op,))),
        _ob(f"{sound}.{twin}", twin_statement, _ts.consecution(system(broken), (op,)).also(_calm(op)),
            twin_of=sound),
    )


def _without_point(op: str) -> Variant:
    return Variant(policy=Policy().without(POINT_OF[op]))


def _point_kept(op: str, what: str) -> tuple[Obligation, ...]:
    point = POINT_OF[op].value
    return _keeps(op, f"its point {point} drops pool 0's cache before {what}", "without_point",
                  f"{op} without its {point} invalidation point leaves a quiet pool's cache entry stale after {what} "
                  "(one step from an invariant state)", _without_point(op))


def _reads_fresh(op: str) -> tuple[Obligation, ...]:
    """``<op>.reads_fresh``: the op's own translation of ``last_loc`` is fresh, even in batch preparation."""
    sound = f"{op}.reads_fresh"
    point = POINT_OF[op].value
    broken = _without_point(op)
    return (
        _ob(sound, f"loc_cache ({INSTANCE}): from any invariant state, in either phase, {op}'s translation of "
            f"last_loc right after its {point} point returns M[last_loc]",
            _ts.safety(SYSTEM, lambda step: z3.Not(stale_read(UPSTREAM, step, (op,))), _explain(UPSTREAM), (op,))),
        _ob(f"{sound}.without_point", f"without its {point} point, {op} in batch preparation translates last_loc "
            "through an entry a rewrite of index memory made stale",
            _ts.safety(system(broken), lambda step: z3.Not(stale_read(broken, step, (op,))), _explain(broken), (op,))
            .also(_calm(op)), twin_of=sound),
    )


def _c4_obligations(op: str) -> tuple[Obligation, ...]:
    sound = f"{op}.c4_refill_fresh"
    return (
        _ob(sound, f"C4 ({INSTANCE}): from any state, after {op} (point, translate last_loc, then M written on free "
            "slots) the cache holds last_loc's key and M_new[last_loc]", _c4(UPSTREAM, op)),
        _ob(f"{sound}.overlapping_slots", f"an {op} that may write M on a last_loc slot leaves the refilled entry "
            "stale", _c4(Variant(c4_disjoint=False), op).also(_calm(op)), twin_of=sound),
    )


def _op_obligations() -> tuple[Obligation, ...]:
    """One claim per reference operation, each with a broken twin."""
    safety = f"{NAME}.safety"
    return (
        *_keeps("new_storage", "a new storage over an address that was ever allocated starts batch preparation, "
                "where C1 asks nothing", "reuse_unnoticed", "if E1 did not count a new storage over a freed address "
                "as a rewrite, a quiet pool's entry keyed there would now translate other contents",
                Variant(reuse_rewrites=False)),
        *_keeps("free_storage", "freed memory keeps its contents until an address is reused", "scrubs_memory",
                "a free_storage that overwrites its elements (a rewrite E1 does not see) leaves a quiet pool's entry "
                "keyed there stale", Variant(free_scrubs=True)),
        *_keeps("write_index", "an in-place write starts batch preparation", "unnoticed", "if E1 did not count an "
                "in-place write as a rewrite, a quiet pool's entry keyed at the written element goes stale",
                Variant(write_rewrites=False)),
        _ob("make_view.translatable", f"loc_cache ({INSTANCE}): from any invariant state the view make_view returns "
            "passes translate_loc_from_full_to_swa's checks (live elements of one storage, contents -1 or a full "
            "slot)", _translatable(UPSTREAM)),
        _ob("make_view.translatable.freed_storage", "a make_view that does not check its storage is live returns a "
            "view of freed memory, which translate rejects",
            _translatable(Variant(view_checks_live=False)).also(_calm("make_view")),
            twin_of="make_view.translatable"),
        _ob("invalidate_loc_cache.next_read_fresh", f"loc_cache ({INSTANCE}): from any well-formed state, whatever "
            "the caches hold, invalidate_loc_cache(pool) then a translation for that pool returns M[contents]",
            _next_read_fresh(UPSTREAM)),
        _ob("invalidate_loc_cache.next_read_fresh.ignores_pool", "an invalidate_loc_cache that drops pool 0's cache "
            "whatever its pool leaves pool 1's stale entry in place",
            _next_read_fresh(Variant(invalidate_ignores_pool=True)).also(_calm(tag="0", action="0", pool=1)),
            twin_of="invalidate_loc_cache.next_read_fresh"),
        *_keeps("translate_loc_from_full_to_swa", "a miss caches M over the view's own address (data_ptr key), a "
                "hit re-stores a fresh entry", "storage_base_key", "with the storage-base key (S5) a miss caches the "
                "translation of a view at an offset under its storage's base address",
                Variant(policy=Policy(key_scheme=KeyScheme.STORAGE_BASE))),
        _bmc("translate_loc_from_full_to_swa.e1_needed",
             "R2-a: upstream policy, but the scheduler translates during batch preparation (a freed address reused by "
             "a new storage with other contents): a stale read within 8 steps, so the contract E1 is necessary",
             Variant(e1=False, in_place_writes=False), safety, witness_search()),
        _bmc("translate_loc_from_full_to_swa.s5_storage_base_key",
             "S5: with the storage-base key two equal-length views of one storage at different offsets collide and "
             "the second translation returns the first's value (BMC)",
             Variant(policy=Policy(key_scheme=KeyScheme.STORAGE_BASE)), safety, witness_search(max_storage=2)),
        _bmc("translate_loc_from_full_to_swa.cache_shared_across_pools",
             "one cache shared by two SWA pools: a translation for pool 1 hits pool 0's entry (BMC)",
             Variant(policy=Policy(shared_across_pools=True)), safety, witness_search(pools=(0, 1))),
        *_point_kept("forward", "translating loc and ending batch preparation"),
        *_point_kept("capture", "each run_once, so the capture run misses and records its gather (C3)"),
        *_keeps("replay", "its forward point drops pool 0's cache before it ends batch preparation",
                "without_point", "#25824 as merged: a replay without the forward point ends batch preparation with "
                "the cache entry a rewrite made stale", Variant(replay_invalidates=False)),
        _bmc("replay.s6_capture_without_run_once",
             "S6: without run_once's invalidation the capture run hits the warm-up's entry, records no gather, and "
             "a replay uses the warm-up's constant although the static buffer now holds other slots (BMC)",
             Variant(policy=Policy().without(Point.RUN_ONCE)), safety, witness_search("capture", "replay"),
             replay_stale(Variant(policy=Policy().without(Point.RUN_ONCE)))),
        _bmc("replay.forward_point_eager_only",
             "#25824 as merged: the per-forward invalidation sat after the CUDA-graph branch, so a replay keeps the "
             "entry an earlier translation left; a translation after the replay reads stale (fixed by #26152) (BMC)",
             Variant(replay_invalidates=False), safety, witness_search("capture", "replay", "alloc_decode")),
        *_point_kept("alloc", "writing M on the new slots"),
        *_reads_fresh("alloc_extend"),
        *_c4_obligations("alloc_extend"),
        *_reads_fresh("alloc_decode"),
        *_c4_obligations("alloc_decode"),
        *_point_kept("alloc_extend_swa_tail", "writing M on the new slots"),
        *_point_kept("free", "zeroing M on the freed slots"),
        *_point_kept("free_swa", "zeroing M"),
        _ob("free_full.needs_no_point",
            f"loc_cache ({INSTANCE}): free_full preserves the invariant without invalidating (it never writes M)",
            _ts.consecution(SYSTEM, ("free_full",))),
        _ob("free_full.needs_no_point.zeroes_mapping",
            "a free_full that also releases the SWA side (M = 0) without an invalidation point breaks C1",
            _ts.consecution(system(Variant(free_full_writes_mapping=True)), ("free_full",)).also(_calm("free_full")),
            twin_of="free_full.needs_no_point"),
        *_point_kept("set_full_to_swa_mapping", "writing M"),
        *_point_kept("clear", "resetting M"),
        _ob("backup_state.round_trip", f"loc_cache ({INSTANCE}): from any invariant state, backup_state, one "
            "allocation, restore_state give back the live slots and leave M on them as it was",
            _round_trip(UPSTREAM, whole_mapping=False)),
        _ob("backup_state.round_trip.whole_mapping", "restore_state does not give back M on the slots the draft "
            "allocation used (R3): it rolls back liveness only, which is why it needs no invalidation point",
            _round_trip(UPSTREAM, whole_mapping=True).also(_calm(tag="0", action="1")),
            twin_of="backup_state.round_trip"),
        _ob("restore_state.needs_no_point",
            f"loc_cache ({INSTANCE}): restore_state preserves the invariant without invalidating (it rolls back "
            "free lists, never M)", _ts.consecution(SYSTEM, ("restore_state",))),
        _ob("restore_state.needs_no_point.rolls_back_mapping",
            "a restore_state that also rolls M back, without an invalidation point, breaks C1",
            _ts.consecution(system(Variant(restore_writes_mapping=True)), ("restore_state",))
            .also(_calm("restore_state")),
            twin_of="restore_state.needs_no_point"),
        *_point_kept("register_mapping", "resetting M"),
    )


OBLIGATIONS: tuple[Obligation, ...] = (
    _ob(f"{NAME}.initiation",
        f"loc_cache ({INSTANCE}): initial_system satisfies the invariant C1 (a quiet pool's valid entry equals its M "
        "over the contents at its key) and C3 (a captured graph recorded its gather)", _ts.initiation(SYSTEM)),
    _ob(f"{NAME}.initiation.cache_survives",
        "a pool that starts with a left-over cache entry (register_mapping without its invalidation, #25889) starts "
        "outside C1", _ts.initiation(system(cache_empty=False)), twin_of=f"{NAME}.initiation"),
    _ob(f"{NAME}.consecution",
        f"loc_cache ({INSTANCE}), upstream policy (all ten points, data_ptr key, one cache per pool) under E1: every "
        f"transition (the {len(OPS)} reference operations) preserves the invariant C1 + C3", _ts.consecution(SYSTEM)),
    *[_without(point) for point in Point],
    _ob(f"{NAME}.safety",
        f"loc_cache ({INSTANCE}), upstream policy under E1: from any invariant state no transition's translation "
        "(scheduler, forward, capture runs, replay, alloc_extend/alloc_decode last_loc) differs from M[contents]",
        _ts.safety(SYSTEM, lambda step: z3.Not(stale_read(UPSTREAM, step)), _explain(UPSTREAM))),
    *_op_obligations(),
)
