"""``loc_cache``: the full->SWA loc translation cache (#25824, #26152; sglang_semantics.md §3, §7 C1-C4, §9 S5 S6).

A bounded symbolic transition system mirroring ``kvproof.reference.loc_cache``
(small concrete sizes, symbolic contents):

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
  the constant used when no gather was recorded.

Transitions, named like the reference functions (``Op``):
``translate_loc_from_full_to_swa`` (the scheduler; quiet phase of its pool only, E1),
``forward`` (point ``forward``, translate ``loc``, end batch preparation; ``loc``
holds live slots or padding 0, ``set_kv_buffer``'s check; pool 1's forward is its own
model runner's ``_forward_raw``), ``capture`` (three ``run_once``: point ``run_once``
then translate, on a padding buffer), ``replay`` (point ``forward``, then the
recorded gather or the constant), ``new_storage`` / ``free_storage`` /
``write_index`` (a new storage over an address that was ever allocated, or an
in-place write, starts batch preparation of both pools), the mutators of ``M`` each
preceded by its point (``alloc``, ``alloc_extend``, ``alloc_decode``,
``alloc_extend_swa_tail``: some free slots become live with new ``M`` values;
``alloc_extend`` / ``alloc_decode`` first translate a ``last_loc`` view of live slots
or -1 right after their point, C4; ``free_swa``: some slots get 0; ``free``: some
live slots get 0 and are freed; ``set_full_to_swa_mapping``: some live slots get new
values; ``clear`` / ``register_mapping``: everything free, ``M`` all 0), and
``free_full`` / ``restore_state`` (liveness only, no point). Every translation is a
*read*; it is stale when it differs from ``M[contents]`` at that moment (the
reference's ghost log ``stale_reads``). The builder is parametrised by a
:class:`Variant`: a :class:`Policy` (points present, key scheme, shared cache) plus
the environment (E1) and the deliberately broken parts of the twins.

E1 per pool: the reference's ``forward`` invalidates pool 0's cache only and nothing
ever invalidates pool 1's, so under E1 as the reference states it a pool-1
translation after address reuse and a pool-0 forward is stale even upstream. The
model reads E1 per pool (a pool is quiet once *its own* forward followed the last
rewrite) and gives pool 1 its forward; for pool 0 this is exactly the reference's E1.

Obligations (all for this bounded instance):

* ``loc_cache.no_stale_read.{initiation,consecution,safety}``: under the upstream
  policy (every point, ``data_ptr`` key, one cache per pool) and E1 no translation is
  ever stale, by the inductive invariant "a valid cache entry of a quiet pool equals
  that pool's ``M`` over the current contents at its key" (C1) plus "a captured graph
  recorded its gather" (C3) and well-formedness (value ranges, storage shape);
* ``loc_cache.no_stale_read.without_<point>`` for each of the ten points (twins of
  ``.consecution``): a BMC trace (one incremental solver, iterative deepening, at
  most 8 steps) from the initial state to a stale read once that point is removed;
* ``loc_cache.s5_storage_base_key``, ``loc_cache.s6_capture_without_run_once``,
  ``loc_cache.cache_shared_across_pools``, ``loc_cache.e1_needed`` (R2-a: a scheduler
  translation during batch preparation after address reuse is stale even upstream),
  twins of ``.safety``;
* ``loc_cache.free_full_needs_no_point``, ``loc_cache.restore_state_needs_no_point``
  (each preserves the invariant without invalidating) and ``loc_cache.c4_refill_fresh``
  (the entry ``alloc_extend`` / ``alloc_decode`` refill from ``last_loc`` is fresh
  after their ``M`` write), each with a broken twin.

The BMC twins search a narrower set of runs of the same relation (:class:`Search`):
the ops of the reference witness plus the setup ops, pool 0 only (except the shared
cache), allocations mapped 1:1, one-element storages and views, no -1 in forwarded
or translated views. Any run found is a run of the full model; the narrowing keeps
traces close to ``tests/reference/test_loc_cache.py`` and the queries fast.

Modelling notes: memory is address-based, so a graph or cache entry refers to
whatever storage now lives at its address (closer to raw CUDA pointers than the
reference's storage ids, and a superset of its behaviours); stored contents are
always in ``[-1, 6)``; new ``M`` values are in ``[0, 16)``; ``free_swa`` may zero any
slots (the reference zeroes whole pages); ``restore_state`` may roll liveness back to
any set of slots; ``capture`` runs two warm-ups (the reference's default).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum, IntEnum

import z3

from kvproof.spec._solver import Expect, Obligation, as_bool, as_int

__all__ = [
    "OBLIGATIONS",
    "COMPONENT",
    "FAMILY",
    "NF",
    "RESERVED",
    "REAL_SLOTS",
    "ADDRS",
    "K",
    "RUNS",
    "M_BOUND",
    "BASE_BYTES",
    "ELEMENT_BYTES",
    "MAX_DEPTH",
    "byte_address",
    "Point",
    "KeyScheme",
    "Policy",
    "Variant",
    "UPSTREAM",
    "Op",
    "POINT_OF",
    "Cache",
    "Graph",
    "State",
    "Action",
    "Read",
    "Effect",
    "effects",
    "transition",
    "stale_read",
    "step",
    "stale",
    "init",
    "entry_fresh",
    "wellformed_clauses",
    "invariant_clauses",
    "invariant",
    "Search",
    "SETUP",
    "POINT_OPS",
    "witness_search",
    "Unrolling",
    "Target",
    "STALE",
    "REPLAY_STALE",
    "Trace",
    "TraceRow",
    "trace_of",
    "shortest_bmc",
    "find_trace",
    "witness",
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


class Point(str, Enum):
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


class KeyScheme(str, Enum):
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
    """A policy plus the environment (E1) and the deliberately broken parts of a twin."""

    policy: Policy = Policy()
    e1: bool = True  # the scheduler translates only in its pool's quiet phase
    in_place_writes: bool = True  # write_index is available (off: rewrites are address reuse only)
    c4_disjoint: bool = True  # the slots alloc_extend / alloc_decode write are free (so not in last_loc)
    free_full_writes_mapping: bool = False  # twin: free_full also zeroes M, without a point
    restore_writes_mapping: bool = False  # twin: restore_state also rolls M back, without a point
    replay_invalidates: bool = True  # off: #25824 as merged, the forward point only on the eager path (#26152)


UPSTREAM = Variant()


class Op(IntEnum):
    """One step of the transition system; values are the ``op`` variable's encoding."""

    TRANSLATE = 0
    FORWARD = 1
    CAPTURE = 2
    REPLAY = 3
    NEW_STORAGE = 4
    FREE_STORAGE = 5
    WRITE_INDEX = 6
    ALLOC = 7
    ALLOC_EXTEND = 8
    ALLOC_DECODE = 9
    ALLOC_EXTEND_SWA_TAIL = 10
    FREE_SWA = 11
    FREE = 12
    FREE_FULL = 13
    SET_FULL_TO_SWA_MAPPING = 14
    CLEAR = 15
    REGISTER_MAPPING = 16
    RESTORE_STATE = 17

    @property
    def call(self) -> str:
        return "translate_loc_from_full_to_swa" if self is Op.TRANSLATE else self.name.lower()


