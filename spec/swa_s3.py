"""Scenario S3: stale mapping -> SWA double free (sglang_semantics.md §9 S3, §2.11 R1 + R3, §7 M2).

A bounded transition system of the SWA composite allocator: page size 2, full
pages {1, 2, 3} and SWA pages {1, 2, 3} (page 0 reserved, §1.4), the mapping M over
full slots 0..7, free flags per page, and ghost state the real code does not keep:
the owner (request id) of every page, the index of a full page within its owner's
sequence, and per-slot liveness. Free-list *order* is abstracted (an allocation may
take any free pages), which only enlarges the search.

Transitions, named like the reference ops:

* ``alloc_extend``: a new request (prefix 0, 1..4 tokens) takes pages in both
  pools and maps 1:1 (§1.5);
* a draft step ``backup_state`` -> ``alloc_extend`` -> ``restore_state``: the free
  lists roll back, M does not (R3);
* ``alloc_extend_swa_tail``: a new request of L tokens whose last t (``(L - t) mod 2
  == 0``, U1) get SWA slots (§2.7); post-#25805 it clears M on the other new slots,
  pre-#25805 it leaves them stale (R1);
* ``free_swa``: decode-time window eviction of a request's leading whole pages
  (0.5.23 semantics: releases the SWA pages mapped from those slots, entries > 0
  only, and clears M on the pages);
* ``free``: a whole request (full pages, then ``free_swa`` of its live slots).

Safety (per step): no SWA page is released while it is already free (double free)
or still mapped from a live full slot, and none is handed out while mapped from a
live full slot (aliasing).

Obligations:

* ``swa_allocator.s3_double_free`` (broken twin): bounded model checking of the
  pre-#25805 model with iterative deepening up to depth 6, looking for the S3
  event, ``free_swa`` releasing an SWA page a live full slot still maps to. The
  shortest run is draft -> ``alloc_extend_swa_tail`` -> ``free_swa`` (3 steps);
  what follows in S3 (the next owner aliases the page, the tail request's own
  ``free`` releases it a second time) needs no further search.
* ``swa_allocator.s3_fixed_safe.{initiation,consecution,safety}``: the post-#25805
  model is safe for runs of any length, by the inductive invariant "M2 as
  maintained" (on live slots: mapped SWA page allocated to the same owner, same
  in-page offset, distinct values, one SWA page per full page), plus
  ``.bounded``, the same BMC question for the fixed model up to depth 3 (deeper
  unsatisfiable BMC costs minutes; the induction covers every depth).
* Broken twins: the pre-#25805 tail allocation breaks consecution; "M2 as
  intended" is broken one draft after ``clear()`` (R3); an invariant without the
  page-locality clause does not imply safety; a ``clear()`` that forgets M breaks
  initiation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum

import z3

from kvproof.spec._solver import Expect, Obligation, as_bool, as_int

__all__ = [
    "OBLIGATIONS",
    "P",
    "Op",
    "Variant",
    "FIXED",
    "PRE_25805",
    "State",
    "Action",
    "init",
    "alloc_extend",
    "alloc_extend_swa_tail",
    "backup_state",
    "restore_state",
    "draft",
    "free_swa",
    "free",
    "step",
    "safe_step",
    "eviction_frees_page_in_use",
    "invariant",
    "invariant_clauses",
    "intended_clauses",
    "Trace",
    "TraceRow",
    "Target",
    "S3_EVENT",
    "UNSAFE",
    "find_trace",
    "witness",
]

COMPONENT = "swa_allocator"
FAMILY = "swa_s3"

P = 2
PAGES = (1, 2, 3)  # real pages of both pools; page 0 is reserved
SLOTS = range(len(PAGES) * P + P)  # full slots 0..7; page g holds g*P .. g*P + P - 1
REAL_SLOTS = range(P, len(SLOTS))
MAX_SEQ = 4  # tokens per request: at most 2 pages
MAX_DEPTH = 6


class Op(IntEnum):
    """One step of the transition system; values are the ``op`` variable's encoding."""

    ALLOC_EXTEND = 0
    DRAFT = 1  # backup_state; alloc_extend; restore_state
    ALLOC_EXTEND_SWA_TAIL = 2
    FREE_SWA = 3
    FREE = 4


@dataclass(frozen=True)
class Variant:
    """Which model: the allocator fix and the deliberately broken parts of a twin."""

    clears_non_tail: bool = True  # post-#25805 alloc_extend_swa_tail
    clear_resets_mapping: bool = True  # clear() sets M[:-1] = 0
    page_locality: bool = True  # invariant keeps "same SWA page => same full page"


FIXED = Variant()
PRE_25805 = Variant(clears_non_tail=False)


# ---- state and action ---------------------------------------------------------------------


