"""The bounded SWA composite allocator: one transition per op, S3, the safety induction (sglang_semantics.md §1.3-§2.8).

Semantics cited: §1.3-§1.6, §2.7, §2.8, §2.11 R1 R3 R7, §7 G3 M1-M5, §9 S3 S4.

One :class:`~kvproof.spec._ts.TransitionSystem` (:data:`SYSTEM`) with a transition
for **every** state-changing operation of ``kvproof.reference.swa_allocator``, each
named like the reference function, over a small concrete instance: page size 2, full
pages {1, 2, 3} and SWA pages {1, 2, 3} (page 0 reserved, §1.4), the mapping M over
full slots 0..7 (``M[-1] = -1`` is the constant sentinel), requests of at most 4
tokens, list arguments of at most 4 entries. Free-list *order* is abstracted (an
allocation may take any free pages), which only enlarges the search.

State: free flags per page, the mapping M, and ghost state the real code does not
keep: the owner (request id) of every page, the index of a full page within its
owner's sequence, per-slot liveness (the reference's ``fill``). Also what a caller
holds between calls: the latest ``backup_state()`` (free lists and liveness, valid
while nothing was released since: the reference's epoch), and the latest
``get_cpu_copy()`` (per position: full row, ``swa_mask`` bit, SWA row). KV rows are
tags (0 = undefined), one full layer and one SWA layer (the reference's default
geometry).

Transitions (§ of the semantics):

* ``alloc`` (bulk, whole pages, §1.5), ``alloc_extend`` (parts 1/2/3, continuing the
  SWA page of ``M[last_loc]``, §1.3, M5), ``alloc_decode`` (one token, §1.3),
  ``alloc_extend_swa_tail`` (SWA slots for a page-aligned tail only, U1; post-#25805
  the other new slots get M = 0, §2.7): one request per call; new slots become live,
  their KV rows undefined;
* ``free`` (full pages, then the SWA pages of their live slots, M = 0 on the pages),
  ``free_swa`` (the SWA side only, M3), ``free_full`` (the full side, only when the
  live slots' M is 0): on the pages a slot list touches (§1.5); a released page's KV
  rows become undefined (also for ``clear`` and the pages ``restore_state`` gives back);
* the 0.5.23 kv-row releases (docs/contract.md "§1.5a") ``free_segment``, ``free_swa_segment``,
  ``free_full_segment``, ``free_kv_row_segments``: the same page effects, free-list order abstracted, with their
  preconditions (the segment's live slots all mapped; all released; each page all one or the other); the free group
  ``free_group_begin`` / ``free_group_end``: inside a group a release clears M and liveness at once and holds its
  pages back, owned by nobody and in no free list, until the end gives them back;
* ``clear`` (back to the initial pools and mapping), ``backup_state`` /
  ``restore_state`` (free lists and liveness only, never M: R3; a restore needs no
  release since the backup), ``set_full_to_swa_mapping`` (M on live slots, checked
  like the reference: M2, M5, no stranded SWA page);
* ``set_kv_buffer`` (rows at full slots, or at ``M[loc]`` for the SWA layer),
  ``get_cpu_copy`` (a read: the copy the caller holds), ``load_cpu_copy``
  (``row_mask = new_mask[old_mask]``, §2.8), ``translate_loc_from_full_to_swa`` (a
  read: identity frame, results ``M[loc]``).

Safety (per step): no SWA page is released while it is already free (double free)
or still mapped from a live full slot, and none is handed out while mapped from a
live full slot (aliasing). Obligations (``swa_allocator.no_double_free.*``):

* ``.bounded.s3_pre_25805`` (broken twin): the pre-#25805 model reaches the S3 event,
  ``free_swa`` releasing an SWA page a live full slot still maps to, in a 5-step run
  from ``clear()`` (BMC over the draft ops, :data:`DRAFTS`): backup_state -> an
  allocation -> restore_state (R3: M keeps the draft's entries) ->
  ``alloc_extend_swa_tail`` reusing the page with its stale M (R1) -> ``free_swa``;
* ``.{initiation,consecution,safety}``: the post-#25805 model is safe for runs of any
  length, by the inductive invariant "M2 as maintained" (on live slots: the mapped
  SWA page is allocated to the same owner, same in-page offset, distinct values, one
  SWA page per full page; every owned SWA page is mapped from a live slot, G3) plus
  the page bookkeeping and, while a backup is valid, the same for the state a
  restore would produce (:func:`backup_clauses`); ``.bounded``: no unsafe step within 3
  steps of ``clear()`` (BMC over the ops that change the allocator, :data:`POOL`);
* twins: the pre-#25805 tail allocation breaks consecution; "M2 as intended" is
  broken by backup/allocate/restore after ``clear()`` (R3); an invariant without the
  page-locality clause does not imply safety; a ``clear()`` that forgets M breaks
  initiation.

Per operation (``swa_allocator.<op>.*``, each with a broken twin): the invariant is
kept by every mutator (twins: ``alloc`` without the mapping write, ``alloc_extend``
without the M5 check, upstream's non-atomic ``alloc_decode`` (R7), the pre-#25805
tail, ``free`` without its SWA side, ``free_swa`` without the M clear,
``free_full`` without the peer check, a segment release without its SWA side, ``free_swa_segment`` without the
M clear, ``free_full_segment`` without the peer check, a kv-row release full side only, a nested
``free_group_begin`` that resets the piles, a ``free_group_end`` of the full pile only, ``clear`` of the full pool
only,
``restore_state`` after a release, ``set_full_to_swa_mapping`` unchecked);
``backup_state`` then an allocation then ``restore_state`` gives the free lists and
liveness back (twin: M too, R3); ``get_cpu_copy`` then ``load_cpu_copy`` into the
same slots changes no row (twin: SWA rows read at the full slot ids); a load puts
each saved row on its own position (twin: the legacy ``row_mask``, S4);
``set_kv_buffer`` writes only SWA pages the writer's request holds (twin: no
liveness check); a translation of a live slot is 0 or an SWA slot its request holds
(twin: of a freed slot, after R3).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import z3

from kvproof.spec import _ts
from kvproof.spec._solver import Obligation, as_bool, as_int, fmt_bools
from kvproof.spec._ts import Check, Clause, Search, Step, Target, TransitionSystem
from kvproof.spec.swa_mask import compress

__all__ = [
    "ALLOCATIONS",
    "ARGS",
    "DRAFTS",
    "FIXED",
    "M2_INTENDED_BROKEN",
    "MAPPED",
    "MAX_SEQ",
    "OBLIGATIONS",
    "OPS",
    "PAGES",
    "POOL",
    "PRE_25805",
    "REAL_SLOTS",
    "RELEASES",
    "S3_DEPTH",
    "S3_EVENT",
    "SEARCH",
    "SWA_RELEASES",
    "SYSTEM",
    "UNSAFE",
    "Action",
    "P",
    "State",
    "Variant",
    "backup_clauses",
    "init",
    "intended_clauses",
    "invariant_clauses",
    "live_mapping_clauses",
    "mapped",
    "safe_step",
    "system",
]

COMPONENT = "swa_allocator"
FAMILY = "swa_s3"

P = 2
PAGES = (1, 2, 3)  # real pages of both pools; page 0 is reserved
NUM_SLOTS = (len(PAGES) + 1) * P  # slots 0..7 in each pool; page g holds g*P .. g*P + P - 1
REAL_SLOTS = range(P, NUM_SLOTS)
MAX_SEQ = 4  # tokens per request: at most 2 pages
ARGS = 4  # entries of a list argument (slots, rows, positions of a CPU copy)
S3_DEPTH = 5  # backup_state, an allocation, restore_state, alloc_extend_swa_tail, free_swa
BOUNDED_DEPTH = 3  # deeper unsatisfiable BMC costs minutes; the induction covers every depth

#: The transitions, in the reference module's order; each is a function of kvproof.reference.swa_allocator.
OPS = (
    "alloc", "alloc_extend", "alloc_decode", "alloc_extend_swa_tail", "free", "free_swa", "free_full",
    "free_segment", "free_swa_segment", "free_full_segment", "free_kv_row_segments", "free_group_begin",
    "free_group_end", "clear",
    "backup_state", "restore_state", "set_full_to_swa_mapping", "set_kv_buffer", "get_cpu_copy", "load_cpu_copy",
    "translate_loc_from_full_to_swa",
)
ALLOCATIONS = ("alloc", "alloc_extend", "alloc_decode", "alloc_extend_swa_tail")


@dataclass(frozen=True)
class Variant:
    """Which model: the allocator fix, and the deliberately broken part of a twin (all sound by default)."""

    clears_non_tail: bool = True  # post-#25805 alloc_extend_swa_tail (R1 when off)
    clear_resets_mapping: bool = True  # clear() / init set M[:-1] = 0
    page_locality: bool = True  # the invariant keeps "one SWA page per full page"
    alloc_writes_mapping: bool = True  # alloc sets M[full] = swa
    checks_continuation: bool = True  # alloc_extend / alloc_decode need M[last_loc] > 0 to continue a page (M5)
    atomic_decode: bool = True  # off: upstream alloc_decode takes the full page even when SWA is short (R7)
    free_releases_swa: bool = True  # free = full pages + free_swa
    free_swa_clears: bool = True  # free_swa zeroes M on the pages
    free_full_checks_peer: bool = True  # free_full only with M == 0 on the live slots
    segment_releases_swa: bool = True  # free_segment = free_full_segment + free_swa_segment (0.5.23 kv-row release)
    segment_swa_clears: bool = True  # free_swa_segment zeroes M on the pages
    full_segment_checks_peer: bool = True  # free_full_segment only with M == 0 on the live slots
    kv_row_releases_swa: bool = True  # free_kv_row_segments releases the SWA side past the eviction cursor
    group_begin_checks_nesting: bool = True  # off: a nested free_group_begin resets the piles (0.5.23 asserts)
    group_end_releases_swa: bool = True  # off: free_group_end gives back the full pile only
    clear_swa_pool: bool = True  # clear() resets the SWA allocator too
    restore_checks_epoch: bool = True  # restore_state only if nothing was released since backup_state
    mapping_checked: bool = True  # set_full_to_swa_mapping keeps M2 / M5 / G3
    kv_checks_loc: bool = True  # set_kv_buffer writes live slots (or padding 0) only
    copy_translates: bool = True  # get_cpu_copy reads SWA rows at M[indices]
    legacy_row_mask: bool = False  # load_cpu_copy with row_mask = new_mask, destinations t[new_mask]
    load_distinct_indices: bool = True  # load_cpu_copy's indices are distinct (get_cpu_copy's may repeat)


FIXED = Variant()
PRE_25805 = Variant(clears_non_tail=False)


# ---- state and action -------------------------------------------------------------------------------------


def _pages(name: str, make: Callable[[str], z3.ExprRef], page0: z3.ExprRef, tag: str) -> tuple[z3.ExprRef, ...]:
    return (page0, *(make(f"{name}_{g}@{tag}") for g in PAGES))


def _slots(name: str, make: Callable[[str], z3.ExprRef], page0: z3.ExprRef, tag: str) -> tuple[z3.ExprRef, ...]:
    return (*[page0] * P, *(make(f"{name}_{x}@{tag}") for x in REAL_SLOTS))


@dataclass(frozen=True)
class State:
    """One copy of the allocator and what its caller holds, as Z3 terms.

    Page-indexed tuples have an entry for the reserved page 0 (a constant: never free,
    no owner); slot-indexed tuples are constant on page 0's slots (M = 0, not live, no
    row).
    """

    full_free: tuple[z3.BoolRef, ...]
    swa_free: tuple[z3.BoolRef, ...]
    full_owner: tuple[z3.ArithRef, ...]  # request id, 0 = none (ghost)
    swa_owner: tuple[z3.ArithRef, ...]  # ghost
    page_index: tuple[z3.ArithRef, ...]  # which page of its owner's sequence (ghost)
    M: tuple[z3.ArithRef, ...]  # full slot -> SWA slot, 0 = none
    live: tuple[z3.BoolRef, ...]  # handed out and not released (ghost: the reference's fill)
    bk_held: z3.BoolRef  # the caller holds a backup (taken at some point)
    backup: z3.BoolRef  # ... taken since the last release (same epoch): restore_state accepts it
    bk_full_free: tuple[z3.BoolRef, ...]
    bk_swa_free: tuple[z3.BoolRef, ...]
    bk_live: tuple[z3.BoolRef, ...]
    kv_full: tuple[z3.ArithRef, ...]  # row tag per full slot, 0 = undefined
    kv_swa: tuple[z3.ArithRef, ...]  # row tag per SWA slot
    copy_len: z3.ArithRef  # positions of the CPU copy the caller holds
    copy_full: tuple[z3.ArithRef, ...]
    copy_mask: tuple[z3.BoolRef, ...]  # swa_mask
    copy_swa: tuple[z3.ArithRef, ...]  # the saved SWA row of each masked position (0 elsewhere)
    grp: z3.BoolRef  # a free group is open (free_group_begin, §1.5a)
    held_full: tuple[z3.BoolRef, ...]  # full pages the open group holds back: owned by nobody, not free
    held_swa: tuple[z3.BoolRef, ...]

    @staticmethod
    def fresh(tag: str) -> State:
        f, zero = z3.BoolVal(False), z3.IntVal(0)
        return State(
            full_free=_pages("full_free", z3.Bool, f, tag), swa_free=_pages("swa_free", z3.Bool, f, tag),
            full_owner=_pages("full_owner", z3.Int, zero, tag), swa_owner=_pages("swa_owner", z3.Int, zero, tag),
            page_index=_pages("page_index", z3.Int, zero, tag),
            M=_slots("M", z3.Int, zero, tag), live=_slots("live", z3.Bool, f, tag),
            bk_held=z3.Bool(f"bk_held@{tag}"), backup=z3.Bool(f"backup@{tag}"),
            bk_full_free=_pages("bk_full_free", z3.Bool, f, tag), bk_swa_free=_pages("bk_swa_free", z3.Bool, f, tag),
            bk_live=_slots("bk_live", z3.Bool, f, tag),
            kv_full=_slots("kv_full", z3.Int, zero, tag), kv_swa=_slots("kv_swa", z3.Int, zero, tag),
            copy_len=z3.Int(f"copy_len@{tag}"),
            copy_full=tuple(z3.Int(f"copy_full_{j}@{tag}") for j in range(ARGS)),
            copy_mask=tuple(z3.Bool(f"copy_mask_{j}@{tag}") for j in range(ARGS)),
            copy_swa=tuple(z3.Int(f"copy_swa_{j}@{tag}") for j in range(ARGS)),
            grp=z3.Bool(f"grp@{tag}"), held_full=_pages("held_full", z3.Bool, f, tag),
            held_swa=_pages("held_swa", z3.Bool, f, tag),
        )

    def restored(self) -> State:
        """What ``restore_state`` would make of this state: free lists and liveness from the backup, M kept."""
        return dataclasses.replace(
            self, full_free=self.bk_full_free, swa_free=self.bk_swa_free, live=self.bk_live,
            full_owner=tuple(z3.If(b, 0, o) for b, o in zip(self.bk_full_free, self.full_owner, strict=True)),
            swa_owner=tuple(z3.If(b, 0, o) for b, o in zip(self.bk_swa_free, self.swa_owner, strict=True)),
        )


@dataclass(frozen=True)
class Action:
    """The arguments of one step (those its op does not use are unconstrained)."""

    req: z3.ArithRef  # the request an allocation serves (ghost owner)
    prefix: z3.ArithRef  # prefix_len (alloc_decode: seq_len - 1)
    seq: z3.ArithRef  # seq_len (alloc: need_size)
    tail: z3.ArithRef  # swa_tail_len
    last_page: z3.ArithRef  # the full page of last_loc when prefix > 0
    full_pages: tuple[z3.ArithRef, z3.ArithRef]  # new pages an allocation takes, in position order
    swa_pages: tuple[z3.ArithRef, z3.ArithRef]
    pages: tuple[z3.BoolRef, ...]  # full pages a free / free_swa / free_full touches (page 0: never)
    n: z3.ArithRef  # entries of the list arguments below
    loc: tuple[z3.ArithRef, ...]  # full slots: loc, indices, full_indices
    value: tuple[z3.ArithRef, ...]  # set_full_to_swa_mapping: SWA slots; set_kv_buffer: row tags
    result: tuple[z3.ArithRef, ...]  # translate_loc_from_full_to_swa: the translations
    swa_layer: z3.BoolRef  # set_kv_buffer writes the SWA layer (else the full layer)
    # names for terms of an allocation (defined by its relation; they keep the formulas small)
    m_last: z3.ArithRef  # M[last_loc]
    full_slot: tuple[z3.ArithRef, ...]  # the full slot of position j
    swa_slot: tuple[z3.ArithRef, ...]  # the SWA slot of position j (if it gets one)

    @staticmethod
    def fresh(tag: str) -> Action:
        def ints(name: str, k: int) -> tuple[z3.ArithRef, ...]:
            return tuple(z3.Int(f"{name}_{i}@{tag}") for i in range(k))

        return Action(
            req=z3.Int(f"req@{tag}"), prefix=z3.Int(f"prefix@{tag}"), seq=z3.Int(f"seq@{tag}"),
            tail=z3.Int(f"tail@{tag}"), last_page=z3.Int(f"last_page@{tag}"),
            full_pages=(z3.Int(f"full_page_0@{tag}"), z3.Int(f"full_page_1@{tag}")),
            swa_pages=(z3.Int(f"swa_page_0@{tag}"), z3.Int(f"swa_page_1@{tag}")),
            pages=_pages("pick", z3.Bool, z3.BoolVal(False), tag),
            n=z3.Int(f"n@{tag}"), loc=ints("loc", ARGS), value=ints("value", ARGS), result=ints("result", ARGS),
            swa_layer=z3.Bool(f"swa_layer@{tag}"), m_last=z3.Int(f"m_last@{tag}"),
            full_slot=ints("full_slot", MAX_SEQ), swa_slot=ints("swa_slot", MAX_SEQ),
        )


# ---- term helpers -----------------------------------------------------------------------------------------


def pick(values: Sequence[z3.ExprRef], i: z3.ArithRef, default: z3.ExprRef | None = None) -> z3.ExprRef:
    """``values[i]`` for a symbolic index (``default``, else 0, out of range), as an If-chain."""
    out: z3.ExprRef = z3.IntVal(0) if default is None else default
    for k in reversed(range(len(values))):
        out = z3.If(i == k, values[k], out)
    return out


def _int(values: Sequence[z3.ArithRef], i: z3.ArithRef) -> z3.ArithRef:
    """``values[i]`` of Int terms (0 out of range)."""
    return pick(values, i)


def _bool(values: Sequence[z3.BoolRef], i: z3.ArithRef) -> z3.BoolRef:
    """``values[i]`` of Bool terms (False out of range)."""
    return pick(values, i, z3.BoolVal(False))


def swa_page_of(m: z3.ArithRef, q: int) -> z3.BoolRef:
    """SWA slot ``m`` lies on SWA page ``q``."""
    return z3.And(q * P <= m, m < q * P + P)


def mapped_into(s: State, x: int, q: int) -> z3.BoolRef:
    """Live full slot ``x`` maps to SWA page ``q``."""
    return z3.And(s.live[x], s.M[x] > 0, swa_page_of(s.M[x], q))


def _in_use(s: State, q: int) -> z3.BoolRef:
    return z3.Or([mapped_into(s, x, q) for x in REAL_SLOTS])


def _page_count(tokens: z3.ArithRef) -> z3.ArithRef:
    """``ceil(tokens / P)`` for ``0 <= tokens <= MAX_SEQ``."""
    return z3.Sum([z3.If(tokens > k * P, 1, 0) for k in range(MAX_SEQ // P)])


def _aligned(tokens: z3.ArithRef) -> z3.BoolRef:
    """``tokens mod P == 0`` for ``0 <= tokens <= MAX_SEQ``."""
    return z3.Or([tokens == k * P for k in range(MAX_SEQ // P + 1)])


def _takes(count: z3.ArithRef, pages: Sequence[z3.ArithRef], g: int) -> z3.BoolRef:
    return z3.Or([z3.And(i < count, page == g) for i, page in enumerate(pages)])


def _fresh_pages(count: z3.ArithRef, pages: Sequence[z3.ArithRef], free: Sequence[z3.BoolRef]) -> list[z3.BoolRef]:
    """The first ``count`` page choices are distinct free real pages (any order: free-list order abstracted)."""
    facts = [z3.Implies(i < count, z3.Or([z3.And(page == g, free[g]) for g in PAGES])) for i, page in enumerate(pages)]
    return [*facts, z3.Implies(count >= 2, pages[0] != pages[1])]


def _real_slot(x: z3.ArithRef) -> z3.BoolRef:
    return z3.And(x >= P, x < NUM_SLOTS)


def _distinct(active: Sequence[z3.BoolRef], xs: Sequence[z3.ArithRef]) -> list[z3.BoolRef]:
    return [z3.Implies(z3.And(active[i], active[k]), xs[i] != xs[k])
            for i in range(len(xs)) for k in range(i + 1, len(xs))]


def _entries(a: Action) -> list[z3.BoolRef]:
    """Entry ``i`` of the list arguments is given."""
    return [i < a.n for i in range(ARGS)]


def _given_live(s: State, a: Action, *, distinct: bool) -> list[z3.BoolRef]:
    """``n`` in ``[0, ARGS]``; the given slots are live (the reference's ``_check_live``), distinct if asked."""
    on = _entries(a)
    facts = [a.n >= 0, a.n <= ARGS, *[z3.Implies(on[i], _bool(s.live, a.loc[i])) for i in range(ARGS)]]
    return facts + (_distinct(on, a.loc) if distinct else [])


def _write(current: z3.ArithRef, writes: Sequence[tuple[z3.BoolRef, z3.ArithRef]]) -> z3.ArithRef:
    """The value after writes in order (a later write wins)."""
    for hit, value in writes:
        current = z3.If(hit, value, current)
    return current


# ---- init and allocation ----------------------------------------------------------------------------------


def init(s: State, variant: Variant = FIXED) -> z3.BoolRef:
    """``initial_state`` / ``clear()``: every page free and unowned, M zero (unless a twin forgets), nothing
    live, no backup, no rows, no copy."""
    mapping = [s.M[x] == 0 for x in REAL_SLOTS] if variant.clear_resets_mapping else []
    return z3.And(
        *[s.full_free[g] for g in PAGES], *[s.swa_free[q] for q in PAGES],
        *[s.full_owner[g] == 0 for g in PAGES], *[s.swa_owner[q] == 0 for q in PAGES],
        *[s.page_index[g] == 0 for g in PAGES], *[z3.Not(s.live[x]) for x in REAL_SLOTS], *mapping,
        z3.Not(s.bk_held), z3.Not(s.backup),
        *[s.kv_full[x] == 0 for x in REAL_SLOTS], *[s.kv_swa[x] == 0 for x in REAL_SLOTS],
        s.copy_len == 0, *[c == 0 for c in s.copy_full], *[z3.Not(c) for c in s.copy_mask],
        *[c == 0 for c in s.copy_swa], z3.Not(s.grp), *[z3.Not(h) for h in (*s.held_full[1:], *s.held_swa[1:])],
    )


def _ite(cond: z3.BoolRef, then: z3.ExprRef, other: z3.ExprRef) -> z3.ExprRef:
    """``If(cond, then, other)``, folded when ``cond`` is a literal (per-op relations stay small)."""
    if z3.is_true(cond):
        return then
    if z3.is_false(cond):
        return other
    return z3.If(cond, then, other)


def _implies(cond: z3.BoolRef, fact: z3.BoolRef) -> z3.BoolRef:
    return fact if z3.is_true(cond) else z3.BoolVal(True) if z3.is_false(cond) else z3.Implies(cond, fact)


@dataclass(frozen=True)
class _Extend:
    """The slots one request's extend ``[prefix, seq)`` writes (§1.3 parts 1/2/3), as terms over the step.

    ``tail`` selects ``alloc_extend_swa_tail`` (SWA slots for ``[seq - tail, seq)``, a fresh SWA sequence)
    over the 1:1 extends (SWA continuing ``M[last_loc]``); it is a literal in a single op's relation and the
    op test in the combined step.
    """

    s: State
    a: Action
    tail: z3.BoolRef

    @property
    def started(self) -> z3.ArithRef:
        """Pages the prefix already spans, ``ceil(prefix / P)``."""
        return _page_count(self.a.prefix)

    @property
    def new_full(self) -> z3.ArithRef:
        """``get_num_new_pages``: ``ceil(seq / P) - ceil(prefix / P)``."""
        return _page_count(self.a.seq) - self.started

    @property
    def new_swa(self) -> z3.ArithRef:
        return _ite(self.tail, _page_count(self.a.tail), self.new_full)

    @property
    def tail_start(self) -> z3.ArithRef:
        return _ite(self.tail, self.a.seq - self.a.tail, self.a.prefix)

    @property
    def last_loc(self) -> z3.ArithRef:
        """The slot of token ``prefix - 1`` (meaningful for ``prefix > 0``)."""
        return self.a.last_page * P + (self.a.prefix - 1 - P * (self.started - 1))

    def new(self, j: int) -> z3.BoolRef:
        return z3.And(self.a.prefix <= j, j < self.a.seq)

    def in_part1(self, j: int) -> z3.BoolRef:
        """Position ``j`` continues the last page (``j < ceil_P(prefix)``)."""
        return z3.And(self.new(j), self.a.prefix > (j // P) * P)

    def full_slot_of(self, j: int) -> z3.ArithRef:
        page = z3.If(j // P - self.started == 0, self.a.full_pages[0], self.a.full_pages[1])
        return z3.If(self.in_part1(j), self.a.last_page, page) * P + j % P

    def mapped(self, j: int) -> z3.BoolRef:
        """Position ``j`` gets an SWA slot."""
        return z3.And(self.new(j), j >= self.tail_start)

    def swa_slot_of(self, j: int) -> z3.ArithRef:
        page = z3.If(j // P - self.started == 0, self.a.swa_pages[0], self.a.swa_pages[1])
        continued = self.a.m_last + (j - self.a.prefix + 1)  # the kernel: M[last_loc] + 1 + i
        one_to_one = z3.If(self.in_part1(j), continued, page * P + j % P)
        k = j - self.tail_start  # the tail is a fresh SWA sequence (prefix 0, last_loc -1)
        second = k >= P
        tail = z3.If(second, self.a.swa_pages[1], self.a.swa_pages[0]) * P + (k - z3.If(second, P, 0))
        return _ite(self.tail, tail, one_to_one)

    def names(self) -> list[z3.BoolRef]:
        """Define the action's names for ``M[last_loc]`` and each position's slots."""
        a = self.a
        return [a.m_last == _int(self.s.M, self.last_loc),
                *[a.full_slot[j] == self.full_slot_of(j) for j in range(MAX_SEQ)],
                *[a.swa_slot[j] == self.swa_slot_of(j) for j in range(MAX_SEQ)]]

    def hits(self, x: int) -> list[z3.BoolRef]:
        return [z3.And(self.new(j), self.a.full_slot[j] == x) for j in range(MAX_SEQ)]


def _extend(s: State, a: Action, t: State, v: Variant, *, tail: z3.BoolRef, bulk: z3.BoolRef) -> z3.BoolRef:
    """One request's allocation of positions ``[prefix, seq)`` in both pools (§1.3, §1.5, §2.7).

    ``tail``: ``alloc_extend_swa_tail``'s SWA side; ``bulk``: ``alloc`` (for the twin without the M write).
    """
    e = _Extend(s, a, tail)
    p, n, req = a.prefix, a.seq, a.req
    owns_nothing = [*[s.full_owner[g] != req for g in PAGES], *[s.swa_owner[q] != req for q in PAGES]]
    offset = a.prefix - 1 - P * (e.started - 1)  # of last_loc in its page

    def last_on(g: int) -> z3.BoolRef:
        """``last_loc`` is the last live slot of request ``req``'s page ``g``, which holds its positions
        ``P * (started - 1) ..``: per concrete page, so no symbolic reads."""
        fill = [z3.And(s.live[g * P + o] == (o <= offset)) for o in range(P)]
        return z3.And(a.last_page == g, s.full_owner[g] == req, s.page_index[g] == e.started - 1, *fill)

    continues = [z3.Or([last_on(g) for g in PAGES])]
    guard = [p >= 0, p <= n, n <= MAX_SEQ, req >= 1, z3.If(p == 0, z3.And(owns_nothing), z3.And(continues)),
             *_fresh_pages(e.new_full, a.full_pages, s.full_free), *_fresh_pages(e.new_swa, a.swa_pages, s.swa_free)]
    if v.checks_continuation:  # M5: a 1:1 extend continuing a page continues its SWA page
        guard.append(_implies(z3.Not(tail), z3.Implies(z3.And(p < e.started * P, n > p), a.m_last > 0)))
    writes = z3.BoolVal(True) if v.alloc_writes_mapping else z3.Not(bulk)

    def mapping(x: int) -> z3.ArithRef:
        non_tail = z3.IntVal(0) if v.clears_non_tail else s.M[x]  # pre-#25805: stale M survives
        new = _write(s.M[x], [(hit, z3.If(e.mapped(j), a.swa_slot[j], non_tail)) for j, hit in enumerate(e.hits(x))])
        return _ite(writes, new, s.M[x])

    def index(g: int) -> z3.ArithRef:
        first, second = (z3.And(i < e.new_full, a.full_pages[i] == g) for i in range(2))
        return z3.If(first, e.started, z3.If(second, e.started + 1, s.page_index[g]))

    new_swa_slot = {y: z3.Or([z3.And(e.mapped(j), a.swa_slot[j] == y) for j in range(MAX_SEQ)]) for y in REAL_SLOTS}
    taken_full = {g: _takes(e.new_full, a.full_pages, g) for g in PAGES}
    taken_swa = {q: _takes(e.new_swa, a.swa_pages, q) for q in PAGES}
    return z3.And(
        *e.names(), *guard,
        *[t.full_free[g] == z3.And(s.full_free[g], z3.Not(taken_full[g])) for g in PAGES],
        *[t.full_owner[g] == z3.If(taken_full[g], req, s.full_owner[g]) for g in PAGES],
        *[t.page_index[g] == index(g) for g in PAGES],
        *[t.swa_free[q] == z3.And(s.swa_free[q], z3.Not(taken_swa[q])) for q in PAGES],
        *[t.swa_owner[q] == z3.If(taken_swa[q], req, s.swa_owner[q]) for q in PAGES],
        *[t.M[x] == mapping(x) for x in REAL_SLOTS],
        *[t.live[x] == z3.Or(s.live[x], *e.hits(x)) for x in REAL_SLOTS],
        *[t.kv_full[x] == z3.If(z3.Or(e.hits(x)), 0, s.kv_full[x]) for x in REAL_SLOTS],
        *[t.kv_swa[y] == z3.If(new_swa_slot[y], 0, s.kv_swa[y]) for y in REAL_SLOTS],
        *_ts.unchanged(s, t, "bk_held", "backup", "bk_full_free", "bk_swa_free", "bk_live", "copy_len", "copy_full",
                       "copy_mask", "copy_swa", "grp", "held_full", "held_swa"),
    )


def _allocation_args(op: str, a: Action) -> z3.BoolRef:
    """What each allocation asks of its arguments beyond :func:`_extend`."""
    if op == "alloc":  # need_size whole pages for a new request
        return z3.And(a.prefix == 0, _aligned(a.seq))
    if op == "alloc_decode":  # one token at position seq - 1
        return z3.And(a.seq >= 1, a.prefix == a.seq - 1)
    if op == "alloc_extend_swa_tail":  # U1: the tail starts on a page boundary
        return z3.And(a.tail >= 0, a.tail <= a.seq - a.prefix, _aligned(a.seq - a.tail))
    return z3.BoolVal(True)


def _decode_leak(s: State, a: Action, t: State) -> z3.BoolRef:
    """Upstream's non-atomic ``alloc_decode`` (R7): the SWA pool is short, the full page is taken all the same
    and returned to nobody."""
    page = a.full_pages[0]
    return z3.And(
        _aligned(a.prefix), *[z3.Not(s.swa_free[q]) for q in PAGES],
        z3.Or([z3.And(page == g, s.full_free[g]) for g in PAGES]),
        *[t.full_free[g] == z3.And(s.full_free[g], page != g) for g in PAGES],
        *_ts.unchanged_except(s, t, "full_free"),
    )


_ALLOCATION_DOCS = {
    "alloc": "``alloc(need_size)``: ``need_size / P`` whole pages for a new request, 1:1 in both pools (§1.5).",
    "alloc_extend": "``alloc_extend`` of one request from ``prefix`` to ``seq`` tokens, 1:1, the SWA side "
                    "continuing ``M[last_loc]`` (§1.3, M5).",
    "alloc_decode": "``alloc_decode``: one token at position ``seq - 1`` (a new page iff ``(seq - 1) mod P == 0``), "
                    "1:1 (§1.3); upstream's non-atomic variant leaks a full page (R7).",
    "alloc_extend_swa_tail": "Full slots for ``[prefix, seq)``, SWA slots for the last ``tail`` (U1: ``seq - tail`` "
                             "page aligned); post-#25805 the other new slots get M = 0, pre-#25805 they keep stale "
                             "M (R1) (§2.7).",
}


def _allocation(v: Variant, op: str) -> Callable[[State, Action, State], z3.BoolRef]:
    tail, bulk = z3.BoolVal(op == "alloc_extend_swa_tail"), z3.BoolVal(op == "alloc")

    def relation(s: State, a: Action, t: State) -> z3.BoolRef:
        step = _extend(s, a, t, v, tail=tail, bulk=bulk)
        if op == "alloc_decode" and not v.atomic_decode:
            step = z3.Or(step, _decode_leak(s, a, t))
        return z3.And(_allocation_args(op, a), step)

    relation.__name__ = relation.__qualname__ = op
    relation.__doc__ = _ALLOCATION_DOCS[op]
    return relation


# ---- release ----------------------------------------------------------------------------------------------


def released_by_mapping(s: State, a: Action) -> dict[int, z3.BoolRef]:
    """SWA pages holding ``M[x] > 0`` for a live slot ``x`` of a touched page (``swa.free(M[idx][M[idx] > 0])``)."""
    return {q: z3.Or([z3.And(a.pages[x // P], mapped_into(s, x, q)) for x in REAL_SLOTS]) for q in PAGES}


def _touches(s: State, a: Action) -> list[z3.BoolRef]:
    """The slot list touches allocated pages, each through a live slot."""
    return [z3.Implies(a.pages[g], z3.Or([s.live[g * P + o] for o in range(P)])) for g in PAGES]


RELEASES = ("free", "free_swa", "free_full", "free_segment", "free_swa_segment", "free_full_segment",
            "free_kv_row_segments")
#: The releases that give back SWA pages through M (the double-free check watches them).
SWA_RELEASES = ("free", "free_swa", "free_segment", "free_swa_segment", "free_kv_row_segments")


def _release(s: State, a: Action, t: State, v: Variant, *, full: z3.BoolRef, swa: z3.BoolRef,
             clears: z3.BoolRef, peer: z3.BoolRef, mapped: z3.BoolRef | None = None,
             uniform: z3.BoolRef | None = None) -> z3.BoolRef:
    """Release the pages a slot list touches: the full side (``full``: pages, owners, liveness), the SWA side
    (``swa``: the SWA pages of their live slots' M), M = 0 on the pages (``clears``), and only pages whose live
    slots have M = 0 (``peer``, ``free_full``'s check). The flags are literals in a single op's relation and op
    tests in the combined step. A backup goes stale when anything is released (the reference's epoch). The
    segment calls (0.5.23, docs/contract.md "§1.5a") release the same pages; free-list order is abstracted here, so
    what they add are their preconditions: every live slot of a touched page has its SWA peer (``mapped``:
    ``free_segment``, ``free_swa_segment``), or each touched page is all mapped or all released (``uniform``:
    ``free_kv_row_segments``, whose eviction cursor falls on a page boundary)."""
    touched = a.pages
    mapped = z3.BoolVal(False) if mapped is None else mapped
    uniform = z3.BoolVal(False) if uniform is None else uniform
    released = released_by_mapping(s, a)
    gone = {q: z3.And(swa, released[q]) for q in PAGES}
    returns = [z3.And(full, touched[g]) for g in PAGES] + list(gone.values())
    hold, now = s.grp, z3.Not(s.grp)  # inside a free group the pages wait, owned by nobody, in no free list
    return z3.And(
        *[t.held_full[g] == z3.Or(s.held_full[g], z3.And(hold, full, touched[g])) for g in PAGES],
        *[t.held_swa[q] == z3.Or(s.held_swa[q], z3.And(hold, gone[q])) for q in PAGES],
        *_touches(s, a), *[_implies(peer, z3.Implies(z3.And(touched[x // P], s.live[x]), s.M[x] == 0))
                           for x in REAL_SLOTS],
        *[_implies(mapped, z3.Implies(z3.And(touched[x // P], s.live[x]), s.M[x] > 0)) for x in REAL_SLOTS],
        *[_implies(uniform, z3.Implies(touched[g], z3.Or(
            z3.And([z3.Implies(s.live[g * P + o], s.M[g * P + o] > 0) for o in range(P)]),
            z3.And([z3.Implies(s.live[g * P + o], s.M[g * P + o] == 0) for o in range(P)])))) for g in PAGES],
        *[t.full_free[g] == z3.Or(s.full_free[g], z3.And(now, full, touched[g])) for g in PAGES],
        *[t.full_owner[g] == z3.If(z3.And(full, touched[g]), 0, s.full_owner[g]) for g in PAGES],
        *[t.live[x] == z3.And(s.live[x], z3.Not(z3.And(full, touched[x // P]))) for x in REAL_SLOTS],
        *[t.swa_free[q] == z3.Or(s.swa_free[q], z3.And(now, gone[q])) for q in PAGES],
        *[t.swa_owner[q] == z3.If(gone[q], 0, s.swa_owner[q]) for q in PAGES],
        *[t.M[x] == z3.If(z3.And(clears, touched[x // P]), 0, s.M[x]) for x in REAL_SLOTS],
        # a released page's rows are undefined: its next owner never reads the last one's (kvproof.reference.kv)
        *[t.kv_full[x] == z3.If(z3.And(full, touched[x // P]), 0, s.kv_full[x]) for x in REAL_SLOTS],
        *[t.kv_swa[y] == z3.If(gone[y // P], 0, s.kv_swa[y]) for y in REAL_SLOTS],
        t.backup == z3.And(s.backup, *[z3.Not(r) for r in returns]),
        *_ts.unchanged_except(s, t, "full_free", "full_owner", "live", "swa_free", "swa_owner", "M", "kv_full",
                              "kv_swa", "backup", "held_full", "held_swa"),
    )


def _group_begin(v: Variant) -> Callable[[State, Action, State], z3.BoolRef]:
    def free_group_begin(s: State, a: Action, t: State) -> z3.BoolRef:
        """``free_group_begin()``: open a group (groups do not nest: 0.5.23 asserts; the twin without the check
        resets the piles of the open one, losing what it held)."""
        if v.group_begin_checks_nesting:
            return z3.And(z3.Not(s.grp), t.grp, *_ts.unchanged_except(s, t, "grp"))
        return z3.And(t.grp, *[z3.Not(h) for h in (*t.held_full[1:], *t.held_swa[1:])],
                      *_ts.unchanged_except(s, t, "grp", "held_full", "held_swa"))

    return free_group_begin


def _group_end(v: Variant) -> Callable[[State, Action, State], z3.BoolRef]:
    def free_group_end(s: State, a: Action, t: State) -> z3.BoolRef:
        """``free_group_end()`` of an open group: every held page goes back to its free list (the piles' order is
        abstracted); a held backup is stale if anything went back (the reference's epoch)."""
        swa_back = [z3.And(s.held_swa[q], z3.BoolVal(v.group_end_releases_swa)) for q in PAGES]
        given = [s.held_full[g] for g in PAGES] + swa_back
        return z3.And(
            s.grp, z3.Not(t.grp), *[z3.Not(h) for h in (*t.held_full[1:], *t.held_swa[1:])],
            *[t.full_free[g] == z3.Or(s.full_free[g], s.held_full[g]) for g in PAGES],
            *[t.swa_free[q] == z3.Or(s.swa_free[q], b) for q, b in zip(PAGES, swa_back, strict=True)],
            t.backup == z3.And(s.backup, *[z3.Not(r) for r in given]),
            *_ts.unchanged_except(s, t, "grp", "held_full", "held_swa", "full_free", "swa_free", "backup"),
        )

    return free_group_end


def _release_flags(v: Variant, op: Callable[[str], z3.BoolRef]) -> dict[str, z3.BoolRef]:
    """:func:`_release`'s flags from ``op(name)``, "this step performs ``name``"."""
    seg = z3.And(op("free_segment"), z3.BoolVal(v.segment_releases_swa))
    row = z3.And(op("free_kv_row_segments"), z3.BoolVal(v.kv_row_releases_swa))
    return {
        "full": z3.Or(op("free"), op("free_full"), op("free_segment"), op("free_full_segment"),
                      op("free_kv_row_segments")),
        "swa": z3.Or(z3.And(op("free"), z3.BoolVal(v.free_releases_swa)), op("free_swa"), seg,
                     op("free_swa_segment"), row),
        "clears": z3.Or(z3.And(op("free"), z3.BoolVal(v.free_releases_swa)),
                        z3.And(op("free_swa"), z3.BoolVal(v.free_swa_clears)), seg,
                        z3.And(op("free_swa_segment"), z3.BoolVal(v.segment_swa_clears)), row),
        "peer": z3.Or(z3.And(op("free_full"), z3.BoolVal(v.free_full_checks_peer)),
                      z3.And(op("free_full_segment"), z3.BoolVal(v.full_segment_checks_peer))),
        "mapped": z3.Or(op("free_segment"), op("free_swa_segment")),
        "uniform": op("free_kv_row_segments"),
    }


_RELEASE_DOCS = {
    "free": "``free(idx)``: the SWA side of the touched pages (their live slots' M), then the full pages (§1.5).",
    "free_swa": "``free_swa(idx)``: release the SWA pages of the touched pages' live slots, M = 0 on the pages "
                "(M3, §1.5, §1.6).",
    "free_full": "``free_full(idx)``: the touched full pages, whose live slots' SWA side is released already "
                 "(M = 0).",
    "free_segment": "``free_segment(idx, start_pos)``: ``free`` of a kv-row segment whose live slots all have their "
                    "SWA peer (0.5.23 ``swa.peer_mapped``); its page order is abstracted (§1.5a).",
    "free_swa_segment": "``free_swa_segment(idx, start_pos)``: ``free_swa`` of a kv-row segment whose live slots all "
                        "have their SWA peer (§1.5a).",
    "free_full_segment": "``free_full_segment(idx, start_pos)``: ``free_full`` of a kv-row segment (M = 0 on its "
                         "live slots, §1.5a).",
    "free_kv_row_segments": "``free_kv_row_segments(segments, swa_evicted_seqlen)``: the pages before the eviction "
                            "cursor full side only, the rest both sides; each touched page all mapped or all "
                            "released (the cursor falls on a page boundary, §1.5a).",
}


def _releasing(v: Variant, name: str) -> Callable[[State, Action, State], z3.BoolRef]:
    flags = {k: z3.simplify(f) for k, f in _release_flags(v, lambda op: z3.BoolVal(op == name)).items()}

    def relation(s: State, a: Action, t: State) -> z3.BoolRef:
        return _release(s, a, t, v, **flags)

    relation.__name__ = relation.__qualname__ = name
    relation.__doc__ = _RELEASE_DOCS[name]
    return relation


def _clear(v: Variant) -> Callable[[State, Action, State], z3.BoolRef]:
    def clear(s: State, a: Action, t: State) -> z3.BoolRef:
        """``clear()``: both pools back to all free, M[:-1] = 0, nothing live, every row undefined; a held copy
        stays."""
        swa = [*[t.swa_free[q] for q in PAGES], *[t.swa_owner[q] == 0 for q in PAGES]] if v.clear_swa_pool else \
            _ts.unchanged(s, t, "swa_free", "swa_owner")
        mapping = [t.M[x] == 0 for x in REAL_SLOTS] if v.clear_resets_mapping else _ts.unchanged(s, t, "M")
        return z3.And(
            *[t.full_free[g] for g in PAGES], *[t.full_owner[g] == 0 for g in PAGES],
            *[t.page_index[g] == 0 for g in PAGES], *[z3.Not(t.live[x]) for x in REAL_SLOTS], *swa, *mapping,
            z3.Not(t.backup), *[t.kv_full[x] == 0 for x in REAL_SLOTS], *[t.kv_swa[y] == 0 for y in REAL_SLOTS],
            *_ts.unchanged(s, t, "bk_held", "bk_full_free", "bk_swa_free", "bk_live", "copy_len", "copy_full",
                           "copy_mask", "copy_swa"),
            z3.Not(t.grp), *[z3.Not(h) for h in (*t.held_full[1:], *t.held_swa[1:])],  # 0.5.23 clear resets groups
        )

    return clear


def backup_state(s: State, a: Action, t: State) -> z3.BoolRef:
    """``backup_state()``: the caller now holds both free lists (and the ghost liveness) of this epoch; nothing else
    changes."""
    return z3.And(t.bk_held, t.backup, *[b == x for b, x in zip(t.bk_full_free[1:], s.full_free[1:], strict=True)],
                  *[b == x for b, x in zip(t.bk_swa_free[1:], s.swa_free[1:], strict=True)],
                  *[t.bk_live[x] == s.live[x] for x in REAL_SLOTS],
                  *_ts.unchanged_except(s, t, "bk_held", "backup", "bk_full_free", "bk_swa_free", "bk_live"))


def _restore_state(v: Variant) -> Callable[[State, Action, State], z3.BoolRef]:
    def restore_state(s: State, a: Action, t: State) -> z3.BoolRef:
        """``restore_state(backup)`` of a held backup: free lists and liveness from it, M kept (R3); needs no
        release since the backup (the reference's epoch check); the backup is stale afterwards; the pages it
        gives back lose their rows, as on any release."""
        r = s.restored()
        guard = [s.bk_held, *([s.backup] if v.restore_checks_epoch else [])]
        back_full = {g: z3.And(z3.Not(s.full_free[g]), r.full_free[g]) for g in PAGES}
        back_swa = {q: z3.And(z3.Not(s.swa_free[q]), r.swa_free[q]) for q in PAGES}
        return z3.And(*guard, *_ts.unchanged(r, t, "full_free", "swa_free", "full_owner", "swa_owner", "live"),
                      z3.Not(t.backup),
                      *[t.kv_full[x] == z3.If(back_full[x // P], 0, s.kv_full[x]) for x in REAL_SLOTS],
                      *[t.kv_swa[y] == z3.If(back_swa[y // P], 0, s.kv_swa[y]) for y in REAL_SLOTS],
                      *_ts.unchanged_except(s, t, "full_free", "swa_free", "full_owner", "swa_owner", "live",
                                            "kv_full", "kv_swa", "backup"))

    return restore_state


# ---- the mapping, KV rows, CPU copies, translation ---------------------------------------------------------


def live_mapping_clauses(s: State, *, page_locality: bool = True) -> list[Clause]:
    """M2 (as maintained), M5 and G3 over live slots: the reference's ``check_live_mapping``."""
    clauses: list[Clause] = []
    for x in REAL_SLOTS:
        for q in PAGES:
            paired = z3.And(z3.Not(s.swa_free[q]), s.swa_owner[q] == s.full_owner[x // P], s.M[x] % P == x % P)
            name = f"M2: live slot {x} mapped into SWA page {q} => page {q} allocated to its owner, same offset"
            clauses.append((name, z3.Implies(mapped_into(s, x, q), paired)))
    for x in REAL_SLOTS:
        for y in (y for y in REAL_SLOTS if y > x):
            both = z3.And(s.live[x], s.live[y], s.M[x] > 0, s.M[y] > 0)
            clauses.append((f"M2: live slots {x} and {y} map to distinct SWA slots",
                            z3.Implies(both, s.M[x] != s.M[y])))
            if page_locality and x // P != y // P:
                same_page = z3.Or([z3.And(swa_page_of(s.M[x], q), swa_page_of(s.M[y], q)) for q in PAGES])
                clauses.append((f"locality: live slots {x} and {y} on different full pages use different SWA pages",
                                z3.Implies(both, z3.Not(same_page))))
    for q in PAGES:
        clauses.append((f"G3: allocated SWA page {q} is mapped from a live full slot",
                        z3.Implies(z3.Not(z3.Or(s.swa_free[q], s.held_swa[q])), _in_use(s, q))))
    return clauses


def _set_full_to_swa_mapping(v: Variant) -> Callable[[State, Action, State], z3.BoolRef]:
    def set_full_to_swa_mapping(s: State, a: Action, t: State) -> z3.BoolRef:
        """``M[full_indices] = swa_indices`` on live slots (values 0 or real SWA slots); the new live mapping must
        pass the reference's check (M2, M5, G3); an empty call changes nothing, any other releases (epoch)."""
        on = _entries(a)
        values = [z3.Implies(on[i], z3.Or(a.value[i] == 0, _real_slot(a.value[i]))) for i in range(ARGS)]
        checked = [c for _, c in live_mapping_clauses(t)] if v.mapping_checked else []
        writes = [t.M[x] == _write(s.M[x], [(z3.And(on[i], a.loc[i] == x), a.value[i]) for i in range(ARGS)])
                  for x in REAL_SLOTS]
        return z3.And(*_given_live(s, a, distinct=True), *values, *writes, *checked, t.backup == z3.And(s.backup,
                                                                                                       a.n == 0),
                      *_ts.unchanged_except(s, t, "M", "backup"))

    return set_full_to_swa_mapping


def translations(s: State, a: Action) -> list[z3.BoolRef]:
    """Name ``M[loc[i]]`` ``result[i]``: the translation ``set_kv_buffer`` / ``get_cpu_copy`` / ``load_cpu_copy``
    make of their slots (padding 0: ``M[0] = 0``); one symbolic read per entry, shared by the formulas."""
    return [a.result[i] == _int(s.M, a.loc[i]) for i in range(ARGS)]


def swa_destination(s: State, a: Action, i: int) -> z3.ArithRef:
    """Where ``set_kv_buffer`` writes entry ``i`` of an SWA layer: ``M[loc[i]]``, named ``result[i]``."""
    return a.result[i]


def _set_kv_buffer(v: Variant) -> Callable[[State, Action, State], z3.BoolRef]:
    def set_kv_buffer(s: State, a: Action, t: State) -> z3.BoolRef:
        """Rows ``value`` of one layer for tokens at full slots ``loc`` (live, or 0 for padding; a write to slot 0
        is dropped): the full layer at ``loc``, the SWA layer at ``M[loc]`` (§1.4, §2.8)."""
        on = _entries(a)
        given = [z3.And(on[i], a.loc[i] != 0) for i in range(ARGS)]
        loc_ok = [z3.Implies(given[i], _bool(s.live, a.loc[i]) if v.kv_checks_loc else _real_slot(a.loc[i]))
                  for i in range(ARGS)]
        full = [z3.And(z3.Not(a.swa_layer), given[i]) for i in range(ARGS)]
        swa = [z3.And(a.swa_layer, on[i], swa_destination(s, a, i) > 0) for i in range(ARGS)]
        return z3.And(
            *translations(s, a), a.n >= 0, a.n <= ARGS, *loc_ok, *_distinct(given, a.loc),
            *[z3.Implies(on[i], a.value[i] >= 1) for i in range(ARGS)],
            *[t.kv_full[x] == _write(s.kv_full[x], [(z3.And(full[i], a.loc[i] == x), a.value[i])
                                                    for i in range(ARGS)]) for x in REAL_SLOTS],
            *[t.kv_swa[y] == _write(s.kv_swa[y], [(z3.And(swa[i], swa_destination(s, a, i) == y), a.value[i])
                                                  for i in range(ARGS)]) for y in REAL_SLOTS],
            *_ts.unchanged_except(s, t, "kv_full", "kv_swa"),
        )

    return set_kv_buffer


def _get_cpu_copy(v: Variant) -> Callable[[State, Action, State], z3.BoolRef]:
    def get_cpu_copy(s: State, a: Action, t: State) -> z3.BoolRef:
        """A read: the caller now holds, per position ``j`` of the live ``indices``, the full row, ``swa_mask[j] =
        M[indices[j]] > 0`` and the SWA row at ``M[indices[j]]`` if masked (§2.8); nothing else changes."""
        on = _entries(a)
        cells = []
        for j in range(ARGS):
            m = a.result[j]
            mask = z3.And(on[j], m > 0)
            row = _int(s.kv_swa, m if v.copy_translates else a.loc[j])
            cells += [t.copy_full[j] == z3.If(on[j], _int(s.kv_full, a.loc[j]), 0), t.copy_mask[j] == mask,
                      t.copy_swa[j] == z3.If(mask, row, 0)]
        return z3.And(*translations(s, a), *_given_live(s, a, distinct=False), t.copy_len == a.n, *cells,
                      *_ts.unchanged_except(s, t, "copy_len", "copy_full", "copy_mask", "copy_swa"))

    return get_cpu_copy


def load_writes(s: State, a: Action, v: Variant = FIXED) -> tuple[list[tuple[z3.BoolRef, z3.ArithRef, z3.ArithRef]],
                                                                  z3.BoolRef]:
    """The SWA writes of ``load_cpu_copy`` as ``(on, slot, row)`` in order, and whether torch raises.

    #24857: ``row_mask = new_mask[old_mask]``, rows ``swa[row_mask]`` to ``t[old_mask][row_mask]``: saved
    position ``j`` with ``M[indices[j]] > 0`` gets its own row. Legacy: ``row_mask = new_mask`` (over all
    positions) applied to the saved rows, destinations ``t[new_mask]`` (IndexError unless the mask is all true
    or every position was saved). Nothing is written without saved rows or without destinations.
    """
    on = _entries(a)
    new = list(a.result)  # named by translations()
    saved_any = z3.Or([z3.And(on[j], s.copy_mask[j]) for j in range(ARGS)])
    if not v.legacy_row_mask:
        writes = [(z3.And(saved_any, on[j], s.copy_mask[j], new[j] > 0), new[j], s.copy_swa[j]) for j in range(ARGS)]
        return writes, z3.BoolVal(False)
    new_mask = [z3.And(on[j], new[j] > 0) for j in range(ARGS)]
    saved, num_saved = compress(s.copy_mask, s.copy_swa)
    all_new = z3.And([z3.Implies(on[j], new[j] > 0) for j in range(ARGS)])
    filtered, num_filtered = compress(new_mask, saved)
    rows = [z3.If(all_new, kept, chosen) for kept, chosen in zip(saved, filtered, strict=True)]
    num_rows = z3.If(all_new, num_saved, num_filtered)
    dest, num_dest = compress(new_mask, new)
    raises = z3.And(saved_any, num_dest > 0, z3.Not(all_new), a.n != num_saved)
    writes = [(z3.And(saved_any, k < num_rows, k < num_dest), dest[k], rows[k]) for k in range(ARGS)]
    return writes, raises


def _load_cpu_copy(v: Variant) -> Callable[[State, Action, State], z3.BoolRef]:
    def load_cpu_copy(s: State, a: Action, t: State) -> z3.BoolRef:
        """``load_cpu_copy(copy, indices)``: the held copy's positions into new live, distinct ``indices`` (same
        count): every full row, and the SWA rows by :func:`load_writes` (§2.8)."""
        on = _entries(a)
        writes, raises = load_writes(s, a, v)
        return z3.And(
            *translations(s, a), *_given_live(s, a, distinct=v.load_distinct_indices), a.n == s.copy_len,
            z3.Not(raises),
            *[t.kv_full[x] == _write(s.kv_full[x], [(z3.And(on[j], a.loc[j] == x), s.copy_full[j])
                                                    for j in range(ARGS)]) for x in REAL_SLOTS],
            *[t.kv_swa[y] == _write(s.kv_swa[y], [(z3.And(hit, slot == y), row) for hit, slot, row in writes])
              for y in REAL_SLOTS],
            *_ts.unchanged_except(s, t, "kv_full", "kv_swa"),
        )

    return load_cpu_copy


def translate_loc_from_full_to_swa(s: State, a: Action, t: State) -> z3.BoolRef:
    """A read: ``result[i] = M[loc[i]]`` for ``-1 <= loc[i] < 8`` (``M[-1] = -1``, the sentinel); nothing changes."""
    on = _entries(a)
    return z3.And(
        a.n >= 0, a.n <= ARGS,
        *[z3.Implies(on[i], z3.And(a.loc[i] >= -1, a.loc[i] < NUM_SLOTS,
                                   a.result[i] == z3.If(a.loc[i] == -1, -1, _int(s.M, a.loc[i]))))
          for i in range(ARGS)],
        *_ts.unchanged_except(s, t),
    )


# ---- the inductive invariant ------------------------------------------------------------------------------


def _core_clauses(s: State, variant: Variant) -> list[Clause]:
    """M1, the page bookkeeping, and M2 / M5 / G3 as maintained (live slots only); each clause named."""
    clauses: list[Clause] = []
    for x in REAL_SLOTS:
        clauses.append((f"M1: M[{x}] is 0 or a real SWA slot", z3.Or(s.M[x] == 0, _real_slot(s.M[x]))))
    for g in PAGES:
        idle = z3.And(s.full_owner[g] == 0, *[z3.Not(s.live[g * P + o]) for o in range(P)])
        clauses.append((f"G3: full page {g} is free or held back iff unowned, and then nothing on it is live",
                        z3.And(z3.Implies(z3.Or(s.full_free[g], s.held_full[g]), idle),
                               z3.Implies(z3.Not(z3.Or(s.full_free[g], s.held_full[g])), s.full_owner[g] >= 1))))
        clauses.append((f"G3: SWA page {g} is free or held back iff unowned",
                        z3.And(z3.Or(s.swa_free[g], s.held_swa[g]) == (s.swa_owner[g] == 0), s.swa_owner[g] >= 0)))
        clauses.append((f"group: page {g} is held back only by an open group, and then is in no free list",
                        z3.And(z3.Implies(z3.Or(s.held_full[g], s.held_swa[g]), s.grp),
                               z3.Implies(s.held_full[g], z3.Not(s.full_free[g])),
                               z3.Implies(s.held_swa[g], z3.Not(s.swa_free[g])))))
        clauses.append((f"full page {g}: page index 0 or 1", z3.And(s.page_index[g] >= 0, s.page_index[g] <= 1)))
    return clauses + live_mapping_clauses(s, page_locality=variant.page_locality) + _row_clauses(s)


def _row_clauses(s: State) -> list[Clause]:
    """Rows are tags >= 0 (0 = undefined); a held copy has 0..ARGS positions, nothing past them, and an SWA row
    only where masked. Not needed by any proof, but they keep counterexamples readable."""
    rows = z3.And(*[s.kv_full[x] >= 0 for x in REAL_SLOTS], *[s.kv_swa[x] >= 0 for x in REAL_SLOTS])
    cells = [z3.And(s.copy_full[j] >= 0, s.copy_swa[j] >= 0, z3.Implies(z3.Not(s.copy_mask[j]), s.copy_swa[j] == 0),
                    z3.Implies(j >= s.copy_len, z3.And(s.copy_full[j] == 0, z3.Not(s.copy_mask[j]))))
             for j in range(ARGS)]
    return [("rows: tags >= 0", rows),
            ("copy: 0..4 positions, tags >= 0, SWA rows only where masked",
             z3.And(s.copy_len >= 0, s.copy_len <= ARGS, *cells)),
            ("backup: a valid backup is held", z3.Implies(s.backup, s.bk_held))]


def backup_clauses(s: State) -> list[Clause]:
    """What a held backup must satisfy for ``restore_state`` to land in an invariant state (only allocations
    happened since ``backup_state``: they take free pages and make new slots live, never touching M elsewhere)."""
    clauses: list[Clause] = []
    for g in PAGES:
        clauses.append((f"backup: full page {g} free now => free in the backup",
                        z3.Implies(s.full_free[g], s.bk_full_free[g])))
        clauses.append((f"backup: SWA page {g} free now => free in the backup",
                        z3.Implies(s.swa_free[g], s.bk_swa_free[g])))
        clauses.append((f"backup: page {g} held back by the open group => in use in the backup too (held since)",
                        z3.And(z3.Implies(s.held_full[g], z3.Not(s.bk_full_free[g])),
                               z3.Implies(s.held_swa[g], z3.Not(s.bk_swa_free[g])))))
        clauses.append((f"backup: full page {g} free in the backup => none of its slots live in it",
                        z3.Implies(s.bk_full_free[g], z3.And([z3.Not(s.bk_live[g * P + o]) for o in range(P)]))))
    for x in REAL_SLOTS:
        clauses.append((f"backup: slot {x} live in the backup => live now", z3.Implies(s.bk_live[x], s.live[x])))
        for q in PAGES:
            clauses.append((f"backup: slot {x} live in the backup and mapped into SWA page {q} => page {q} allocated "
                            "in the backup", z3.Implies(z3.And(s.bk_live[x], s.M[x] > 0, swa_page_of(s.M[x], q)),
                                                        z3.Not(s.bk_swa_free[q]))))
    for q in PAGES:
        used = z3.Or([z3.And(s.bk_live[x], s.M[x] > 0, swa_page_of(s.M[x], q)) for x in REAL_SLOTS])
        clauses.append((f"backup: SWA page {q} allocated in the backup and not held back => mapped from a slot live "
                        "in it (G3)", z3.Implies(z3.And(z3.Not(s.bk_swa_free[q]), z3.Not(s.held_swa[q])), used)))
    return clauses


def invariant_clauses(s: State, variant: Variant = FIXED) -> list[Clause]:
    """M2 as maintained with its page bookkeeping, and, while the caller holds a valid backup, what makes the state
    ``restore_state`` would produce satisfy them too (:func:`backup_clauses`)."""
    return _core_clauses(s, variant) + [(name, z3.Implies(s.backup, c)) for name, c in backup_clauses(s)]


def intended_clauses(s: State) -> list[Clause]:
    """M2 as intended (§7): every ``M[f] > 0``, live or not, sits on allocated full and SWA pages."""
    clauses = []
    for x in REAL_SLOTS:
        target_allocated = z3.And([z3.Implies(swa_page_of(s.M[x], q), z3.Not(s.swa_free[q])) for q in PAGES])
        clauses.append((f"M2 as intended: M[{x}] > 0 => full page {x // P} and its SWA page allocated",
                        z3.Implies(s.M[x] > 0, z3.And(z3.Not(s.full_free[x // P]), target_allocated))))
    return clauses


# ---- rendering --------------------------------------------------------------------------------------------

COLUMNS = ("full free", "SWA free", "M (nonzero)", "live slot:owner", "backup held", "KV full", "KV SWA",
           "CPU copy held", "free group")


def _ints(xs: Sequence[int]) -> str:
    return " ".join(map(str, xs)) if xs else "-"


def _tag(tag: int) -> str:
    return f"r{tag}" if tag else "-"


def _rows(model: z3.ModelRef, rows: Sequence[z3.ArithRef]) -> str:
    return " ".join(f"{x}:{_tag(v)}" for x in REAL_SLOTS if (v := as_int(model, rows[x])))


def _free_pages(model: z3.ModelRef, flags: Sequence[z3.BoolRef]) -> list[int]:
    return [g for g in PAGES if as_bool(model, flags[g])]


def cells(model: z3.ModelRef, s: State) -> tuple[str, ...]:
    """A state as table cells; the optional columns (backup, rows, copy, group) are ``""`` when empty."""
    live = [(x, as_int(model, s.full_owner[x // P])) for x in REAL_SLOTS if as_bool(model, s.live[x])]
    backup = ""
    if as_bool(model, s.bk_held):
        bk_live = [x for x in REAL_SLOTS if as_bool(model, s.bk_live[x])]
        bk_full, bk_swa = _ints(_free_pages(model, s.bk_full_free)), _ints(_free_pages(model, s.bk_swa_free))
        stale = "" if as_bool(model, s.backup) else " (stale: released since)"
        backup = f"full free {bk_full}; SWA free {bk_swa}; live {_ints(bk_live)}{stale}"
    copy = ""
    if (n := as_int(model, s.copy_len)) > 0:
        mask = [as_bool(model, b) for b in s.copy_mask[:n]]
        full = " ".join(_tag(as_int(model, c)) for c in s.copy_full[:n])
        swa = " ".join(_tag(as_int(model, c)) if m else "-" for c, m in zip(s.copy_swa[:n], mask, strict=True))
        copy = f"full {full}; swa_mask {fmt_bools(mask)}; SWA {swa}"
    return (
        _ints(_free_pages(model, s.full_free)), _ints(_free_pages(model, s.swa_free)),
        " ".join(f"{x}->{m}" for x in REAL_SLOTS if (m := as_int(model, s.M[x]))) or "-",
        " ".join(f"{x}:{o}" for x, o in live) or "-", backup, _rows(model, s.kv_full), _rows(model, s.kv_swa), copy,
        (f"open; holds full {_ints(_free_pages(model, s.held_full))}, SWA {_ints(_free_pages(model, s.held_swa))}"
         if as_bool(model, s.grp) else ""),
    )


def describe(model: z3.ModelRef, step: Step[State, Action]) -> str:
    """The call of a step with its arguments and what it took or released."""
    op, s, a, t = step.op_name(model), step.pre, step.action, step.post
    p, n, tail, req = (as_int(model, x) for x in (a.prefix, a.seq, a.tail, a.req))
    took_full = sorted(set(_free_pages(model, s.full_free)) - set(_free_pages(model, t.full_free)))
    took_swa = sorted(set(_free_pages(model, s.swa_free)) - set(_free_pages(model, t.swa_free)))
    took = f"full pages {_ints(took_full)}, SWA pages {_ints(took_swa)}"
    back_full = sorted(set(_free_pages(model, t.full_free)) - set(_free_pages(model, s.full_free)))
    back_swa = sorted(set(_free_pages(model, t.swa_free)) - set(_free_pages(model, s.swa_free)))
    k = max(0, min(as_int(model, a.n), ARGS))
    locs, values = [as_int(model, x) for x in a.loc[:k]], [as_int(model, x) for x in a.value[:k]]
    touched = [g for g in PAGES if as_bool(model, a.pages[g])]
    slots = [x for x in REAL_SLOTS if x // P in touched and as_bool(model, s.live[x])]
    last = f", last_loc={as_int(model, _Extend(s, a, z3.BoolVal(False)).last_loc)}" if p > 0 else ""
    if op == "alloc":
        return f"alloc(need_size={n}) -> request {req}: {took}"
    taken = sorted(set(_free_pages(model, s.full_free)) - set(_free_pages(model, t.full_free)))
    leaked = [g for g in taken if as_int(model, t.full_owner[g]) == 0]
    if op == "alloc_decode" and leaked:
        return f"alloc_decode(seq={n}{last}) -> SWA pool short: None, but full page {leaked[0]} is taken (R7)"
    if op in ("alloc_extend", "alloc_decode"):
        args = f"prefix={p}, seq={n}" if op == "alloc_extend" else f"seq={n}"
        return f"{op}({args}{last}) -> request {req}: {took}"
    if op == "alloc_extend_swa_tail":
        return f"alloc_extend_swa_tail(prefix={p}, seq={n}, swa_tail_len={tail}{last}) -> request {req}: {took}"
    if op in RELEASES:
        return f"{op}({slots}) -> releases full pages {_ints(back_full)}, SWA pages {_ints(back_swa)}"
    if op == "restore_state":
        return f"restore_state() -> gives back full pages {_ints(back_full)}, SWA pages {_ints(back_swa)}"
    if op == "set_full_to_swa_mapping":
        return f"set_full_to_swa_mapping({locs}, {values})"
    if op == "set_kv_buffer":
        rows = " ".join(_tag(v) for v in values)
        if as_bool(model, a.swa_layer):
            dest = [as_int(model, swa_destination(s, a, i)) for i in range(k)]
            return f"set_kv_buffer(SWA layer, loc {locs}, rows {rows}) -> SWA slots {dest}"
        return f"set_kv_buffer(full layer, loc {locs}, rows {rows})"
    if op == "get_cpu_copy":
        return f"get_cpu_copy({locs}) -> swa_mask {fmt_bools([as_bool(model, b) for b in t.copy_mask[:k]])}"
    if op == "load_cpu_copy":
        return f"load_cpu_copy(copy, {locs})"
    if op == "translate_loc_from_full_to_swa":
        return f"translate_loc_from_full_to_swa({locs}) -> {[as_int(model, x) for x in a.result[:k]]}"
    return f"{op}()"


# ---- the system -------------------------------------------------------------------------------------------


def system(variant: Variant = FIXED) -> TransitionSystem[State, Action]:
    """The bounded allocator with ``variant``'s (possibly broken) parts."""
    transitions: dict[str, Callable[[State, Action, State], z3.BoolRef]] = {
        **{op: _allocation(variant, op) for op in ALLOCATIONS},
        **{op: _releasing(variant, op) for op in RELEASES},
        "free_group_begin": _group_begin(variant),
        "free_group_end": _group_end(variant),
        "clear": _clear(variant),
        "backup_state": backup_state,
        "restore_state": _restore_state(variant),
        "set_full_to_swa_mapping": _set_full_to_swa_mapping(variant),
        "set_kv_buffer": _set_kv_buffer(variant),
        "get_cpu_copy": _get_cpu_copy(variant),
        "load_cpu_copy": _load_cpu_copy(variant),
        "translate_loc_from_full_to_swa": translate_loc_from_full_to_swa,
    }
    return TransitionSystem(
        component=COMPONENT, state=State.fresh, action=Action.fresh, init=lambda s: init(s, variant),
        transitions=transitions, invariant=lambda s: invariant_clauses(s, variant), columns=COLUMNS, cells=cells,
        describe=describe, combine=_combine(variant, transitions),
    )


def _combine(v: Variant, transitions: Mapping[str, Callable[[State, Action, State], z3.BoolRef]]) -> Callable[
        [Step[State, Action], tuple[str, ...]], z3.BoolRef]:
    """The step relation over several ops: the allocations share one :func:`_extend` (its mode chosen by the op),
    the other ops are a disjunction. Agrees with ``transitions`` op by op (``tests/spec/test_swa_allocator.py``)."""

    def combine(step: Step[State, Action], allowed: tuple[str, ...]) -> z3.BoolRef:
        s, a, t = step.pre, step.action, step.post
        allocations = [op for op in allowed if op in ALLOCATIONS]
        parts = [z3.And(step.is_(op), transitions[op](s, a, t)) for op in allowed
                 if op not in ALLOCATIONS and op not in RELEASES]
        releases = [op for op in allowed if op in RELEASES]
        if releases:
            flags = _release_flags(v, lambda op: step.is_(op) if op in releases else z3.BoolVal(False))
            parts.append(z3.And(step.performs(releases), _release(s, a, t, v, **flags)))
        if allocations:
            def mode(op: str) -> z3.BoolRef:
                return step.is_(op) if op in allocations else z3.BoolVal(False)

            chosen = z3.Or([z3.And(step.is_(op), _allocation_args(op, a)) for op in allocations])
            parts.append(z3.And(chosen, _extend(s, a, t, v, tail=mode("alloc_extend_swa_tail"), bulk=mode("alloc"))))
            if "alloc_decode" in allocations and not v.atomic_decode:
                parts.append(z3.And(step.is_("alloc_decode"), _allocation_args("alloc_decode", a),
                                    _decode_leak(s, a, t)))
        return z3.Or(parts)

    return combine


SYSTEM = system(FIXED)


def _fresh_ids(step: Step[State, Action]) -> list[z3.BoolRef]:
    """Symmetry breaking for BMC: a new request in step ``i`` is request ``i + 1`` (ids are arbitrary)."""
    a = step.action
    extends = z3.And(step.performs(("alloc_extend", "alloc_decode", "alloc_extend_swa_tail")), a.prefix == 0)
    return [z3.Implies(z3.Or(step.is_("alloc"), extends), a.req == step.index + 1)]


#: Every run, with fresh request ids fixed per step.
SEARCH: Search[State, Action] = Search(facts=_fresh_ids)

#: The ops that change the allocator, and a stutter (a translation changes nothing, of 0 slots included): the
#: KV-row ops change neither pages, M nor liveness, so a run with them is a shorter run without them, padded with
#: the stutter; safety is decided on the others.
POOL_OPS = tuple(op for op in OPS if op not in ("set_kv_buffer", "get_cpu_copy", "load_cpu_copy"))
POOL: Search[State, Action] = Search(POOL_OPS, _fresh_ids)


def _new_requests(step: Step[State, Action]) -> list[z3.BoolRef]:
    return [*_fresh_ids(step), step.action.prefix == 0]


#: A draft (backup_state, allocations of new requests, restore_state), then tail allocations and evictions: the
#: runs of S3's and R3's traces (a narrower search finds them faster; every run found is a run of the model).
DRAFTS: Search[State, Action] = Search(("alloc_extend", "backup_state", "restore_state", "alloc_extend_swa_tail",
                                        "free_swa"), _new_requests)


# ---- safety -----------------------------------------------------------------------------------------------


def double_free(step: Step[State, Action]) -> z3.BoolRef:
    """``free`` / ``free_swa`` releases an SWA page (through M) that is already free."""
    released = released_by_mapping(step.pre, step.action)
    return z3.And(step.performs(SWA_RELEASES),
                  z3.Or([z3.And(released[q], step.pre.swa_free[q]) for q in PAGES]))


def release_in_use(step: Step[State, Action]) -> z3.BoolRef:
    """The step gives back an SWA page that a live full slot still maps to afterwards."""
    s, t = step.pre, step.post
    return z3.Or([z3.And(z3.Not(s.swa_free[q]), t.swa_free[q], _in_use(t, q)) for q in PAGES])


def handout_in_use(step: Step[State, Action]) -> z3.BoolRef:
    """The step takes an SWA page from the free list that a live full slot maps to (aliasing)."""
    s, t = step.pre, step.post
    return z3.Or([z3.And(s.swa_free[q], z3.Not(t.swa_free[q]), _in_use(s, q)) for q in PAGES])


def safe_step(step: Step[State, Action]) -> z3.BoolRef:
    """No double free, no release of an SWA page in use, no handing out of one."""
    return z3.Not(z3.Or(double_free(step), release_in_use(step), handout_in_use(step)))


def explain_unsafe(model: z3.ModelRef, step: Step[State, Action]) -> str:
    """Why a step is unsafe, in words."""
    s, a, t, n = step.pre, step.action, step.post, step.index + 1
    for q, released in released_by_mapping(s, a).items():
        if as_bool(model, step.performs(SWA_RELEASES)) and as_bool(model, released) \
                and as_bool(model, s.swa_free[q]):
            return f"step {n}: SWA page {q} is released although it is already free (double free)"
    for q in PAGES:
        users = [x for x in REAL_SLOTS if as_bool(model, mapped_into(t, x, q))]
        if as_bool(model, s.swa_free[q]) or not as_bool(model, t.swa_free[q]) or not users:
            continue
        owner = as_int(model, t.full_owner[users[0] // P])
        return (f"step {n}: SWA page {q} is released while live full slots {users} of request {owner} still map "
                f"to it; its next owner aliases it and request {owner}'s own free releases it again (double free)")
    for q in PAGES:
        users = [x for x in REAL_SLOTS if as_bool(model, mapped_into(s, x, q))]
        if as_bool(model, s.swa_free[q]) and not as_bool(model, t.swa_free[q]) and users:
            return f"step {n}: SWA page {q} is handed out while live full slots {users} still map to it"
    return f"step {n}: unsafe"


S3_EVENT: Target[State, Action] = Target(
    "window eviction releases an SWA page in use", lambda step: z3.And(step.is_("free_swa"), release_in_use(step)),
    explain_unsafe)
UNSAFE: Target[State, Action] = Target("unsafe step", lambda step: z3.Not(safe_step(step)), explain_unsafe)


def _explain_intended(model: z3.ModelRef, step: Step[State, Action]) -> str:
    broken = [name for name, clause in intended_clauses(step.post) if not as_bool(model, clause)]
    return f"after step {step.index + 1}: broken {broken[0]}"


M2_INTENDED_BROKEN: Target[State, Action] = Target(
    "M2 as intended broken", lambda step: z3.Not(z3.And([c for _, c in intended_clauses(step.post)])),
    _explain_intended)


# ---- claims about single ops -------------------------------------------------------------------------------


def _from_invariant(sys: TransitionSystem[State, Action], ops: Sequence[str], goal: Callable[
        [_ts.Unrolling[State, Action]], z3.BoolRef], explain: Callable[[z3.ModelRef, _ts.Unrolling[State, Action]],
                                                                          str]) -> Check:
    """From any invariant state, the steps ``ops`` in order establish ``goal`` (a trace if not)."""

    def build() -> list[z3.BoolRef]:
        u = _ts.Unrolling.fresh(sys, len(ops))
        return [*u.path(Search(ops=tuple(set(ops))), start=sys.holds), *u.run(ops), z3.Not(goal(u))]

    def render(model: z3.ModelRef) -> str:
        u = _ts.Unrolling.fresh(sys, len(ops))
        trace = _ts.trace_of(sys, model, start=MAPPED_START)
        return _ts.Trace(trace.columns, trace.rows, explain(model, u)).table()

    return Check(build, render)


def _owned_result(s: State, full_slot: z3.ArithRef, swa_slot: z3.ArithRef) -> z3.BoolRef:
    """``swa_slot`` is 0, or lies on an SWA page allocated to the owner of ``full_slot``'s page."""
    owner = _int([s.full_owner[x // P] for x in range(NUM_SLOTS)], full_slot)
    return z3.Or(swa_slot == 0, z3.Or([z3.And(swa_page_of(swa_slot, q), z3.Not(s.swa_free[q]),
                                              s.swa_owner[q] == owner) for q in PAGES]))


def _explain_owned(model: z3.ModelRef, s: State, what: str, full_slot: int, swa_slot: int) -> str:
    q = swa_slot // P
    holder = "free" if as_bool(model, s.swa_free[q]) else f"held by request {as_int(model, s.swa_owner[q])}"
    owner = as_int(model, s.full_owner[full_slot // P])
    live = "live" if as_bool(model, s.live[full_slot]) else "not live"
    return (f"{what} full slot {full_slot} ({live}, page of request {owner}) lands on SWA slot {swa_slot}, "
            f"whose page {q} is {holder}")


def _translation_owned(*, live_only: bool) -> Callable[[Step[State, Action]], z3.BoolRef]:
    def good(step: Step[State, Action]) -> z3.BoolRef:
        s, a = step.pre, step.action
        claims = []
        for i in range(ARGS):
            given = z3.And(i < a.n, a.loc[i] >= P)
            if live_only:
                given = z3.And(given, _bool(s.live, a.loc[i]))
            claims.append(z3.Implies(given, _owned_result(s, a.loc[i], a.result[i])))
        return z3.Implies(step.is_("translate_loc_from_full_to_swa"), z3.And(claims))

    return good


def _explain_translation(model: z3.ModelRef, step: Step[State, Action]) -> str:
    s, a = step.pre, step.action
    for i in range(max(0, min(as_int(model, a.n), ARGS))):
        x, m = as_int(model, a.loc[i]), as_int(model, a.result[i])
        if x >= P and m > 0 and not as_bool(model, _owned_result(s, a.loc[i], a.result[i])):
            return f"step {step.index + 1}: translating " + _explain_owned(model, s, "", x, m).lstrip()
    return f"step {step.index + 1}: a translation is not held by its request"


def _kv_writes_owned(step: Step[State, Action]) -> z3.BoolRef:
    s, a = step.pre, step.action
    claims = [z3.Implies(z3.And(a.swa_layer, i < a.n, a.loc[i] != 0),
                         _owned_result(s, a.loc[i], swa_destination(s, a, i))) for i in range(ARGS)]
    return z3.And(claims)


def _explain_kv(model: z3.ModelRef, step: Step[State, Action]) -> str:
    s, a = step.pre, step.action
    for i in range(max(0, min(as_int(model, a.n), ARGS))):
        x, m = as_int(model, a.loc[i]), as_int(model, swa_destination(s, a, i))
        if x != 0 and m > 0 and not as_bool(model, _owned_result(s, a.loc[i], swa_destination(s, a, i))):
            return "the SWA row of " + _explain_owned(model, s, "", x, m).lstrip()
    return "a write lands outside its request's pages"


def _rows_unchanged(u: _ts.Unrolling[State, Action]) -> z3.BoolRef:
    first, last = u.states[0], u.states[-1]
    return z3.And(*[first.kv_full[x] == last.kv_full[x] for x in REAL_SLOTS],
                  *[first.kv_swa[y] == last.kv_swa[y] for y in REAL_SLOTS])


def _same_indices(u: _ts.Unrolling[State, Action]) -> z3.BoolRef:
    a, b = u.actions
    return z3.And(a.n == b.n, *[x == y for x, y in zip(a.loc, b.loc, strict=True)])


def _explain_rows(model: z3.ModelRef, u: _ts.Unrolling[State, Action]) -> str:
    first, last = u.states[0], u.states[-1]
    for pool, before, after in (("full", first.kv_full, last.kv_full), ("SWA", first.kv_swa, last.kv_swa)):
        for x in REAL_SLOTS:
            b, c = as_int(model, before[x]), as_int(model, after[x])
            if b != c:
                return f"the {pool} row at slot {x} changed from {_tag(b)} to {_tag(c)}"
    return "a row changed"


def _round_trip(sys: TransitionSystem[State, Action]) -> Check:
    """get_cpu_copy(idx) then load_cpu_copy(copy, idx) with the same (distinct) indices changes no row."""
    ops = ("get_cpu_copy", "load_cpu_copy")
    check = _from_invariant(sys, ops, _rows_unchanged, _explain_rows)

    def build() -> list[z3.BoolRef]:
        u = _ts.Unrolling.fresh(sys, 2)
        return [*check.build(), _same_indices(u)]

    return Check(build, check.render)


def _own_rows(step: Step[State, Action]) -> z3.BoolRef:
    """After the load, every position holds its saved full row, and each position saved and mapped now holds its
    saved SWA row at ``M[indices[j]]`` (stated per concrete slot: no nested symbolic reads)."""
    s, a, t = step.pre, step.action, step.post
    claims = []
    for j in range(ARGS):
        for x in REAL_SLOTS:
            at = z3.And(j < a.n, a.loc[j] == x)
            claims.append(z3.Implies(at, t.kv_full[x] == s.copy_full[j]))
            claims += [z3.Implies(z3.And(at, s.copy_mask[j], s.M[x] == y), t.kv_swa[y] == s.copy_swa[j])
                       for y in REAL_SLOTS]
    return z3.And(claims)


def _distinct_destinations(step: Step[State, Action]) -> z3.BoolRef:
    """``load_cpu_copy``'s translations ``t = M[indices]`` are pairwise distinct where positive."""
    a = step.action
    return z3.And([z3.Implies(z3.And(i < a.n, k < a.n, a.result[i] > 0), a.result[i] != a.result[k])
                   for i in range(ARGS) for k in range(i + 1, ARGS)])


def _explain_destinations(model: z3.ModelRef, step: Step[State, Action]) -> str:
    a = step.action
    n = max(0, min(as_int(model, a.n), ARGS))
    for i in range(n):
        for k in range(i + 1, n):
            t_i, t_k = as_int(model, a.result[i]), as_int(model, a.result[k])
            if t_i > 0 and t_i == t_k:
                return (f"positions {i} and {k} (full slots {as_int(model, a.loc[i])}, {as_int(model, a.loc[k])}) "
                        f"both translate to SWA slot {t_i}: the later write overwrites the earlier row")
    return "two positions share a destination"


def _destinations_lemma() -> list[z3.BoolRef]:
    """:func:`_distinct_destinations` of the single-step checks' action (proved by
    ``load_cpu_copy.distinct_destinations``)."""
    return [_distinct_destinations(_ts.Step.fresh(SYSTEM))]


def _explain_own_rows(model: z3.ModelRef, step: Step[State, Action]) -> str:
    s, a, t = step.pre, step.action, step.post
    for j in range(max(0, min(as_int(model, a.n), ARGS))):
        x, m = as_int(model, a.loc[j]), as_int(model, a.result[j])
        if as_bool(model, s.copy_mask[j]) and P <= m < NUM_SLOTS:
            got, want = as_int(model, t.kv_swa[m]), as_int(model, s.copy_swa[j])
            if got != want:
                return (f"position {j} (full slot {x}, SWA slot {m}) was saved with SWA row {_tag(want)} but its SWA "
                        f"slot now holds {_tag(got)}")
    return "a position lost its saved row"


def _backup_round_trip(sys: TransitionSystem[State, Action], *, whole_mapping: bool) -> Check:
    """backup_state; an allocation; restore_state gives back the free lists, owners and liveness, and M on the
    slots live before (``whole_mapping``: M everywhere, which R3 breaks)."""
    def goal(u: _ts.Unrolling[State, Action]) -> z3.BoolRef:
        s, t = u.states[0], u.states[-1]
        same = _ts.unchanged(s, t, "full_free", "swa_free", "full_owner", "swa_owner", "live")
        mapping = [s.M[x] == t.M[x] if whole_mapping else z3.Implies(s.live[x], s.M[x] == t.M[x])
                   for x in REAL_SLOTS]
        return z3.And(*same, *mapping)

    def explain(model: z3.ModelRef, u: _ts.Unrolling[State, Action]) -> str:
        s, t = u.states[0], u.states[-1]
        for x in REAL_SLOTS:
            b, c = as_int(model, s.M[x]), as_int(model, t.M[x])
            if b != c:
                return (f"after restore_state M[{x}] = {c}, before backup_state it was {b}: restore_state rolls back "
                        "the free lists, never the mapping (R3)")
        return "the allocator differs from the state before backup_state"

    def build() -> list[z3.BoolRef]:
        u = _ts.Unrolling.fresh(sys, 3)
        backup, allocation, restore = u.steps()
        return [sys.holds(u.states[0]), backup.relation(("backup_state",)), allocation.relation(ALLOCATIONS),
                restore.relation(("restore_state",)), z3.Not(goal(u))]

    def render(model: z3.ModelRef) -> str:
        u = _ts.Unrolling.fresh(sys, 3)
        trace = _ts.trace_of(sys, model, start="(any invariant state)")
        return _ts.Trace(trace.columns, trace.rows, explain(model, u)).table()

    return Check(build, render)


def _quiet(tag: str = "pre", *, rows: bool = True, copy: bool = True, backup: bool = True) -> Callable[
        [], list[z3.BoolRef]]:
    """For a twin (:meth:`Check.also`): state ``tag`` holds no rows / no copy / no backup, so its counterexample
    shows only what it is about."""

    def facts() -> list[z3.BoolRef]:
        s = State.fresh(tag)
        out: list[z3.BoolRef] = []
        if rows:
            out += [*[s.kv_full[x] == 0 for x in REAL_SLOTS], *[s.kv_swa[x] == 0 for x in REAL_SLOTS]]
        if copy:
            out.append(s.copy_len == 0)
        if backup:
            out += [z3.Not(s.bk_held), z3.Not(s.backup)]
        return out

    return facts


def mapped(variant: Variant = FIXED) -> TransitionSystem[State, Action]:
    """``system(variant)`` whose invariant leaves out what a held backup must satisfy: the premise of the claims
    about reads and KV rows (a weaker premise than the whole invariant, so a stronger claim, and a cheaper query)."""
    return dataclasses.replace(system(variant), invariant=lambda s: _core_clauses(s, variant))


MAPPED = mapped()
MAPPED_STATE = "from any state satisfying M1, the page bookkeeping and, on live slots, M2/M5/G3"
MAPPED_START = "(any state, M2 on live slots)"


def _op_obligations() -> tuple[Obligation, ...]:
    """One claim per operation with its broken twin."""

    def keeps(op: str, statement: str, twin: str, twin_statement: str, broken: Variant) -> tuple[Obligation, ...]:
        sound = f"{op}.keeps_invariant"
        return (
            _ts.obligation(SYSTEM, sound, f"post-#25805 bounded allocator: {op} preserves the invariant ({statement})",
                           _ts.consecution(SYSTEM, (op,)), family=FAMILY),
            _ts.obligation(SYSTEM, f"{sound}.{twin}", twin_statement,
                           _ts.consecution(system(broken), (op,)).also(_quiet()), family=FAMILY, twin_of=sound),
        )

    m2 = "M2/M5/G3 on live slots and the page bookkeeping"
    no_epoch = system(Variant(restore_checks_epoch=False))
    restore_search: Search[State, Action] = Search(("alloc_extend", "backup_state", "free", "restore_state"),
                                                   _new_requests)
    translate_search: Search[State, Action] = Search(
        ("alloc_extend", "backup_state", "restore_state", "translate_loc_from_full_to_swa"), _new_requests)
    freed = Target("translation of a freed slot not held by its request",
                   lambda step: z3.Not(_translation_owned(live_only=False)(step)), _explain_translation)
    return (
        *keeps("alloc", m2, "stale_mapping", "an alloc that does not write M leaves the new live slots mapped to "
               "whatever an earlier owner left there", Variant(alloc_writes_mapping=False)),
        *keeps("alloc_extend", f"{m2}; a continued page continues its SWA page, M5", "unmapped_last_loc",
               "without the M5 check an alloc_extend continuing a page whose SWA side was released writes into the "
               "reserved SWA page 0", Variant(checks_continuation=False)),
        *keeps("alloc_decode", m2, "non_atomic", "upstream's non-atomic alloc_decode takes the full page when the SWA "
               "pool is short and leaks it to no request (R7, G3)", Variant(atomic_decode=False)),
        *keeps("alloc_extend_swa_tail", f"{m2}; the new non-tail slots get M = 0", "pre_25805",
               "pre-#25805 the new non-tail slots keep stale M entries (R1)", PRE_25805),
        *keeps("free", m2, "full_side_only", "a free of the full pages only strands their SWA pages (G3)",
               Variant(free_releases_swa=False)),
        *keeps("free_swa", f"{m2}; M = 0 on the touched pages", "no_clear",
               "a free_swa that does not clear M leaves live slots mapped to released SWA pages",
               Variant(free_swa_clears=False)),
        *keeps("free_full", f"{m2}; only pages whose live slots have M = 0", "unchecked", "a free_full of pages whose "
               "SWA side is still mapped strands their SWA pages (G3)", Variant(free_full_checks_peer=False)),
        *keeps("free_segment", f"{m2}; a segment whose live slots all have their SWA peer", "full_side_only",
               "a segment release without its SWA side (free_full_segment of mapped positions, unchecked) strands "
               "their SWA pages (G3)", Variant(segment_releases_swa=False)),
        *keeps("free_swa_segment", f"{m2}; M = 0 on the touched pages", "no_clear",
               "a free_swa_segment that does not clear M leaves live slots mapped to released SWA pages",
               Variant(segment_swa_clears=False)),
        *keeps("free_full_segment", f"{m2}; only pages whose live slots have M = 0", "unchecked",
               "a free_full_segment of pages whose SWA side is still mapped strands their SWA pages (G3)",
               Variant(full_segment_checks_peer=False)),
        *keeps("free_kv_row_segments", f"{m2}; released pages before the cursor, mapped ones after it",
               "full_side_only", "a kv-row release that frees every segment full side only strands the SWA pages "
               "past the eviction cursor (G3)", Variant(kv_row_releases_swa=False)),
        *keeps("free_group_begin", f"{m2}; held pages only while a group is open", "nested_reset",
               "without 0.5.23's no-nesting assertion a second free_group_begin resets the piles and the pages the "
               "open group held are neither free nor held by anyone (G3)", Variant(group_begin_checks_nesting=False)),
        *keeps("free_group_end", f"{m2}; every held page back in its free list", "full_pile_only",
               "a free_group_end that gives back the full pile only leaves the held SWA pages allocated to no live "
               "slot (G3)", Variant(group_end_releases_swa=False)),
        *keeps("clear", m2, "full_pool_only", "a clear() of the full allocator only keeps every SWA page allocated "
               "to no live slot (G3)", Variant(clear_swa_pool=False)),
        _ts.obligation(SYSTEM, "restore_state.keeps_invariant", f"post-#25805 bounded allocator: restore_state after "
                       f"only allocations since backup_state preserves the invariant ({m2})",
                       _ts.consecution(SYSTEM, ("restore_state",)), family=FAMILY),
        _ts.obligation(SYSTEM, "restore_state.keeps_invariant.after_release", "a restore_state after a release since "
                       "its backup_state resurrects the released pages with stale owners and mappings (BMC from "
                       "clear())", _ts.reachable(no_epoch, _ts.invariant_broken(no_epoch), 5,
                                                 search=restore_search),
                       family=FAMILY, twin_of="restore_state.keeps_invariant"),
        *keeps("set_full_to_swa_mapping", f"{m2}, which the call checks", "unchecked", "upstream's unchecked "
               "M[full] = swa can map a live slot to an SWA page its request does not hold (M2)",
               Variant(mapping_checked=False)),
        _ts.obligation(SYSTEM, "backup_state.round_trip", "from any invariant state, backup_state, one allocation, "
                       "restore_state give back both free lists, the page owners, the live slots and M on them",
                       _backup_round_trip(SYSTEM, whole_mapping=False), family=FAMILY),
        _ts.obligation(SYSTEM, "backup_state.round_trip.whole_mapping", "restore_state does not give back M on the "
                       "slots the draft allocation used (R3)",
                       _backup_round_trip(SYSTEM, whole_mapping=True).also(_quiet("0")),
                       family=FAMILY, twin_of="backup_state.round_trip"),
        _ts.obligation(SYSTEM, "get_cpu_copy.round_trip", f"{MAPPED_STATE}, get_cpu_copy(idx) then "
                       "load_cpu_copy(copy, idx) into the same live, distinct slots leaves every full and SWA row as "
                       "it was", _round_trip(MAPPED), family=FAMILY),
        _ts.obligation(SYSTEM, "get_cpu_copy.round_trip.untranslated", "a get_cpu_copy that reads the SWA rows at the "
                       "full slot ids (no M translation) loads other rows back",
                       _round_trip(mapped(Variant(copy_translates=False))).also(_quiet("0", rows=False)), family=FAMILY,
                       twin_of="get_cpu_copy.round_trip"),
        _ts.obligation(SYSTEM, "load_cpu_copy.distinct_destinations", f"{MAPPED_STATE}, load_cpu_copy's "
                       "translations t = M[indices] of its live, distinct indices are distinct where positive",
                       _ts.safety(MAPPED, _distinct_destinations, _explain_destinations, ("load_cpu_copy",),
                                  start=MAPPED_START), family=FAMILY),
        _ts.obligation(SYSTEM, "load_cpu_copy.distinct_destinations.duplicate_indices", "with an index twice (as "
                       "get_cpu_copy allows, load_cpu_copy does not) two positions share an SWA destination",
                       _ts.safety(mapped(Variant(load_distinct_indices=False)), _distinct_destinations,
                                  _explain_destinations, ("load_cpu_copy",), start=MAPPED_START).also(
                           _quiet(rows=False, copy=False)), family=FAMILY,
                       twin_of="load_cpu_copy.distinct_destinations"),
        _ts.obligation(SYSTEM, "load_cpu_copy.restores_own_rows", f"{MAPPED_STATE}, given "
                       "load_cpu_copy.distinct_destinations, load_cpu_copy puts every saved full row on its position "
                       "and every saved SWA row of a position mapped now on that position's SWA slot",
                       _ts.safety(MAPPED, _own_rows, _explain_own_rows, ("load_cpu_copy",), start=MAPPED_START)
                       .also(_destinations_lemma), family=FAMILY),
        _ts.obligation(SYSTEM, "load_cpu_copy.restores_own_rows.legacy_row_mask", "the legacy load (row_mask = "
                       "new_mask, destinations t[new_mask]) puts a saved SWA row on another position (S4)",
                       _ts.safety(mapped(Variant(legacy_row_mask=True)), _own_rows, _explain_own_rows,
                                  ("load_cpu_copy",), start=MAPPED_START).also(_quiet(rows=False, copy=False)),
                       family=FAMILY, twin_of="load_cpu_copy.restores_own_rows"),
        _ts.obligation(SYSTEM, "set_kv_buffer.writes_own_pages", f"{MAPPED_STATE}, an SWA-layer "
                       "set_kv_buffer of live slots writes only SWA slots on pages their requests hold (or drops "
                       "the row)", _ts.safety(MAPPED, _kv_writes_owned, _explain_kv, ("set_kv_buffer",),
                                  start=MAPPED_START),
                       family=FAMILY),
        _ts.obligation(SYSTEM, "set_kv_buffer.writes_own_pages.unchecked_loc", "without the liveness check a write "
                       "through a freed slot's stale M lands on an SWA page another request holds or a free one",
                       _ts.safety(mapped(Variant(kv_checks_loc=False)), _kv_writes_owned, _explain_kv,
                                  ("set_kv_buffer",), start=MAPPED_START).also(_quiet(rows=False)),
                       family=FAMILY, twin_of="set_kv_buffer.writes_own_pages"),
        _ts.obligation(SYSTEM, "translate_loc_from_full_to_swa.live_result_owned", f"{MAPPED_STATE}, the "
                       "translation of a live full slot is 0 or an SWA slot on a page its request holds",
                       _ts.safety(MAPPED, _translation_owned(live_only=True), _explain_translation,
                                  ("translate_loc_from_full_to_swa",), start=MAPPED_START), family=FAMILY),
        _ts.obligation(SYSTEM, "translate_loc_from_full_to_swa.live_result_owned.freed_slot", "the translation of a "
                       "slot freed by restore_state is a stale SWA slot of a free page (R3; BMC from clear())",
                       _ts.reachable(SYSTEM, freed, 4, search=translate_search), family=FAMILY,
                       twin_of="translate_loc_from_full_to_swa.live_result_owned"),
    )


# ---- obligations ------------------------------------------------------------------------------------------

NAME = "no_double_free"
CLEAR_FORGETS_M = Variant(clear_resets_mapping=False)
NO_LOCALITY = Variant(page_locality=False)

OBLIGATIONS: tuple[Obligation, ...] = (
    _ts.obligation(SYSTEM, f"{NAME}.initiation", "post-#25805 bounded allocator: clear() establishes the invariant "
                   "(M2 as maintained, G3)", _ts.initiation(SYSTEM), family=FAMILY),
    _ts.obligation(SYSTEM, f"{NAME}.initiation.clear_keeps_mapping", "a clear() that forgets M[:-1] = 0 starts "
                   "outside M1", _ts.initiation(system(CLEAR_FORGETS_M)), family=FAMILY,
                   twin_of=f"{NAME}.initiation"),
    _ts.obligation(SYSTEM, f"{NAME}.consecution", f"post-#25805 bounded allocator: every op (the {len(OPS)} "
                   "transitions, named like the reference functions) preserves the invariant (M2 as maintained on "
                   "live slots, G3, and the same after a restore while a backup is held)", _ts.consecution(SYSTEM),
                   family=FAMILY),
    _ts.obligation(SYSTEM, f"{NAME}.consecution.pre_25805", "pre-#25805 alloc_extend_swa_tail leaves stale M on live "
                   "prefix slots (R1)", _ts.consecution(system(PRE_25805)).also(_quiet()), family=FAMILY,
                   twin_of=f"{NAME}.consecution"),
    _ts.obligation(SYSTEM, f"{NAME}.consecution.m2_as_intended", "M2 as intended (every M[f] > 0 on allocated pages) "
                   "is no invariant of the fixed model: within 3 steps of clear(), backup_state, an allocation, "
                   "restore_state break it, because restore_state keeps the draft's M (R3; BMC)",
                   _ts.reachable(SYSTEM, M2_INTENDED_BROKEN, 3, search=DRAFTS), family=FAMILY,
                   twin_of=f"{NAME}.consecution"),
    _ts.obligation(SYSTEM, f"{NAME}.safety", "post-#25805 bounded allocator: from any invariant state no op "
                   "double-frees, releases or hands out an SWA page still mapped from a live full slot",
                   _ts.safety(SYSTEM, safe_step, explain_unsafe), family=FAMILY),
    _ts.obligation(SYSTEM, f"{NAME}.safety.no_page_locality", "without 'one SWA page per full page' the invariant "
                   "admits states where free_swa releases a page still in use",
                   _ts.safety(system(NO_LOCALITY), safe_step, explain_unsafe).also(_quiet()), family=FAMILY,
                   twin_of=f"{NAME}.safety"),
    _ts.obligation(SYSTEM, f"{NAME}.bounded", f"post-#25805 bounded allocator: no unsafe step in any run of up to "
                   f"{BOUNDED_DEPTH} steps from clear() (BMC)", _ts.bounded(SYSTEM, UNSAFE, BOUNDED_DEPTH,
                                                                           search=POOL), family=FAMILY),
    _ts.obligation(SYSTEM, f"{NAME}.bounded.s3_pre_25805", f"pre-#25805 bounded allocator: within {S3_DEPTH} steps of "
                   "clear() free_swa releases an SWA page still used by a tail request (backup_state, an allocation, "
                   "restore_state, alloc_extend_swa_tail, free_swa; BMC)",
                   _ts.reachable(system(PRE_25805), S3_EVENT, S3_DEPTH, search=DRAFTS), family=FAMILY,
                   twin_of=f"{NAME}.bounded"),
    *_op_obligations(),
)