#: The invalidation point an op passes (replay: forward; capture: run_once, once per run).
POINT_OF: dict[Op, Point] = {
    Op.FORWARD: Point.FORWARD,
    Op.REPLAY: Point.FORWARD,
    Op.CAPTURE: Point.RUN_ONCE,
    Op.ALLOC: Point.ALLOC,
    Op.ALLOC_EXTEND: Point.ALLOC_EXTEND,
    Op.ALLOC_DECODE: Point.ALLOC_DECODE,
    Op.ALLOC_EXTEND_SWA_TAIL: Point.ALLOC_EXTEND_SWA_TAIL,
    Op.FREE_SWA: Point.FREE_SWA,
    Op.FREE: Point.FREE_SWA,
    Op.SET_FULL_TO_SWA_MAPPING: Point.SET_FULL_TO_SWA_MAPPING,
    Op.CLEAR: Point.CLEAR,
    Op.REGISTER_MAPPING: Point.REGISTER_MAPPING,
}


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

    def terms(self) -> list[z3.ExprRef]:
        return [self.valid, self.addr, self.numel, *self.value, self.src, self.pool]

    def dropped(self) -> Cache:
        return dataclasses.replace(self, valid=z3.BoolVal(False))

    def ite(self, cond: z3.BoolRef, other: Cache) -> Cache:
        """Field-wise ``If(cond, self, other)``."""
        return Cache(*(z3.If(cond, x, y) for x, y in zip(self.terms()[:3], other.terms()[:3])),
                     tuple(z3.If(cond, x, y) for x, y in zip(self.value, other.value)),
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

    def terms(self) -> list[z3.ExprRef]:
        return [self.captured, self.recorded, self.addr, self.numel, *self.constant]


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

    @staticmethod
    def fresh(tag: str) -> State:
        t = f"@{tag}"

        def slots(name: str, make: Callable[[str], z3.ExprRef], reserved: z3.ExprRef) -> tuple:
            return tuple(reserved if x in RESERVED else make(f"{name}{x}{t}") for x in range(NF))

        return State(
            M=slots("M", z3.Int, z3.IntVal(0)),
            live=slots("live", z3.Bool, z3.BoolVal(False)),
            M2=slots("M2_", z3.Int, z3.IntVal(0)),
            cont=tuple(z3.Int(f"cont{a}{t}") for a in ADDRS),
            alive=tuple(z3.Bool(f"alive{a}{t}") for a in ADDRS),
            base=tuple(z3.Int(f"base{a}{t}") for a in ADDRS),
            used=tuple(z3.Bool(f"used{a}{t}") for a in ADDRS),
            caches=(Cache.fresh(f"_p0{t}"), Cache.fresh(f"_p1{t}")),
            quiet=(z3.Bool(f"quiet_p0{t}"), z3.Bool(f"quiet_p1{t}")),
            graph=Graph.fresh(t),
        )

    def terms(self) -> list[z3.ExprRef]:
        return [*self.M, *self.live, *self.M2, *self.cont, *self.alive, *self.base, *self.used,
                *self.caches[0].terms(), *self.caches[1].terms(), *self.quiet, *self.graph.terms()]


@dataclass(frozen=True)
class Action:
    """The op of one step and its arguments (unused ones are unconstrained)."""

    op: z3.ArithRef
    pool: z3.ArithRef  # translate / forward
    addr: z3.ArithRef  # a view's data_ptr, a storage base, a written element
    numel: z3.ArithRef  # a view's or a new storage's length
    data: tuple[z3.ArithRef, ...]  # new storage contents (per element), write_index's value (data[0])
    pick: tuple[z3.BoolRef, ...]  # the full slots a mutator touches (reserved: never)
    value: tuple[z3.ArithRef, ...]  # the new M value per picked slot

    @staticmethod
    def fresh(tag: str) -> Action:
        t = f"@{tag}"
        return Action(
            z3.Int(f"op{t}"), z3.Int(f"pool{t}"), z3.Int(f"addr{t}"), z3.Int(f"numel{t}"),
            tuple(z3.Int(f"data{a}{t}") for a in ADDRS),
            tuple(z3.BoolVal(False) if x in RESERVED else z3.Bool(f"pick{x}{t}") for x in range(NF)),
            tuple(z3.IntVal(0) if x in RESERVED else z3.Int(f"new_M{x}{t}") for x in range(NF)),
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
    return z3.And(-1 <= f, f < NF)


def _position(addr: z3.ArithRef, numel: z3.ArithRef) -> z3.BoolRef:
    """``numel`` elements from ``addr`` lie inside index memory, ``1 <= numel <= K``."""
    return z3.And(1 <= numel, numel <= K, 0 <= addr, addr + numel <= len(ADDRS))


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


def _invalidate(v: Variant, caches: tuple[Cache, Cache], point: Point, pool: z3.ArithRef | int = 0
                ) -> tuple[Cache, Cache]:
    """``_at(point)``: drop ``pool``'s cache if the policy has that point."""
    if point not in v.policy.points:
        return caches
    slot = _slot(v.policy, pool)
    return _put(caches, slot, _get(caches, slot).dropped())


def _translate(v: Variant, s: State, caches: tuple[Cache, Cache], label: str, pool: z3.ArithRef | int,
               addr: z3.ArithRef, numel: z3.ArithRef) -> tuple[tuple[Cache, Cache], Read]:
    """``translate_loc_from_full_to_swa`` through ``caches``: a hit returns the entry, a miss gathers and caches."""
    slot = _slot(v.policy, pool)
    cache = _get(caches, slot)
    key = cache_key(s, addr, v.policy.key_scheme)
    hit = _and(cache.valid, cache.addr == key, cache.numel == numel)
    contents = view_contents(s, addr, numel)
    fresh = fresh_of(s, pool, contents)
    if z3.is_false(hit):
        returned, src, owner = fresh, addr, pool
    else:
        returned = tuple(z3.If(hit, c, f) for c, f in zip(cache.value, fresh))
        src, owner = z3.If(hit, cache.src, addr), z3.If(hit, cache.pool, pool)
    filled = Cache(z3.BoolVal(True), key, numel, returned, src, z3.IntVal(owner) if isinstance(owner, int) else owner)
    read = Read(label, pool, addr, numel, contents, returned, fresh, hit)
    return _put(caches, slot, filled), read


def _rewrite(s: State) -> tuple[z3.BoolRef, z3.BoolRef]:
    """Index memory rewritten: both pools enter batch preparation."""
    return (z3.BoolVal(False), z3.BoolVal(False))


def _quiet_after_forward(s: State, pool: z3.ArithRef | int) -> tuple[z3.BoolRef, z3.BoolRef]:
    if isinstance(pool, int):
        return (z3.BoolVal(True), s.quiet[1]) if pool == 0 else (s.quiet[0], z3.BoolVal(True))
    return (z3.Or(s.quiet[0], pool == 0), z3.Or(s.quiet[1], pool == 1))


def _new_values(a: Action) -> list[z3.BoolRef]:
    return [z3.Implies(a.pick[x], z3.And(0 <= a.value[x], a.value[x] < M_BOUND)) for x in REAL_SLOTS]


# ---- transitions ----------------------------------------------------------------------------


def _op_translate(v: Variant, s: State, a: Action) -> Effect:
    e1 = [z3.If(a.pool == 0, s.quiet[0], s.quiet[1])] if v.e1 else []
    caches, read = _translate(v, s, s.caches, "translate", a.pool, a.addr, a.numel)
    guard = z3.And(z3.Or(a.pool == 0, a.pool == 1), view_ok(s, a.addr, a.numel), *e1,
                   *[in_slot_range(c) for c in read.contents])
    return Effect(guard, dataclasses.replace(s, caches=caches), (read,))


def _writable(s: State, contents: Sequence[z3.ArithRef], numel: z3.ArithRef) -> list[z3.BoolRef]:
    """``set_kv_buffer``'s check: live slots, or 0 for padding tokens, no slot twice."""
    live = [z3.Or(c == 0, _sel(s.live, c, z3.BoolVal(False))) for c in contents]
    distinct = [z3.Implies(z3.And(j < numel, contents[i] != 0), contents[i] != contents[j])
                for i in range(K) for j in range(i + 1, K)]
    return [*live, *distinct]


def _op_forward(v: Variant, s: State, a: Action) -> Effect:
    """Pool 0's loc holds live slots or padding; pool 1's allocator is not modelled (any slot)."""
    caches = _invalidate(v, s.caches, Point.FORWARD, a.pool)
    caches, read = _translate(v, s, caches, "forward", a.pool, a.addr, a.numel)
    guard = z3.And(z3.Or(a.pool == 0, a.pool == 1), view_ok(s, a.addr, a.numel),
                   *[in_slot_range(c) for c in read.contents],
                   z3.Implies(a.pool == 0, z3.And(_writable(s, read.contents, a.numel))))
    return Effect(guard, dataclasses.replace(s, caches=caches, quiet=_quiet_after_forward(s, a.pool)), (read,))


def _op_capture(v: Variant, s: State, a: Action) -> Effect:
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


def _op_replay(v: Variant, s: State, a: Action) -> Effect:
    g = s.graph
    caches = _invalidate(v, s.caches, Point.FORWARD) if v.replay_invalidates else s.caches
    contents = view_contents(s, g.addr, g.numel)
    fresh = fresh_of(s, 0, contents)
    returned = tuple(z3.If(g.recorded, f, c) for f, c in zip(fresh, g.constant))
    read = Read("replay", 0, g.addr, g.numel, contents, returned, fresh, z3.Not(g.recorded))
    guard = z3.And(g.captured, view_ok(s, g.addr, g.numel), *_writable(s, contents, g.numel))
    quiet = (z3.BoolVal(True), s.quiet[1])
    return Effect(guard, dataclasses.replace(s, caches=caches, quiet=quiet), (read,))


def _op_new_storage(v: Variant, s: State, a: Action) -> Effect:
    inside = [z3.And(a.addr <= x, x < a.addr + a.numel) for x in ADDRS]
    reuse = z3.Or([z3.And(inside[x], s.used[x]) for x in ADDRS])
    guard = z3.And(1 <= a.numel, 0 <= a.addr, a.addr + a.numel <= len(ADDRS),
                   *[z3.Implies(inside[x], z3.Not(s.alive[x])) for x in ADDRS],
                   *[z3.Implies(x < a.numel, in_slot_range(a.data[x])) for x in ADDRS])
    post = dataclasses.replace(
        s,
        cont=tuple(z3.If(inside[x], _sel(a.data, x - a.addr, z3.IntVal(0)), s.cont[x]) for x in ADDRS),
        alive=tuple(z3.Or(s.alive[x], inside[x]) for x in ADDRS),
        base=tuple(z3.If(inside[x], a.addr, s.base[x]) for x in ADDRS),
        used=tuple(z3.Or(s.used[x], inside[x]) for x in ADDRS),
        quiet=(z3.And(s.quiet[0], z3.Not(reuse)), z3.And(s.quiet[1], z3.Not(reuse))),
    )
    return Effect(guard, post)


def _op_free_storage(v: Variant, s: State, a: Action) -> Effect:
    guard = z3.And(_sel(s.alive, a.addr, z3.BoolVal(False)), _sel(s.base, a.addr, z3.IntVal(-1)) == a.addr)
    alive = tuple(z3.And(s.alive[x], s.base[x] != a.addr) for x in ADDRS)
    return Effect(guard, dataclasses.replace(s, alive=alive))


def _op_write_index(v: Variant, s: State, a: Action) -> Effect:
    guard = z3.And(z3.BoolVal(v.in_place_writes), _sel(s.alive, a.addr, z3.BoolVal(False)), in_slot_range(a.data[0]))
    cont = tuple(z3.If(a.addr == x, a.data[0], s.cont[x]) for x in ADDRS)
    return Effect(guard, dataclasses.replace(s, cont=cont, quiet=_rewrite(s)))


def _hand_out(s: State, a: Action, caches: tuple[Cache, Cache], free_only: bool = True) -> tuple[z3.BoolRef, State]:
    """Some free slots become live with new M values."""
    guard = z3.And(*[z3.Implies(a.pick[x], z3.Not(s.live[x])) for x in REAL_SLOTS if free_only], *_new_values(a))
    post = dataclasses.replace(
        s, caches=caches,
        M=tuple(s.M[x] if x in RESERVED else z3.If(a.pick[x], a.value[x], s.M[x]) for x in range(NF)),
        live=tuple(s.live[x] if x in RESERVED else z3.Or(s.live[x], a.pick[x]) for x in range(NF)),
    )
    return guard, post


def _op_alloc(point: Point) -> Callable[[Variant, State, Action], Effect]:
    def effect(v: Variant, s: State, a: Action) -> Effect:
        guard, post = _hand_out(s, a, _invalidate(v, s.caches, point))
        return Effect(guard, post)

    return effect


def _op_alloc_last_loc(point: Point, label: str) -> Callable[[Variant, State, Action], Effect]:
    """``alloc_extend`` / ``alloc_decode``: point, translate ``last_loc`` (C4), then the M write."""

    def effect(v: Variant, s: State, a: Action) -> Effect:
        caches, read = _translate(v, s, _invalidate(v, s.caches, point), label, 0, a.addr, a.numel)
        last = [z3.Implies(i < a.numel, z3.Or(c == -1, _sel(s.live, c, z3.BoolVal(False))))
                for i, c in enumerate(read.contents)]
        guard, post = _hand_out(s, a, caches, free_only=v.c4_disjoint)
        return Effect(z3.And(view_ok(s, a.addr, a.numel), *last, guard), post, (read,))

    return effect


def _zero(s: State, a: Action) -> tuple[z3.ArithRef, ...]:
    return tuple(s.M[x] if x in RESERVED else z3.If(a.pick[x], 0, s.M[x]) for x in range(NF))


def _release(s: State, a: Action) -> tuple[z3.BoolRef, ...]:
    return tuple(s.live[x] if x in RESERVED else z3.And(s.live[x], z3.Not(a.pick[x])) for x in range(NF))


def _picks_live(s: State, a: Action) -> list[z3.BoolRef]:
    return [z3.Implies(a.pick[x], s.live[x]) for x in REAL_SLOTS]


def _op_free_swa(v: Variant, s: State, a: Action) -> Effect:
    """Some slots get M = 0 (whole pages in the reference, live or not); liveness unchanged."""
    caches = _invalidate(v, s.caches, Point.FREE_SWA)
    return Effect(z3.BoolVal(True), dataclasses.replace(s, caches=caches, M=_zero(s, a)))


def _op_free(v: Variant, s: State, a: Action) -> Effect:
    """``free`` = ``free_swa``'s point, M = 0 and the slots freed."""
    caches = _invalidate(v, s.caches, Point.FREE_SWA)
    return Effect(z3.And(*_picks_live(s, a)), dataclasses.replace(s, caches=caches, M=_zero(s, a), live=_release(s, a)))


def _op_free_full(v: Variant, s: State, a: Action) -> Effect:
    """No point: frees live slots whose SWA side is released (M = 0); the twin also zeroes M."""
    if v.free_full_writes_mapping:
        return Effect(z3.And(*_picks_live(s, a)), dataclasses.replace(s, M=_zero(s, a), live=_release(s, a)))
    guard = z3.And(*[z3.Implies(a.pick[x], z3.And(s.live[x], s.M[x] == 0)) for x in REAL_SLOTS])
    return Effect(guard, dataclasses.replace(s, live=_release(s, a)))


def _op_set_mapping(v: Variant, s: State, a: Action) -> Effect:
    """A non-empty call: some live slots get new values (an empty call changes nothing)."""
    caches = _invalidate(v, s.caches, Point.SET_FULL_TO_SWA_MAPPING)
    guard = z3.And(z3.Or([a.pick[x] for x in REAL_SLOTS]), *_picks_live(s, a), *_new_values(a))
    M = tuple(s.M[x] if x in RESERVED else z3.If(a.pick[x], a.value[x], s.M[x]) for x in range(NF))
    return Effect(guard, dataclasses.replace(s, caches=caches, M=M))


def _op_reset(point: Point) -> Callable[[Variant, State, Action], Effect]:
    """``clear`` / ``register_mapping``: every slot free, M all 0."""

    def effect(v: Variant, s: State, a: Action) -> Effect:
        post = dataclasses.replace(
            s, caches=_invalidate(v, s.caches, point),
            M=tuple(z3.IntVal(0) for _ in range(NF)), live=tuple(z3.BoolVal(False) for _ in range(NF)))
        return Effect(z3.BoolVal(True), post)

    return effect


def _op_restore_state(v: Variant, s: State, a: Action) -> Effect:
    """No point: liveness rolls back to a backup (any liveness); the twin rolls M back too."""
    live = tuple(s.live[x] if x in RESERVED else a.pick[x] for x in range(NF))
    if v.restore_writes_mapping:
        M = tuple(s.M[x] if x in RESERVED else a.value[x] for x in range(NF))
        return Effect(z3.And(*[z3.And(0 <= a.value[x], a.value[x] < M_BOUND) for x in REAL_SLOTS]),
                      dataclasses.replace(s, live=live, M=M))
    return Effect(z3.BoolVal(True), dataclasses.replace(s, live=live))


_EFFECTS: dict[Op, Callable[[Variant, State, Action], Effect]] = {
    Op.TRANSLATE: _op_translate,
    Op.FORWARD: _op_forward,
    Op.CAPTURE: _op_capture,
    Op.REPLAY: _op_replay,
    Op.NEW_STORAGE: _op_new_storage,
    Op.FREE_STORAGE: _op_free_storage,
    Op.WRITE_INDEX: _op_write_index,
    Op.ALLOC: _op_alloc(Point.ALLOC),
    Op.ALLOC_EXTEND: _op_alloc_last_loc(Point.ALLOC_EXTEND, "alloc_extend"),
    Op.ALLOC_DECODE: _op_alloc_last_loc(Point.ALLOC_DECODE, "alloc_decode"),
    Op.ALLOC_EXTEND_SWA_TAIL: _op_alloc(Point.ALLOC_EXTEND_SWA_TAIL),
    Op.FREE_SWA: _op_free_swa,
    Op.FREE: _op_free,
    Op.FREE_FULL: _op_free_full,
    Op.SET_FULL_TO_SWA_MAPPING: _op_set_mapping,
    Op.CLEAR: _op_reset(Point.CLEAR),
    Op.REGISTER_MAPPING: _op_reset(Point.REGISTER_MAPPING),
    Op.RESTORE_STATE: _op_restore_state,
}


def effects(s: State, a: Action, v: Variant = UPSTREAM, ops: Sequence[Op] = tuple(Op)) -> dict[Op, Effect]:
    return {op: _EFFECTS[op](v, s, a) for op in ops}


def transition(eff: dict[Op, Effect], s: State, a: Action, t: State) -> z3.BoolRef:
    """``t`` is the post-state of the op ``a.op``, enabled in ``s``, among the ops of ``eff``."""
    enabled = z3.Or([z3.And(a.op == op, e.guard) for op, e in eff.items()])
    posts = {op: e.post.terms() for op, e in eff.items()}
    frame = []
    for i, (pre, post) in enumerate(zip(s.terms(), t.terms())):
        if z3.is_const(post) and post.decl().kind() != z3.Z3_OP_UNINTERPRETED:
            continue  # a reserved-slot constant
        value: z3.ExprRef = pre
        for op in reversed(list(eff)):
            new = posts[op][i]
            if not new.eq(pre):
                value = z3.If(a.op == op, new, value)
        frame.append(post == value)
    return z3.And(enabled, *frame)


def stale_read(eff: dict[Op, Effect], a: Action) -> z3.BoolRef:
    """Some translation of the step returns something other than ``M[contents]``."""
    return z3.Or([z3.And(a.op == op, z3.Or([r.stale for r in e.reads])) for op, e in eff.items() if e.reads])


def step(s: State, a: Action, t: State, v: Variant = UPSTREAM, ops: Sequence[Op] = tuple(Op)) -> z3.BoolRef:
    """One transition among ``ops``."""
    return transition(effects(s, a, v, ops), s, a, t)


def stale(s: State, a: Action, v: Variant = UPSTREAM, ops: Sequence[Op] = tuple(Op)) -> z3.BoolRef:
    """The step ``(s, a)`` (among ``ops``) reads a stale translation."""
    return stale_read(effects(s, a, v, ops), a)


# ---- init and the inductive invariant ---------------------------------------------------------


def init(s: State, cache_empty: bool = True) -> z3.BoolRef:
    """``initial_system``: M all 0, nothing live, no index memory, caches empty, quiet, nothing captured.

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
    )


def entry_fresh(s: State, pool: int) -> z3.BoolRef:
    """C1 for pool ``pool``'s cache: its key is a view of allocated memory whose translation it holds."""
    c = s.caches[pool]
    elems = [z3.Implies(i < c.numel, z3.And(
        _sel(s.used, c.addr + i, z3.BoolVal(False)),
        c.value[i] == _mapping_of(s, pool, _sel(s.cont, c.addr + i, z3.IntVal(0))))) for i in range(K)]
    return z3.And(_position(c.addr, c.numel), *elems)


def wellformed_clauses(s: State) -> list[tuple[str, z3.BoolRef]]:
    """Value ranges and storage shape: inductive, not needed by the proof, but they keep counterexamples readable."""
    clauses = [(f"M1: M[{x}] and M2[{x}] in [0, {M_BOUND})",
                z3.And(0 <= s.M[x], s.M[x] < M_BOUND, 0 <= s.M2[x], s.M2[x] < M_BOUND)) for x in REAL_SLOTS]
    for x in ADDRS:
        clauses.append((f"memory: element {byte_address(x)}, once allocated, holds -1 or a full slot",
                        z3.Implies(s.used[x], in_slot_range(s.cont[x]))))
        clauses.append((f"memory: live element {byte_address(x)} was allocated, in a storage starting at or before it",
                        z3.Implies(s.alive[x], z3.And(s.used[x], 0 <= s.base[x], s.base[x] <= x))))
    for p in (0, 1):
        c = s.caches[p]
        clauses.append((f"pool {p}'s cache key is a view position", z3.Implies(c.valid, _position(c.addr, c.numel))))
    clauses.append(("the captured graph's static buffer is a view position",
                    z3.Implies(s.graph.captured, _position(s.graph.addr, s.graph.numel))))
    return clauses


def invariant_clauses(s: State) -> list[tuple[str, z3.BoolRef]]:
    """The inductive invariant of the upstream policy under E1 (C1, C3, well-formedness), each clause named."""
    clauses = []
    for p in (0, 1):
        mapping = "M" if p == 0 else "M2"
        clauses.append((f"C1: pool {p} quiet and its cache valid => the entry is {mapping}[contents at key]",
                        z3.Implies(z3.And(s.quiet[p], s.caches[p].valid), entry_fresh(s, p))))
    clauses.append(("C3: a captured graph recorded its gather", z3.Implies(s.graph.captured, s.graph.recorded)))
    return clauses + wellformed_clauses(s)


def invariant(s: State) -> z3.BoolRef:
    return z3.And([c for _, c in invariant_clauses(s)])


# ---- rendering ------------------------------------------------------------------------------


def _ints(model: z3.ModelRef, terms: Sequence[z3.ArithRef], n: int) -> list[int]:
    return [as_int(model, x) for x in terms[:n]]


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
    storages: dict[int, list[int]] = {}
    for x in ADDRS:
        if as_bool(model, s.alive[x]):
            storages.setdefault(as_int(model, s.base[x]), []).append(as_int(model, s.cont[x]))
    return " ".join(f"@{byte_address(b)}={c}" for b, c in sorted(storages.items())) or "-"


def _mapping_text(model: z3.ModelRef, s: State) -> str:
    cells = []
    for x in REAL_SLOTS:
        m, live = as_int(model, s.M[x]), as_bool(model, s.live[x])
        if m or live:
            cells.append(f"{x}->{m}{'*' if live else ''}")
    return " ".join(cells) or "-"


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


def _picked(model: z3.ModelRef, a: Action) -> list[int]:
    return [x for x in REAL_SLOTS if as_bool(model, a.pick[x])]


def _describe(model: z3.ModelRef, s: State, a: Action, v: Variant, eff: dict[Op, Effect]) -> tuple[Op, str, str]:
    """``(op, call, reads)`` of one step."""
    op = Op(as_int(model, a.op))
    reads = eff[op].reads
    picked = _picked(model, a)

    def new_m() -> str:
        return ", ".join(f"M[{x}]={as_int(model, a.value[x])}" for x in picked) or "no slot"

    if op in (Op.TRANSLATE, Op.FORWARD):
        pool = as_int(model, a.pool)
        call = f"{op.call}({_view(model, a.addr, a.numel, reads[0].contents)}{', pool 1' if pool else ''})"
    elif op is Op.CAPTURE:
        runs = "/".join("hit" if as_bool(model, r.hit) else "miss" for r in reads)
        call = f"capture(static {_view(model, a.addr, a.numel, reads[0].contents)}): run_once x{RUNS} {runs}"
        g = eff[op].post.graph
        call += f" -> recorded_gather={as_bool(model, g.recorded)}"
        if not as_bool(model, g.recorded):
            call += f", constant {_ints(model, g.constant, as_int(model, a.numel))}"
    elif op is Op.REPLAY:
        call = f"replay(static {_view(model, s.graph.addr, s.graph.numel, reads[0].contents)})"
    elif op is Op.NEW_STORAGE:
        n, addr = as_int(model, a.numel), as_int(model, a.addr)
        reuse = any(as_bool(model, s.used[x]) for x in range(addr, addr + n))
        call = f"new_storage(base {byte_address(addr)}, {_ints(model, a.data, n)})"
        call += " reuses a freed address" if reuse else ""
    elif op is Op.FREE_STORAGE:
        call = f"free_storage(base {byte_address(as_int(model, a.addr))})"
    elif op is Op.WRITE_INDEX:
        call = f"write_index(@{byte_address(as_int(model, a.addr))} := {as_int(model, a.data[0])})"
    elif op in (Op.ALLOC, Op.ALLOC_EXTEND_SWA_TAIL):
        call = f"{op.call}() -> {new_m()}"
    elif op in (Op.ALLOC_EXTEND, Op.ALLOC_DECODE):
        call = f"{op.call}(last_loc {_view(model, a.addr, a.numel, reads[0].contents)}) -> {new_m()}"
    elif op in (Op.FREE_SWA, Op.FREE, Op.FREE_FULL):
        call = f"{op.call}({picked})"
    elif op is Op.SET_FULL_TO_SWA_MAPPING:
        call = f"{op.call}({picked}, {[as_int(model, a.value[x]) for x in picked]})"
    elif op is Op.RESTORE_STATE:
        call = f"restore_state() -> live slots {picked}"
        if v.restore_writes_mapping:
            call += f", M rolled back to {[as_int(model, a.value[x]) for x in REAL_SLOTS]}"
    else:
        call = f"{op.call}()"
    point = POINT_OF.get(op)
    if point is not None and point not in v.policy.points:
        call += f" [point {point.value} removed: no invalidation]"
    return op, call, "; ".join(f"{r.label}: {_read_text(model, r)}" for r in reads)


@dataclass(frozen=True)
class TraceRow:
    """One rendered step: the call, its reads, and the state after it."""

    step: int
    op: str
    call: str
    reads: str
    phase: str
    cache: str
    memory: str
    mapping: str


@dataclass(frozen=True)
class Trace:
    rows: tuple[TraceRow, ...]
    violation: str = ""

    HEADER = ("step", "op(arguments)", "translations: returned vs fresh", "phase", "cache key -> value",
              "index memory", "M (* = live)")

    def ops(self) -> list[str]:
        return [row.op for row in self.rows]

    def table(self) -> str:
        cells = [self.HEADER] + [(str(r.step), r.call, r.reads or "-", r.phase, r.cache, r.memory, r.mapping)
                                 for r in self.rows]
        widths = [max(len(row[i]) for row in cells) for i in range(len(self.HEADER))]
        lines = [" | ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
        lines.insert(1, "-+-".join("-" * w for w in widths))
        return "\n".join(lines + ([self.violation] if self.violation else []))


def _phase(model: z3.ModelRef, s: State, v: Variant) -> str:
    """Pool 0's E1 phase, and pool 1's where it differs and pool 1 has a cache entry."""
    q0, q1 = (as_bool(model, q) for q in s.quiet)
    text = "quiet" if q0 else "batch prep"
    shown = not v.policy.shared_across_pools and as_bool(model, s.caches[1].valid)
    return f"{text} (pool 1 {'quiet' if q1 else 'batch prep'})" if shown and q0 != q1 else text


def _row(model: z3.ModelRef, t: State, n: int, op: str, call: str, reads: str, v: Variant) -> TraceRow:
    return TraceRow(n, op, call, reads, _phase(model, t, v), _cache_text(model, t, v), _memory_text(model, t),
                    _mapping_text(model, t))


@dataclass(frozen=True)
class Search:
    """Which runs a BMC query explores: a subset of the same transition relation.

    Counterexamples only need *some* run, so a twin may narrow the search to the ops
    and choices its witness in ``tests/reference/test_loc_cache.py`` uses: fewer ops,
    pool 0 only, ``M`` handed out 1:1 (SWA slot = full slot, as the witnesses' first
    allocations are), and translations of real slots (no -1). Every run found is a run
    of the full model.
    """

    ops: tuple[Op, ...] = tuple(Op)
    pools: tuple[int, ...] = (0, 1)
    one_to_one: bool = False  # allocations map each new slot x to SWA slot x
    real_slots_read: bool = False  # translate / forward / replay views hold real slots or padding (0), no -1
    max_storage: int = len(ADDRS)  # elements of a new storage
    max_view: int = K  # elements of a translated view

    def facts(self, s: State, a: Action) -> list[z3.BoolRef]:
        out = [z3.Or([a.op == op for op in self.ops])]
        if self.pools != (0, 1):
            out.append(z3.Implies(z3.Or(a.op == Op.TRANSLATE, a.op == Op.FORWARD),
                                  z3.Or([a.pool == p for p in self.pools])))
        if self.one_to_one:
            allocating = z3.Or([a.op == op for op in (Op.ALLOC, Op.ALLOC_EXTEND, Op.ALLOC_DECODE,
                                                      Op.ALLOC_EXTEND_SWA_TAIL)])
            out += [z3.Implies(z3.And(allocating, a.pick[x]), a.value[x] == x) for x in REAL_SLOTS]
            out += [z3.Implies(z3.And(a.op == Op.SET_FULL_TO_SWA_MAPPING, a.pick[x]),
                               z3.And(a.value[x] >= RESERVED[-1] + 1, a.value[x] < NF)) for x in REAL_SLOTS]
        if self.real_slots_read:
            def real(c: z3.ArithRef) -> z3.BoolRef:
                return z3.Or(c == 0, c > RESERVED[-1])

            reading = z3.Or(a.op == Op.TRANSLATE, a.op == Op.FORWARD)
            out += [z3.Implies(reading, real(c)) for c in view_contents(s, a.addr, a.numel)]
            out += [z3.Implies(a.op == Op.REPLAY, real(c)) for c in view_contents(s, s.graph.addr, s.graph.numel)]
            out += [z3.Implies(a.op == Op.NEW_STORAGE, z3.Or(real(c), c == -1)) for c in a.data]
            out.append(z3.Implies(a.op == Op.WRITE_INDEX, real(a.data[0])))
        if self.max_storage < len(ADDRS):
            out.append(z3.Implies(a.op == Op.NEW_STORAGE, a.numel <= self.max_storage))
        if self.max_view < K:
            views = (Op.TRANSLATE, Op.FORWARD, Op.CAPTURE, Op.ALLOC_EXTEND, Op.ALLOC_DECODE)
            out.append(z3.Implies(z3.Or([a.op == op for op in views]), a.numel <= self.max_view))
        return out


EVERYTHING = Search()


@dataclass(frozen=True)
class Unrolling:
    """``depth`` steps from ``init``: states ``s_0..s_depth`` and actions."""

    states: tuple[State, ...]
    actions: tuple[Action, ...]

    @staticmethod
    def fresh(depth: int) -> Unrolling:
        return Unrolling(tuple(State.fresh(str(i)) for i in range(depth + 1)),
                         tuple(Action.fresh(str(i)) for i in range(depth)))

    def effects(self, i: int, v: Variant, ops: Sequence[Op] = tuple(Op)) -> dict[Op, Effect]:
        return effects(self.states[i], self.actions[i], v, ops)

    def step_facts(self, i: int, v: Variant, search: Search, eff: dict[Op, Effect]) -> list[z3.BoolRef]:
        s, a, t = self.states[i], self.actions[i], self.states[i + 1]
        return [transition(eff, s, a, t), *search.facts(s, a)]

    def path(self, v: Variant, search: Search = EVERYTHING) -> list[z3.BoolRef]:
        facts = [init(self.states[0])]
        for i in range(len(self.actions)):
            facts += self.step_facts(i, v, search, self.effects(i, v, search.ops))
        return facts


@dataclass(frozen=True)
class Target:
    """What a BMC query looks for in a step, given the step's effects."""

    bad: Callable[[dict[Op, Effect], Action], z3.BoolRef]
    what: str


def _replay_stale(eff: dict[Op, Effect], a: Action) -> z3.BoolRef:
    if Op.REPLAY not in eff:
        return z3.BoolVal(False)
    return z3.And(a.op == Op.REPLAY, stale_read({Op.REPLAY: eff[Op.REPLAY]}, a))


STALE = Target(stale_read, "stale read")
REPLAY_STALE = Target(_replay_stale, "stale replay")
NEVER = Target(lambda eff, a: z3.BoolVal(False), "")


def _explain(model: z3.ModelRef, eff: dict[Op, Effect], a: Action, n: int) -> str:
    op = Op(as_int(model, a.op))
    for r in eff[op].reads:
        if as_bool(model, r.stale):
            k = as_int(model, r.numel)
            got, fresh, cont = _ints(model, r.returned, k), _ints(model, r.fresh, k), _ints(model, r.contents, k)
            pool = r.pool if isinstance(r.pool, int) else as_int(model, r.pool)
            return (f"step {n}: {op.call} ({r.label}) of @{byte_address(as_int(model, r.addr))} = {cont} "
                    f"returned {got}, but M{'2' if pool else ''}{cont} = {fresh}: stale read")
    return f"step {n}: stale read"


def trace_of(model: z3.ModelRef, v: Variant, target: Target = STALE) -> Trace:
    """The concrete run in a BMC model, up to the first step where ``target`` holds."""
    u = Unrolling.fresh(sum(1 for d in model.decls() if d.name().startswith("op@")))
    rows = [_row(model, u.states[0], 0, "init", "init", "", v)]
    for i, a in enumerate(u.actions):
        s, t = u.states[i], u.states[i + 1]
        eff = u.effects(i, v, (Op(as_int(model, a.op)),))
        op, call, reads = _describe(model, s, a, v, eff)
        rows.append(_row(model, t, i + 1, op.call, call, reads, v))
        if as_bool(model, target.bad(eff, a)):
            return Trace(tuple(rows), _explain(model, eff, a, i + 1))
    return Trace(tuple(rows))


def shortest_bmc(v: Variant, target: Target = STALE, search: Search = EVERYTHING, max_depth: int = MAX_DEPTH,
                 timeout_ms: int = 20_000) -> list[z3.BoolRef]:
    """Iterative deepening: the facts of the shortest run (<= ``max_depth`` steps) whose last step hits ``target``.

    One incremental solver extends the path a step at a time. When no depth is
    satisfiable the deepest facts come back and ``run`` reports them proved
    (contradicting a twin's expectation).
    """
    u = Unrolling.fresh(max_depth)
    facts = [init(u.states[0])]
    solver = z3.Solver()
    solver.set(timeout=timeout_ms)
    solver.add(*facts)
    bad: z3.BoolRef = z3.BoolVal(False)
    for i in range(max_depth):
        eff = u.effects(i, v, search.ops)
        step_facts = u.step_facts(i, v, search, eff)
        facts += step_facts
        solver.add(*step_facts)
        bad = target.bad(eff, u.actions[i])
        solver.push()
        solver.add(bad)
        verdict = solver.check()
        solver.pop()
        if verdict != z3.unsat:  # sat, or unknown: run() re-checks and reports it
            break
    return [*facts, bad]


def find_trace(v: Variant, target: Target = STALE, search: Search = EVERYTHING,
               max_depth: int = MAX_DEPTH) -> Trace | None:
    """The shortest run of ``v`` (within ``search``) reaching ``target`` in ``max_depth`` steps, or None."""
    solver = z3.Solver()
    solver.add(*shortest_bmc(v, target, search, max_depth))
    if solver.check() != z3.sat:
        return None
    return trace_of(solver.model(), v, target)


def witness(v: Variant, ops: Sequence[Op], *, fresh_reads: bool = True, changes: bool = False) -> Trace | None:
    """A run of ``v`` performing exactly ``ops`` from the initial state (non-vacuity), or None.

    With ``fresh_reads`` every translation of the run must be fresh; with ``changes``
    every step must change the state.
    """
    u = Unrolling.fresh(len(ops))
    solver = z3.Solver()
    solver.add(init(u.states[0]))
    for i, op in enumerate(ops):
        eff = u.effects(i, v, (op,))
        solver.add(*u.step_facts(i, v, EVERYTHING, eff), u.actions[i].op == op)
        if fresh_reads:
            solver.add(z3.Not(stale_read(eff, u.actions[i])))
        if changes:
            pre, post = u.states[i].terms(), u.states[i + 1].terms()
            solver.add(z3.Or([x != y for x, y in zip(pre, post) if not x.eq(y)]))
    if solver.check() != z3.sat:
        return None
    return trace_of(solver.model(), v, NEVER)


# ---- the inductive proof ----------------------------------------------------------------------


def _one_step() -> tuple[State, Action, State]:
    return State.fresh("pre"), Action.fresh("step"), State.fresh("post")


def _first_broken(model: z3.ModelRef, s: State) -> str:
    broken = [name for name, clause in invariant_clauses(s) if not as_bool(model, clause)]
    return broken[0] if broken else "(no clause broken)"


def _build_initiation(cache_empty: bool) -> Callable[[], list[z3.BoolRef]]:
    def build() -> list[z3.BoolRef]:
        s = State.fresh("0")
        return [init(s, cache_empty), z3.Not(invariant(s))]

    return build


def _render_initiation(model: z3.ModelRef) -> str:
    s = State.fresh("0")
    row = _row(model, s, 0, "init", "init", "", UPSTREAM)
    return Trace((row,), f"broken: {_first_broken(model, s)}").table()


def _build_consecution(v: Variant, ops: Sequence[Op] = tuple(Op)) -> Callable[[], list[z3.BoolRef]]:
    def build() -> list[z3.BoolRef]:
        s, a, t = _one_step()
        return [invariant(s), step(s, a, t, v, ops), z3.Not(invariant(t))]

    return build


def _build_safety(v: Variant) -> Callable[[], list[z3.BoolRef]]:
    def build() -> list[z3.BoolRef]:
        s, a, t = _one_step()
        return [invariant(s), step(s, a, t, v), stale(s, a, v)]

    return build


def _render_step(v: Variant, *, safety: bool) -> Callable[[z3.ModelRef], str]:
    def render(model: z3.ModelRef) -> str:
        s, a, t = _one_step()
        eff = effects(s, a, v, (Op(as_int(model, a.op)),))
        op, call, reads = _describe(model, s, a, v, eff)
        rows = (_row(model, s, 0, "(any invariant state)", "(any invariant state)", "", v),
                _row(model, t, 1, op.call, call, reads, v))
        verdict = _explain(model, eff, a, 1) if safety else f"broken after step 1: {_first_broken(model, t)}"
        return Trace(rows, verdict).table()

    return render


def _build_c4(v: Variant) -> Callable[[], list[z3.BoolRef]]:
    """Any (well-formed) pre-state, any phase and cache; after ``alloc_extend`` / ``alloc_decode`` pool 0's
    entry is ``M_new[last_loc]``."""

    def build() -> list[z3.BoolRef]:
        s, a, t = _one_step()
        refilled = z3.And(t.caches[0].valid, t.caches[0].addr == a.addr, t.caches[0].numel == a.numel)
        fresh = [z3.Implies(i < a.numel, t.caches[0].value[i] == f)
                 for i, f in enumerate(fresh_of(t, 0, view_contents(t, a.addr, a.numel)))]
        wellformed = [c for _, c in wellformed_clauses(s)]
        return [*wellformed, step(s, a, t, v, (Op.ALLOC_EXTEND, Op.ALLOC_DECODE)), z3.Not(z3.And(refilled, *fresh))]

    return build


def _render_c4(v: Variant) -> Callable[[z3.ModelRef], str]:
    def render(model: z3.ModelRef) -> str:
        s, a, t = _one_step()
        op, call, reads = _describe(model, s, a, v, effects(s, a, v, (Op(as_int(model, a.op)),)))
        rows = (_row(model, s, 0, "(any state)", "(any well-formed state)", "", v),
                _row(model, t, 1, op.call, call, reads, v))
        n = as_int(model, a.numel)
        cont = _ints(model, view_contents(t, a.addr, a.numel), n)
        verdict = (f"after step 1 the cache holds {_ints(model, t.caches[0].value, n)} for last_loc {cont}, "
                   f"but M{cont} = {_ints(model, fresh_of(t, 0, view_contents(t, a.addr, a.numel)), n)}: "
                   "the mutator wrote M on a last_loc slot after the refill")
        return Trace(rows, verdict).table()

    return render


# ---- obligations ----------------------------------------------------------------------------

NAME = "loc_cache.no_stale_read"
INSTANCE = f"bounded instance: {NF} full slots, {len(ADDRS)} index elements, views of <= {K} elements, 2 pools"


def _obligation(name: str, statement: str, expect: Expect, build: Callable[[], list[z3.BoolRef]],
                render: Callable[[z3.ModelRef], str], twin_of: str | None = None) -> Obligation:
    return Obligation(name, COMPONENT, FAMILY, statement, expect, build, render, twin_of)


def _bmc(name: str, statement: str, v: Variant, twin_of: str, search: Search,
         target: Target = STALE) -> Obligation:
    return _obligation(name, statement, "counterexample", lambda: shortest_bmc(v, target, search),
                       lambda model: trace_of(model, v, target).table(), twin_of=twin_of)


#: The ops every witness trace sets up with: index memory, translations, forwards, allocations.
SETUP = (Op.NEW_STORAGE, Op.FREE_STORAGE, Op.WRITE_INDEX, Op.TRANSLATE, Op.FORWARD, Op.ALLOC)
#: Ops beyond SETUP that the trace without a point uses: the op that passes the point (capture adds replay).
POINT_OPS: dict[Point, tuple[Op, ...]] = {
    Point.ALLOC: (),
    Point.ALLOC_EXTEND: (Op.ALLOC_EXTEND,),
    Point.ALLOC_EXTEND_SWA_TAIL: (Op.ALLOC_EXTEND_SWA_TAIL,),
    Point.ALLOC_DECODE: (Op.ALLOC_DECODE,),
    Point.FREE_SWA: (Op.FREE_SWA,),
    Point.SET_FULL_TO_SWA_MAPPING: (Op.SET_FULL_TO_SWA_MAPPING,),
    Point.CLEAR: (Op.CLEAR,),
    Point.REGISTER_MAPPING: (Op.REGISTER_MAPPING,),
    Point.FORWARD: (),
    Point.RUN_ONCE: (Op.CAPTURE, Op.REPLAY),
}


def witness_search(*extra: Op, pools: tuple[int, ...] = (0,), max_storage: int = 1) -> Search:
    """Runs like the reference witnesses: SETUP plus ``extra``, 1:1 allocations, one-element views."""
    return Search(ops=SETUP + extra, pools=pools, one_to_one=True, real_slots_read=True, max_storage=max_storage,
                  max_view=1)


def _without(point: Point) -> Obligation:
    return _bmc(f"{NAME}.without_{point.value}",
                f"upstream policy without the {point.value} invalidation point: a run of <= {MAX_DEPTH} steps "
                "respecting E1 reads a stale translation (BMC, iterative deepening)",
                Variant(policy=Policy().without(point)), f"{NAME}.consecution", witness_search(*POINT_OPS[point]))


FREE_FULL_WRITES_M = Variant(free_full_writes_mapping=True)
RESTORE_WRITES_M = Variant(restore_writes_mapping=True)
C4_OVERLAP = Variant(c4_disjoint=False)

OBLIGATIONS: tuple[Obligation, ...] = (
    _obligation(
        f"{NAME}.initiation",
        f"loc_cache ({INSTANCE}): initial_system satisfies the invariant C1 (a quiet pool's valid entry equals "
        "its M over the contents at its key) and C3 (a captured graph recorded its gather)",
        "proved", _build_initiation(True), _render_initiation,
    ),
    _obligation(
        f"{NAME}.initiation.cache_survives",
        "a pool that starts with a left-over cache entry (register_mapping without its invalidation, #25889) "
        "starts outside C1",
        "counterexample", _build_initiation(False), _render_initiation, twin_of=f"{NAME}.initiation",
    ),
    _obligation(
        f"{NAME}.consecution",
        f"loc_cache ({INSTANCE}), upstream policy (all ten points, data_ptr key, one cache per pool) under E1: "
        "every transition preserves the invariant C1 + C3",
        "proved", _build_consecution(UPSTREAM), _render_step(UPSTREAM, safety=False),
    ),
    *[_without(point) for point in Point],
    _obligation(
        f"{NAME}.safety",
        f"loc_cache ({INSTANCE}), upstream policy under E1: from any invariant state no transition's translation "
        "(scheduler, forward, capture runs, replay, alloc_extend/alloc_decode last_loc) differs from M[contents]",
        "proved", _build_safety(UPSTREAM), _render_step(UPSTREAM, safety=True),
    ),
    _bmc("loc_cache.e1_needed",
         "R2-a: upstream policy, but the scheduler translates during batch preparation (a freed address reused by "
         "a new storage with other contents): a stale read within 8 steps, so the contract E1 is necessary",
         Variant(e1=False, in_place_writes=False), f"{NAME}.safety", witness_search()),
    _bmc("loc_cache.s5_storage_base_key",
         "S5: with the storage-base key two equal-length views of one storage at different offsets collide and "
         "the second translation returns the first's value (BMC)",
         Variant(policy=Policy(key_scheme=KeyScheme.STORAGE_BASE)), f"{NAME}.safety",
         witness_search(max_storage=2)),
    _bmc("loc_cache.s6_capture_without_run_once",
         "S6: without run_once's invalidation the capture run hits the warm-up's entry, records no gather, and "
         "a replay uses the warm-up's constant although the static buffer now holds other slots (BMC)",
         Variant(policy=Policy().without(Point.RUN_ONCE)), f"{NAME}.safety", witness_search(Op.CAPTURE, Op.REPLAY),
         REPLAY_STALE),
    _bmc("loc_cache.forward_point_eager_only",
         "#25824 as merged: the per-forward invalidation sat after the CUDA-graph branch, so a replay keeps the "
         "entry an earlier translation left; a translation after the replay reads stale (fixed by #26152) (BMC)",
         Variant(replay_invalidates=False), f"{NAME}.safety", witness_search(Op.CAPTURE, Op.REPLAY, Op.ALLOC_DECODE)),
    _bmc("loc_cache.cache_shared_across_pools",
         "one cache shared by two SWA pools: a translation for pool 1 hits pool 0's entry (BMC)",
         Variant(policy=Policy(shared_across_pools=True)), f"{NAME}.safety", witness_search(pools=(0, 1))),
    _obligation(
        "loc_cache.free_full_needs_no_point",
        f"loc_cache ({INSTANCE}): free_full preserves the invariant without invalidating (it never writes M)",
        "proved", _build_consecution(UPSTREAM, (Op.FREE_FULL,)), _render_step(UPSTREAM, safety=False),
    ),
    _obligation(
        "loc_cache.free_full_needs_no_point.zeroes_mapping",
        "a free_full that also releases the SWA side (M = 0) without an invalidation point breaks C1",
        "counterexample", _build_consecution(FREE_FULL_WRITES_M, (Op.FREE_FULL,)),
        _render_step(FREE_FULL_WRITES_M, safety=False), twin_of="loc_cache.free_full_needs_no_point",
    ),
    _obligation(
        "loc_cache.restore_state_needs_no_point",
        f"loc_cache ({INSTANCE}): restore_state preserves the invariant without invalidating (it rolls back "
        "free lists, never M)",
        "proved", _build_consecution(UPSTREAM, (Op.RESTORE_STATE,)), _render_step(UPSTREAM, safety=False),
    ),
    _obligation(
        "loc_cache.restore_state_needs_no_point.rolls_back_mapping",
        "a restore_state that also rolls M back, without an invalidation point, breaks C1",
        "counterexample", _build_consecution(RESTORE_WRITES_M, (Op.RESTORE_STATE,)),
        _render_step(RESTORE_WRITES_M, safety=False), twin_of="loc_cache.restore_state_needs_no_point",
    ),
    _obligation(
        "loc_cache.c4_refill_fresh",
        f"C4 ({INSTANCE}): from any state, after alloc_extend / alloc_decode (point, translate last_loc, then "
        "M written on free slots) the cache holds last_loc's key and M_new[last_loc]",
        "proved", _build_c4(UPSTREAM), _render_c4(UPSTREAM),
    ),
    _obligation(
        "loc_cache.c4_refill_fresh.overlapping_slots",
        "a mutator that may write M on a last_loc slot leaves the refilled entry stale",
        "counterexample", _build_c4(C4_OVERLAP), _render_c4(C4_OVERLAP), twin_of="loc_cache.c4_refill_fresh",
    ),
)