@dataclass(frozen=True)
class State:
    """One copy of the allocator as Z3 terms; ``tag`` separates the copies.

    Page-indexed tuples have an entry for the reserved page 0 (a constant: never
    free, no owner); slot-indexed tuples are constant on page 0's slots (M = 0,
    not live).
    """

    full_free: tuple[z3.BoolRef, ...]
    swa_free: tuple[z3.BoolRef, ...]
    full_owner: tuple[z3.ArithRef, ...]  # request id, 0 = none (ghost)
    swa_owner: tuple[z3.ArithRef, ...]  # ghost
    page_index: tuple[z3.ArithRef, ...]  # which page of its owner's sequence (ghost)
    M: tuple[z3.ArithRef, ...]  # full slot -> SWA slot, 0 = none
    live: tuple[z3.BoolRef, ...]  # full slot holds a token of its page's owner (ghost)

    @staticmethod
    def fresh(tag: str) -> State:
        def pages(name: str, make: Callable[[str], z3.ExprRef], page0: z3.ExprRef) -> tuple:
            return (page0, *(make(f"{name}_{g}@{tag}") for g in PAGES))

        def slots(name: str, make: Callable[[str], z3.ExprRef], page0: z3.ExprRef) -> tuple:
            return (*[page0] * P, *(make(f"{name}_{x}@{tag}") for x in REAL_SLOTS))

        return State(
            full_free=pages("full_free", z3.Bool, z3.BoolVal(False)),
            swa_free=pages("swa_free", z3.Bool, z3.BoolVal(False)),
            full_owner=pages("full_owner", z3.Int, z3.IntVal(0)),
            swa_owner=pages("swa_owner", z3.Int, z3.IntVal(0)),
            page_index=pages("page_index", z3.Int, z3.IntVal(0)),
            M=slots("M", z3.Int, z3.IntVal(0)),
            live=slots("live", z3.Bool, z3.BoolVal(False)),
        )


@dataclass(frozen=True)
class Action:
    """The operation of one step and its arguments (unused ones are unconstrained)."""

    op: z3.ArithRef
    req: z3.ArithRef  # request id of a new allocation, or the request freed
    seq: z3.ArithRef  # tokens of a new allocation
    tail: z3.ArithRef  # swa_tail_len of alloc_extend_swa_tail
    n: z3.ArithRef  # leading pages evicted by free_swa
    full_pages: tuple[z3.ArithRef, z3.ArithRef]  # pages an allocation takes, in position order
    swa_pages: tuple[z3.ArithRef, z3.ArithRef]

    @staticmethod
    def fresh(tag: str) -> Action:
        return Action(
            *(z3.Int(f"{name}@{tag}") for name in ("op", "req", "seq", "tail", "n")),
            full_pages=(z3.Int(f"full_page_0@{tag}"), z3.Int(f"full_page_1@{tag}")),
            swa_pages=(z3.Int(f"swa_page_0@{tag}"), z3.Int(f"swa_page_1@{tag}")),
        )


def pick(values: Sequence[z3.ArithRef], i: z3.ArithRef) -> z3.ArithRef:
    """``values[i]`` for a symbolic index (0 out of range), as an If-chain."""
    out: z3.ArithRef = z3.IntVal(0)
    for k in reversed(range(len(values))):
        out = z3.If(i == k, values[k], out)
    return out


def swa_page_of(m: z3.ArithRef, q: int) -> z3.BoolRef:
    """SWA slot ``m`` lies on SWA page ``q``."""
    return z3.And(q * P <= m, m < q * P + P)


def mapped_into(s: State, x: int, q: int) -> z3.BoolRef:
    """Live full slot ``x`` maps to SWA page ``q``."""
    return z3.And(s.live[x], s.M[x] > 0, swa_page_of(s.M[x], q))


def _unchanged(s: State, t: State, *names: str) -> list[z3.BoolRef]:
    """Frame conditions: the named fields of ``t`` equal those of ``s``."""
    return [a == b for name in names for a, b in zip(getattr(s, name), getattr(t, name)) if not a.eq(b)]


# ---- init ---------------------------------------------------------------------------------


def init(s: State, variant: Variant = FIXED) -> z3.BoolRef:
    """``clear()``: every page free and unowned, M zero (unless a twin forgets), nothing live."""
    mapping = [s.M[x] == 0 for x in REAL_SLOTS] if variant.clear_resets_mapping else []
    return z3.And(
        *[s.full_free[g] for g in PAGES], *[s.swa_free[q] for q in PAGES],
        *[s.full_owner[g] == 0 for g in PAGES], *[s.swa_owner[q] == 0 for q in PAGES],
        *[s.page_index[g] == 0 for g in PAGES], *[z3.Not(s.live[x]) for x in REAL_SLOTS], *mapping,
    )


# ---- allocation ---------------------------------------------------------------------------


def _page_count(tokens: z3.ArithRef) -> z3.ArithRef:
    """``ceil(tokens / P)`` for ``0 <= tokens <= MAX_SEQ``."""
    return z3.If(tokens > P, 2, z3.If(tokens > 0, 1, 0))


def _takes(active: Sequence[z3.BoolRef], pages: Sequence[z3.ArithRef], g: int) -> z3.BoolRef:
    return z3.Or([z3.And(on, page == g) for on, page in zip(active, pages)])


def _fresh_pages(
    active: Sequence[z3.BoolRef], pages: Sequence[z3.ArithRef], free: Sequence[z3.BoolRef]
) -> list[z3.BoolRef]:
    """The active page choices are distinct free real pages (any order: free-list order abstracted)."""
    facts = [z3.Implies(on, z3.Or([z3.And(page == g, free[g]) for g in PAGES])) for on, page in zip(active, pages)]
    return [*facts, z3.Implies(z3.And(*active), pages[0] != pages[1])]


def _allocate(s: State, a: Action, t: State, swa_start: z3.ArithRef, clears_non_tail: bool) -> z3.BoolRef:
    """A new request ``a.req`` of ``a.seq`` tokens; positions ``>= swa_start`` get SWA slots.

    Position ``j`` sits at full slot ``full_pages[j // P] * P + j % P``; SWA slot ``k``
    of the SWA run (``k = j - swa_start``) at ``swa_pages[k // P] * P + k % P``.
    """
    full_on = [i < _page_count(a.seq) for i in range(2)]
    swa_on = [i < _page_count(a.seq - swa_start) for i in range(2)]
    new_request = [a.req >= 1, *[s.full_owner[g] != a.req for g in PAGES], *[s.swa_owner[q] != a.req for q in PAGES]]
    full_slot = [a.full_pages[j // P] * P + j % P for j in range(MAX_SEQ)]
    swa_run = [a.swa_pages[k // P] * P + k % P for k in range(MAX_SEQ)]

    def new_slot(x: int, j: int) -> z3.BoolRef:
        return z3.And(j < a.seq, full_slot[j] == x)

    def mapping(x: int) -> z3.ArithRef:
        non_tail = z3.IntVal(0) if clears_non_tail else s.M[x]  # pre-#25805: stale M survives
        out = s.M[x]
        for j in range(MAX_SEQ):
            out = z3.If(new_slot(x, j), z3.If(j >= swa_start, pick(swa_run, j - swa_start), non_tail), out)
        return out

    def index(g: int) -> z3.ArithRef:
        first, second = (z3.And(full_on[i], a.full_pages[i] == g) for i in range(2))
        return z3.If(first, 0, z3.If(second, 1, s.page_index[g]))

    taken_full = {g: _takes(full_on, a.full_pages, g) for g in PAGES}
    taken_swa = {q: _takes(swa_on, a.swa_pages, q) for q in PAGES}
    return z3.And(
        1 <= a.seq, a.seq <= MAX_SEQ, *new_request,
        *_fresh_pages(full_on, a.full_pages, s.full_free), *_fresh_pages(swa_on, a.swa_pages, s.swa_free),
        *[t.full_free[g] == z3.And(s.full_free[g], z3.Not(taken_full[g])) for g in PAGES],
        *[t.full_owner[g] == z3.If(taken_full[g], a.req, s.full_owner[g]) for g in PAGES],
        *[t.page_index[g] == index(g) for g in PAGES],
        *[t.swa_free[q] == z3.And(s.swa_free[q], z3.Not(taken_swa[q])) for q in PAGES],
        *[t.swa_owner[q] == z3.If(taken_swa[q], a.req, s.swa_owner[q]) for q in PAGES],
        *[t.M[x] == mapping(x) for x in REAL_SLOTS],
        *[t.live[x] == z3.Or(s.live[x], *[new_slot(x, j) for j in range(MAX_SEQ)]) for x in REAL_SLOTS],
    )


def alloc_extend(s: State, a: Action, t: State) -> z3.BoolRef:
    """Composite ``alloc_extend`` of a new request (prefix 0): both pools, mapped 1:1."""
    return _allocate(s, a, t, swa_start=z3.IntVal(0), clears_non_tail=True)


def alloc_extend_swa_tail(s: State, a: Action, t: State, variant: Variant = FIXED) -> z3.BoolRef:
    """``alloc_extend_swa_tail(prefix 0, seq, tail)`` with U1; pre-#25805 leaves the non-tail M stale."""
    aligned = (a.seq - a.tail) % P == 0
    return z3.And(0 <= a.tail, a.tail <= a.seq, aligned,
                  _allocate(s, a, t, swa_start=a.seq - a.tail, clears_non_tail=variant.clears_non_tail))


def backup_state(s: State) -> State:
    """``backup_state()``: a snapshot of the free lists (the state itself; nothing changes)."""
    return s


def restore_state(backup: State, current: State, t: State) -> z3.BoolRef:
    """``restore_state``: free lists (and the ghost ownership) from ``backup``, M from ``current`` (R3)."""
    return z3.And(
        *_unchanged(backup, t, "full_free", "swa_free", "full_owner", "swa_owner", "page_index", "live"),
        *_unchanged(current, t, "M"),
    )


def draft(s: State, a: Action, mid: State, t: State) -> z3.BoolRef:
    """An EAGLE-style draft: ``backup_state``, ``alloc_extend`` into ``mid``, ``restore_state``."""
    return z3.And(alloc_extend(backup_state(s), a, mid), restore_state(backup_state(s), mid, t))


# ---- release ------------------------------------------------------------------------------


def _release(s: State, t: State, given: Sequence[z3.BoolRef]) -> list[z3.BoolRef]:
    """``swa.free(M[given][M[given] > 0])``: those SWA pages become free and unowned."""
    released = released_pages(s, given)
    return [
        *[t.swa_free[q] == z3.Or(s.swa_free[q], released[q]) for q in PAGES],
        *[t.swa_owner[q] == z3.If(released[q], 0, s.swa_owner[q]) for q in PAGES],
    ]


def released_pages(s: State, given: Sequence[z3.BoolRef]) -> dict[int, z3.BoolRef]:
    """SWA pages holding ``M[x] > 0`` for a given full slot ``x`` (``given`` is indexed by slot)."""
    return {q: z3.Or([z3.And(given[x], s.M[x] > 0, swa_page_of(s.M[x], q)) for x in REAL_SLOTS]) for q in PAGES}


def _evicted(s: State, a: Action) -> dict[int, z3.BoolRef]:
    """Pages ``free_swa`` evicts: the first ``n`` pages of request ``req``."""
    return {g: z3.And(s.full_owner[g] == a.req, s.page_index[g] < a.n) for g in PAGES}


def _owned(s: State, a: Action) -> dict[int, z3.BoolRef]:
    return {g: s.full_owner[g] == a.req for g in PAGES}


def _slots_of(pages: dict[int, z3.BoolRef], s: State, *, live_only: bool) -> list[z3.BoolRef]:
    """Slot-indexed flags: slot ``x`` lies on a flagged page (and is live, if asked)."""
    flags = [z3.BoolVal(False)] * len(SLOTS)
    for x in REAL_SLOTS:
        flags[x] = z3.And(pages[x // P], s.live[x]) if live_only else pages[x // P]
    return flags


def free_swa(s: State, a: Action, t: State) -> z3.BoolRef:
    """``free_swa`` of request ``req``'s leading ``n`` whole pages (decode-time window eviction)."""
    evicted = _evicted(s, a)
    whole = [z3.Implies(evicted[g], z3.And([s.live[g * P + o] for o in range(P)])) for g in PAGES]
    given = _slots_of(evicted, s, live_only=True)
    return z3.And(
        a.req >= 1, 1 <= a.n, a.n <= 2, z3.Or(list(evicted.values())), *whole,
        *_release(s, t, given),
        *[t.M[x] == z3.If(evicted[x // P], 0, s.M[x]) for x in REAL_SLOTS],
        *_unchanged(s, t, "full_free", "full_owner", "page_index", "live"),
    )


def free(s: State, a: Action, t: State) -> z3.BoolRef:
    """``free(idx)`` of request ``req``'s live slots: full pages, then ``free_swa(idx)``."""
    owned = _owned(s, a)
    given = _slots_of(owned, s, live_only=True)
    return z3.And(
        a.req >= 1, z3.Or(list(owned.values())),
        *[t.full_free[g] == z3.Or(s.full_free[g], owned[g]) for g in PAGES],
        *[t.full_owner[g] == z3.If(owned[g], 0, s.full_owner[g]) for g in PAGES],
        *[t.live[x] == z3.And(s.live[x], z3.Not(owned[x // P])) for x in REAL_SLOTS],
        *_release(s, t, given),
        *[t.M[x] == z3.If(owned[x // P], 0, s.M[x]) for x in REAL_SLOTS],
        *_unchanged(s, t, "page_index"),
    )


def step(s: State, a: Action, mid: State, t: State, variant: Variant = FIXED) -> z3.BoolRef:
    """One transition; ``mid`` is the draft's intermediate state (unused by other ops)."""
    return z3.Or(
        z3.And(a.op == Op.ALLOC_EXTEND, alloc_extend(s, a, t)),
        z3.And(a.op == Op.DRAFT, draft(s, a, mid, t)),
        z3.And(a.op == Op.ALLOC_EXTEND_SWA_TAIL, alloc_extend_swa_tail(s, a, t, variant)),
        z3.And(a.op == Op.FREE_SWA, free_swa(s, a, t)),
        z3.And(a.op == Op.FREE, free(s, a, t)),
    )


# ---- safety ---------------------------------------------------------------------------------


def step_released(s: State, a: Action) -> dict[int, z3.BoolRef]:
    """SWA pages the step gives back to the free list."""
    by_free_swa = released_pages(s, _slots_of(_evicted(s, a), s, live_only=True))
    by_free = released_pages(s, _slots_of(_owned(s, a), s, live_only=True))
    return {q: z3.Or(z3.And(a.op == Op.FREE_SWA, by_free_swa[q]), z3.And(a.op == Op.FREE, by_free[q])) for q in PAGES}


def step_handed_out(s: State, a: Action) -> dict[int, z3.BoolRef]:
    """SWA pages the step takes from the free list (a draft's too, before its restore)."""
    tail_start = z3.If(a.op == Op.ALLOC_EXTEND_SWA_TAIL, a.seq - a.tail, 0)
    swa_on = [i < _page_count(a.seq - tail_start) for i in range(2)]
    allocating = z3.Or(a.op == Op.ALLOC_EXTEND, a.op == Op.DRAFT, a.op == Op.ALLOC_EXTEND_SWA_TAIL)
    return {q: z3.And(allocating, _takes(swa_on, a.swa_pages, q)) for q in PAGES}


def _in_use(s: State, q: int) -> z3.BoolRef:
    return z3.Or([mapped_into(s, x, q) for x in REAL_SLOTS])


def double_free(s: State, a: Action) -> z3.BoolRef:
    """The step releases an SWA page that is already free."""
    return z3.Or([z3.And(released, s.swa_free[q]) for q, released in step_released(s, a).items()])


def release_in_use(s: State, a: Action, t: State) -> z3.BoolRef:
    """The step releases an SWA page that a live full slot still maps to afterwards."""
    return z3.Or([z3.And(released, _in_use(t, q)) for q, released in step_released(s, a).items()])


def handout_in_use(s: State, a: Action) -> z3.BoolRef:
    """The step hands out an SWA page that a live full slot maps to (aliasing)."""
    return z3.Or([z3.And(handed, _in_use(s, q)) for q, handed in step_handed_out(s, a).items()])


def safe_step(s: State, a: Action, t: State) -> z3.BoolRef:
    """No double free, no release of an SWA page in use, no handing out of one."""
    return z3.Not(z3.Or(double_free(s, a), release_in_use(s, a, t), handout_in_use(s, a)))


def eviction_frees_page_in_use(s: State, a: Action, t: State) -> z3.BoolRef:
    """The S3 event: window eviction (``free_swa``) releases an SWA page still in use."""
    return z3.And(a.op == Op.FREE_SWA, release_in_use(s, a, t))


# ---- the inductive invariant: M2 as maintained ------------------------------------------------


def invariant_clauses(s: State, variant: Variant = FIXED) -> list[tuple[str, z3.BoolRef]]:
    """M2 as maintained (live slots only), with the page bookkeeping it needs; each clause named."""
    clauses: list[tuple[str, z3.BoolRef]] = []
    for x in REAL_SLOTS:
        real = z3.Or(s.M[x] == 0, z3.And(s.M[x] >= P, s.M[x] < len(SLOTS)))
        clauses.append((f"M1: M[{x}] is 0 or a real SWA slot", real))
    for g in PAGES:
        idle = z3.And(s.full_owner[g] == 0, *[z3.Not(s.live[g * P + o]) for o in range(P)])
        clauses.append((f"full page {g}: free iff unowned, and then nothing live", z3.And(
            z3.Implies(s.full_free[g], idle), z3.Implies(z3.Not(s.full_free[g]), s.full_owner[g] >= 1))))
        swa_idle = z3.And(s.swa_free[g] == (s.swa_owner[g] == 0), s.swa_owner[g] >= 0)
        clauses.append((f"SWA page {g}: free iff unowned", swa_idle))
        clauses.append((f"full page {g}: page index 0 or 1", z3.And(s.page_index[g] >= 0, s.page_index[g] <= 1)))
    for x in REAL_SLOTS:
        for q in PAGES:
            paired = z3.And(z3.Not(s.swa_free[q]), s.swa_owner[q] == s.full_owner[x // P], s.M[x] % P == x % P)
            name = f"M2: live slot {x} mapped into SWA page {q} => page {q} allocated to its owner, same offset"
            clauses.append((name, z3.Implies(mapped_into(s, x, q), paired)))
    clauses += _pairwise_clauses(s, variant)
    return clauses


def _pairwise_clauses(s: State, variant: Variant) -> list[tuple[str, z3.BoolRef]]:
    """Distinct nonzero values on live slots, and (page locality) one SWA page per full page."""
    clauses = []
    for x in REAL_SLOTS:
        for y in (y for y in REAL_SLOTS if y > x):
            both = z3.And(s.live[x], s.live[y], s.M[x] > 0, s.M[y] > 0)
            distinct = z3.Implies(both, s.M[x] != s.M[y])
            clauses.append((f"M2: live slots {x} and {y} map to distinct SWA slots", distinct))
            if variant.page_locality and x // P != y // P:
                same_page = z3.Or([z3.And(swa_page_of(s.M[x], q), swa_page_of(s.M[y], q)) for q in PAGES])
                clauses.append((f"locality: live slots {x} and {y} on different full pages use different SWA pages",
                                z3.Implies(both, z3.Not(same_page))))
    return clauses


def intended_clauses(s: State) -> list[tuple[str, z3.BoolRef]]:
    """M2 as intended (§7): every ``M[f] > 0``, live or not, sits on allocated full and SWA pages."""
    clauses = []
    for x in REAL_SLOTS:
        target_allocated = z3.And([z3.Implies(swa_page_of(s.M[x], q), z3.Not(s.swa_free[q])) for q in PAGES])
        clauses.append((f"M2 as intended: M[{x}] > 0 => full page {x // P} and its SWA page allocated",
                        z3.Implies(s.M[x] > 0, z3.And(z3.Not(s.full_free[x // P]), target_allocated))))
    return clauses


def invariant(s: State, variant: Variant = FIXED) -> z3.BoolRef:
    return z3.And([clause for _, clause in invariant_clauses(s, variant)])


# ---- traces ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceRow:
    """One row of a rendered trace: the op of a step and the state after it."""

    step: int
    op: str  # "init", "alloc_extend", "draft", "alloc_extend_swa_tail", "free_swa", "free"
    args: str
    full_free: tuple[int, ...]
    swa_free: tuple[int, ...]
    mapping: tuple[tuple[int, int], ...]  # nonzero M entries (full slot, SWA slot)
    live: tuple[tuple[int, int], ...]  # live full slots (slot, owner)

    @property
    def call(self) -> str:
        if not self.args:
            return self.op
        return f"{self.op}{self.args}" if self.args.startswith("(") else f"{self.op}: {self.args}"


@dataclass(frozen=True)
class Trace:
    """A concrete run of the model; ``violation`` says what went wrong at its last step."""

    rows: tuple[TraceRow, ...]
    violation: str = ""

    HEADER = ("step", "op", "full free", "SWA free", "M (nonzero)", "live slot:owner")

    def ops(self) -> list[str]:
        return [row.op for row in self.rows]

    def table(self) -> str:
        cells = [self.HEADER] + [
            (str(r.step), r.call, _ints(r.full_free), _ints(r.swa_free), _pairs(r.mapping, "->"), _pairs(r.live, ":"))
            for r in self.rows
        ]
        widths = [max(len(row[i]) for row in cells) for i in range(len(self.HEADER))]
        lines = [" | ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
        lines.insert(1, "-+-".join("-" * w for w in widths))
        return "\n".join(lines + ([self.violation] if self.violation else []))


def _ints(xs: Sequence[int]) -> str:
    return " ".join(map(str, xs)) if xs else "-"


def _pairs(pairs: Sequence[tuple[int, int]], sep: str) -> str:
    return " ".join(f"{a}{sep}{b}" for a, b in pairs) if pairs else "-"


def _state_row(model: z3.ModelRef, s: State, step_no: int, op: str, args: str) -> TraceRow:
    return TraceRow(
        step=step_no, op=op, args=args,
        full_free=tuple(g for g in PAGES if as_bool(model, s.full_free[g])),
        swa_free=tuple(q for q in PAGES if as_bool(model, s.swa_free[q])),
        mapping=tuple((x, m) for x in REAL_SLOTS if (m := as_int(model, s.M[x]))),
        live=tuple((x, as_int(model, s.full_owner[x // P])) for x in REAL_SLOTS if as_bool(model, s.live[x])),
    )


def _describe(model: z3.ModelRef, s: State, a: Action) -> tuple[str, str]:
    """``(op, args)`` of a step, with the pages it took or released."""
    op = Op(as_int(model, a.op))
    req, seq, tail, n = (as_int(model, v) for v in (a.req, a.seq, a.tail, a.n))

    def took(tokens: int, pages: Sequence[z3.ArithRef]) -> list[int]:
        return [as_int(model, page) for page in pages[: -(-tokens // P)]]

    def slots(pages: dict[int, z3.BoolRef]) -> list[int]:
        return [x for x in REAL_SLOTS if as_bool(model, _slots_of(pages, s, live_only=True)[x])]

    released = [q for q, b in step_released(s, a).items() if as_bool(model, b)]
    if op is Op.ALLOC_EXTEND:
        pages = f"full pages {took(seq, a.full_pages)}, SWA pages {took(seq, a.swa_pages)}"
        return "alloc_extend", f"(req={req}, seq={seq}) -> {pages}"
    if op is Op.DRAFT:
        alloc = f"alloc_extend(seq={seq}) -> full pages {took(seq, a.full_pages)}, SWA pages {took(seq, a.swa_pages)}"
        return "draft", f"backup_state; {alloc}; restore_state"
    if op is Op.ALLOC_EXTEND_SWA_TAIL:
        pages = f"full pages {took(seq, a.full_pages)}, SWA pages {took(tail, a.swa_pages)}"
        return "alloc_extend_swa_tail", f"(req={req}, seq={seq}, tail={tail}) -> {pages}"
    if op is Op.FREE_SWA:
        evicted = f"req {req}'s first {n} page(s): slots {slots(_evicted(s, a))}"
        return "free_swa", f"({evicted}) -> releases SWA pages {released}"
    return "free", f"(req {req}: slots {slots(_owned(s, a))}) -> releases SWA pages {released}"


def _explain_unsafe(model: z3.ModelRef, s: State, a: Action, t: State, step_no: int) -> str:
    """Why step ``step_no`` is unsafe, in words."""
    for q, released in step_released(s, a).items():
        if not as_bool(model, released):
            continue
        if as_bool(model, s.swa_free[q]):
            return f"step {step_no}: SWA page {q} is released although it is already free (double free)"
        users = [x for x in REAL_SLOTS if as_bool(model, mapped_into(t, x, q))]
        if users:
            owner = as_int(model, t.full_owner[users[0] // P])
            return (f"step {step_no}: SWA page {q} is released while live full slots {users} of request {owner} "
                    f"still map to it; its next owner aliases it and request {owner}'s own free releases it "
                    "again (double free)")
    for q, handed in step_handed_out(s, a).items():
        users = [x for x in REAL_SLOTS if as_bool(model, mapped_into(s, x, q))]
        if as_bool(model, handed) and users:
            return f"step {step_no}: SWA page {q} is handed out while live full slots {users} still map to it"
    return f"step {step_no}: unsafe"


# ---- bounded model checking -------------------------------------------------------------------


@dataclass(frozen=True)
class Unrolling:
    """``depth`` steps from ``init``: states ``s_0..s_depth``, actions, draft intermediates.

    Allocations in step ``i`` use request id ``i + 1`` (ids are arbitrary; fixing
    them removes symmetric runs and keeps traces readable).
    """

    states: tuple[State, ...]
    actions: tuple[Action, ...]
    mids: tuple[State, ...]

    @staticmethod
    def fresh(depth: int) -> Unrolling:
        return Unrolling(
            tuple(State.fresh(str(i)) for i in range(depth + 1)),
            tuple(Action.fresh(str(i)) for i in range(depth)),
            tuple(State.fresh(f"{i}draft") for i in range(depth)),
        )

    def path(self, variant: Variant) -> list[z3.BoolRef]:
        s, a, mid = self.states, self.actions, self.mids
        allocating = [z3.Or(x.op == Op.ALLOC_EXTEND, x.op == Op.DRAFT, x.op == Op.ALLOC_EXTEND_SWA_TAIL) for x in a]
        ids = [z3.Implies(alloc, x.req == i + 1) for i, (alloc, x) in enumerate(zip(allocating, a))]
        return [init(s[0], variant), *ids, *[step(s[i], a[i], mid[i], s[i + 1], variant) for i in range(len(a))]]

    def at(self, i: int) -> tuple[State, Action, State]:
        """Pre-state, action and post-state of step ``i`` (0-based)."""
        return self.states[i], self.actions[i], self.states[i + 1]


@dataclass(frozen=True)
class Target:
    """What a BMC query looks for: ``bad(u, i)`` holds when step ``i`` of ``u`` goes wrong."""

    bad: Callable[[Unrolling, int], z3.BoolRef]
    explain: Callable[[z3.ModelRef, Unrolling, int], str]


S3_EVENT = Target(
    bad=lambda u, i: eviction_frees_page_in_use(*u.at(i)),
    explain=lambda m, u, i: _explain_unsafe(m, *u.at(i), i + 1),
)
UNSAFE = Target(
    bad=lambda u, i: z3.Not(safe_step(*u.at(i))),
    explain=lambda m, u, i: _explain_unsafe(m, *u.at(i), i + 1),
)


def _explain_intended(model: z3.ModelRef, u: Unrolling, i: int) -> str:
    broken = [name for name, clause in intended_clauses(u.states[i + 1]) if not as_bool(model, clause)]
    return f"after step {i + 1}: broken {broken[0]}"


M2_INTENDED_BROKEN = Target(
    bad=lambda u, i: z3.Not(z3.And([c for _, c in intended_clauses(u.states[i + 1])])),
    explain=_explain_intended,
)


def trace_of(model: z3.ModelRef, target: Target) -> Trace:
    """The concrete run in a BMC model, up to the first step where ``target`` goes wrong."""
    u = Unrolling.fresh(sum(1 for d in model.decls() if d.name().startswith("op@")))
    rows = [_state_row(model, u.states[0], 0, "init", "")]
    for i in range(len(u.actions)):
        s, a, t = u.at(i)
        rows.append(_state_row(model, t, i + 1, *_describe(model, s, a)))
        if as_bool(model, target.bad(u, i)):
            return Trace(tuple(rows), target.explain(model, u, i))
    return Trace(tuple(rows))


def bmc_last_step(variant: Variant, target: Target, depth: int) -> list[z3.BoolRef]:
    """A run of exactly ``depth`` steps whose last step goes wrong."""
    u = Unrolling.fresh(depth)
    return [*u.path(variant), target.bad(u, depth - 1)]


def bmc_any_step(variant: Variant, target: Target, depth: int) -> list[z3.BoolRef]:
    """A run of ``depth`` steps with some step going wrong.

    Covers shorter runs too: every state has an enabled step (``free`` when a page
    is owned, else ``alloc_extend``).
    """
    u = Unrolling.fresh(depth)
    return [*u.path(variant), z3.Or([target.bad(u, i) for i in range(depth)])]


def shortest_bmc(
    variant: Variant, target: Target, max_depth: int = MAX_DEPTH, timeout_ms: int = 20_000
) -> list[z3.BoolRef]:
    """Iterative deepening: the facts of the shortest depth at which ``target`` is reachable.

    When no depth up to ``max_depth`` is satisfiable the depth-``max_depth`` facts
    come back, and ``run`` reports them proved (contradicting a twin's expectation).
    """
    for depth in range(1, max_depth + 1):
        facts = bmc_last_step(variant, target, depth)
        solver = z3.Solver()
        solver.set(timeout=timeout_ms)
        solver.add(*facts)
        if solver.check() != z3.unsat:  # sat, or unknown: run() re-checks and reports it
            return facts
    return facts


def find_trace(variant: Variant = PRE_25805, target: Target = S3_EVENT, max_depth: int = MAX_DEPTH) -> Trace | None:
    """The shortest run of ``variant`` reaching ``target`` within ``max_depth`` steps, or None."""
    solver = z3.Solver()
    solver.add(*shortest_bmc(variant, target, max_depth))
    if solver.check() != z3.sat:
        return None
    return trace_of(solver.model(), target)


def witness(variant: Variant, ops: Sequence[Op]) -> Trace | None:
    """A run of ``variant`` performing exactly ``ops`` from ``clear()`` (non-vacuity), or None."""
    u = Unrolling.fresh(len(ops))
    solver = z3.Solver()
    solver.add(*u.path(variant), *[a.op == op for a, op in zip(u.actions, ops)])
    if solver.check() != z3.sat:
        return None
    never = Target(bad=lambda u, i: z3.BoolVal(False), explain=lambda m, u, i: "")
    return trace_of(solver.model(), never)


# ---- the inductive proof: initiation, consecution, safety --------------------------------------


def _first_broken(model: z3.ModelRef, s: State, variant: Variant) -> str:
    broken = [name for name, clause in invariant_clauses(s, variant) if not as_bool(model, clause)]
    return broken[0] if broken else "(no clause broken)"


def _build_initiation(variant: Variant) -> Callable[[], list[z3.BoolRef]]:
    return lambda: [init(State.fresh("0"), variant), z3.Not(invariant(State.fresh("0"), variant))]


def _render_initiation(variant: Variant) -> Callable[[z3.ModelRef], str]:
    def render(model: z3.ModelRef) -> str:
        s = State.fresh("0")
        return Trace((_state_row(model, s, 0, "init", ""),), f"broken: {_first_broken(model, s, variant)}").table()

    return render


def _one_step() -> tuple[State, Action, State, State]:
    return State.fresh("pre"), Action.fresh("step"), State.fresh("mid"), State.fresh("post")


def _build_consecution(variant: Variant) -> Callable[[], list[z3.BoolRef]]:
    def build() -> list[z3.BoolRef]:
        s, a, mid, t = _one_step()
        return [invariant(s, variant), step(s, a, mid, t, variant), z3.Not(invariant(t, variant))]

    return build


def _build_safety(variant: Variant) -> Callable[[], list[z3.BoolRef]]:
    def build() -> list[z3.BoolRef]:
        s, a, mid, t = _one_step()
        return [invariant(s, variant), step(s, a, mid, t, variant), z3.Not(safe_step(s, a, t))]

    return build


def _render_step(variant: Variant, *, safety: bool) -> Callable[[z3.ModelRef], str]:
    def render(model: z3.ModelRef) -> str:
        s, a, _, t = _one_step()
        rows = (_state_row(model, s, 0, "(any invariant state)", ""), _state_row(model, t, 1, *_describe(model, s, a)))
        if safety:
            verdict = _explain_unsafe(model, s, a, t, 1)
        else:
            verdict = f"broken after step 1: {_first_broken(model, t, variant)}"
        return Trace(rows, verdict).table()

    return render


# ---- obligations ----------------------------------------------------------------------------

NAME = "swa_allocator.s3_fixed_safe"
BOUNDED_DEPTH = 3  # the length of the S3 trace; deeper unsat BMC costs minutes (the induction covers all depths)
CLEAR_FORGETS_M = Variant(clear_resets_mapping=False)
NO_LOCALITY = Variant(page_locality=False)


def _obligation(name: str, statement: str, expect: Expect, build: Callable[[], list[z3.BoolRef]],
                render: Callable[[z3.ModelRef], str], twin_of: str | None = None) -> Obligation:
    return Obligation(name, COMPONENT, FAMILY, statement, expect, build, render, twin_of)


OBLIGATIONS: tuple[Obligation, ...] = (
    _obligation(
        f"{NAME}.initiation", "post-#25805 S3 model: clear() establishes the invariant (M2 as maintained)",
        "proved", _build_initiation(FIXED), _render_initiation(FIXED),
    ),
    _obligation(
        f"{NAME}.initiation.clear_keeps_mapping", "a clear() that forgets M[:-1] = 0 starts outside M1",
        "counterexample", _build_initiation(CLEAR_FORGETS_M), _render_initiation(CLEAR_FORGETS_M),
        twin_of=f"{NAME}.initiation",
    ),
    _obligation(
        f"{NAME}.consecution",
        "post-#25805 S3 model: every op (alloc_extend, draft = backup_state/alloc_extend/restore_state, "
        "alloc_extend_swa_tail, free_swa, free) preserves the invariant (M2 as maintained on live slots)",
        "proved", _build_consecution(FIXED), _render_step(FIXED, safety=False),
    ),
    _obligation(
        f"{NAME}.consecution.pre_25805",
        "pre-#25805 alloc_extend_swa_tail leaves stale M on live prefix slots (R1)",
        "counterexample", _build_consecution(PRE_25805), _render_step(PRE_25805, safety=False),
        twin_of=f"{NAME}.consecution",
    ),
    _obligation(
        f"{NAME}.consecution.m2_as_intended",
        "M2 as intended (every M[f] > 0 on allocated pages) is no invariant of the fixed model: one draft "
        "after clear() breaks it, because restore_state keeps the draft's M (R3; BMC)",
        "counterexample", lambda: shortest_bmc(FIXED, M2_INTENDED_BROKEN),
        lambda model: trace_of(model, M2_INTENDED_BROKEN).table(), twin_of=f"{NAME}.consecution",
    ),
    _obligation(
        f"{NAME}.safety",
        "post-#25805 S3 model: from any invariant state no op double-frees, releases or hands out an SWA "
        "page still mapped from a live full slot",
        "proved", _build_safety(FIXED), _render_step(FIXED, safety=True),
    ),
    _obligation(
        f"{NAME}.safety.no_page_locality",
        "without 'one SWA page per full page' the invariant admits states where free_swa releases a page "
        "still in use",
        "counterexample", _build_safety(NO_LOCALITY), _render_step(NO_LOCALITY, safety=True),
        twin_of=f"{NAME}.safety",
    ),
    _obligation(
        f"{NAME}.bounded",
        f"post-#25805 S3 model: no unsafe step in any run of up to {BOUNDED_DEPTH} steps from clear() (BMC)",
        "proved", lambda: bmc_any_step(FIXED, UNSAFE, BOUNDED_DEPTH), lambda model: trace_of(model, UNSAFE).table(),
    ),
    _obligation(
        "swa_allocator.s3_double_free",
        f"pre-#25805 S3 model: within {MAX_DEPTH} steps free_swa releases an SWA page still used by a tail "
        "request (draft -> alloc_extend_swa_tail -> free_swa; BMC, iterative deepening)",
        "counterexample", lambda: shortest_bmc(PRE_25805, S3_EVENT), lambda model: trace_of(model, S3_EVENT).table(),
        twin_of=f"{NAME}.bounded",
    ),
)
