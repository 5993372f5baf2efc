"""The full-to-SWA mapping M under the composite allocator's ops (sglang_semantics.md §1.5, §2.7, §7 M3-M5).

Bounded transition properties over small concrete pools, each checked for two
geometries at once (page size 2 with 3 pages per pool, page size 4 with 2 pages
per pool); mapping contents, free flags, index lists, prefix/sequence/tail
lengths and page choices are symbolic.

* M3 ``free_swa(idx)`` (0.5.23: expands ``idx`` to the whole full pages it touches):
  M is zero on every slot of those pages afterwards and unchanged elsewhere, the
  -1 sentinel stays, and exactly the SWA pages of ``{M[f] : f in idx, M[f] > 0}``
  are released (never page 0).
* M4 ``alloc_extend_swa_tail`` (post-#25805, and kvproof also clears when the tail
  is empty, R2): new position ``j`` is mapped iff it is in the tail; the tail's SWA
  slots are fresh, distinct and share the in-page offset of their position (U1).
* M5 composite ``alloc_extend``: given ``M[last_loc] > 0`` when a partial page is
  continued, each new full slot is paired with a distinct real SWA slot of the same
  in-page offset.

Broken twins: ``free_swa`` without clearing M, clearing only the given slots
(0.5.12), without the ``> 0`` filter (releases page 0); the pre-#25805 tail
allocation (stale M on the prefix), SGLang's early return for an empty tail (R2),
a tail mapped one slot late, a tail without U1; ``alloc_extend`` continuing from an
unmapped ``last_loc``, and an SWA side allocated as a fresh sequence.

Obligations are named after the op: ``swa_allocator.free_swa.*``,
``swa_allocator.alloc_extend_swa_tail.*``, ``swa_allocator.alloc_extend.*``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

import z3

from kvproof.spec import _ts
from kvproof.spec._solver import Expect, Obligation, as_bool, as_int
from kvproof.spec.terms import ceil_p_term, extend_parts_terms

__all__ = ["GEOMETRIES", "OBLIGATIONS", "Geometry", "Mapping", "alloc_extend", "alloc_extend_swa_tail", "free_swa"]

COMPONENT = "swa_allocator"
FAMILY = "swa_mapping"


@dataclass(frozen=True)
class Geometry:
    """Both pools have ``num_pages`` real pages of ``P`` slots; page 0 is reserved (§1.4)."""

    P: int
    num_pages: int

    @property
    def num_slots(self) -> int:
        """Slots ``0 .. (num_pages + 1) * P - 1`` (page 0 included), in each pool."""
        return (self.num_pages + 1) * self.P

    @property
    def max_tokens(self) -> int:
        return self.num_pages * self.P

    @property
    def tag(self) -> str:
        return f"P{self.P}"

    def real_slot(self, x: z3.ArithRef) -> z3.BoolRef:
        """A slot of a real page (not page 0)."""
        return z3.And(x >= self.P, x < self.num_slots)

    def real_page(self, g: z3.ArithRef) -> z3.BoolRef:
        return z3.And(g >= 1, g <= self.num_pages)


GEOMETRIES = (Geometry(P=2, num_pages=3), Geometry(P=4, num_pages=2))


def pick(values: Sequence[z3.ExprRef], i: z3.ArithRef, default: int | bool = 0) -> z3.ExprRef:
    """``values[i]`` for a symbolic index (``default`` out of range), as an If-chain."""
    out: z3.ExprRef = _ts.literal(default)
    for k in reversed(range(len(values))):
        out = z3.If(i == k, values[k], out)
    return out


def distinct_when(active: Sequence[z3.BoolRef], xs: Sequence[z3.ArithRef]) -> z3.BoolRef:
    """The active entries of ``xs`` are pairwise distinct."""
    pairs = [
        z3.Implies(z3.And(active[a], active[b]), xs[a] != xs[b])
        for a in range(len(xs)) for b in range(a + 1, len(xs))
    ]
    return z3.And(pairs)


@dataclass(frozen=True)
class Mapping:
    """The mapping M (one entry per full slot plus the -1 sentinel) and the SWA free flags."""

    geo: Geometry
    M: tuple[z3.ArithRef, ...]
    sentinel: z3.ArithRef
    swa_free: tuple[z3.BoolRef, ...]  # index 0 is the reserved page

    @staticmethod
    def fresh(geo: Geometry, tag: str) -> Mapping:
        t = f"{geo.tag}_{tag}"
        return Mapping(
            geo,
            tuple(z3.Int(f"M_{x}_{t}") for x in range(geo.num_slots)),
            z3.Int(f"M_last_{t}"),
            tuple(z3.Bool(f"swa_free_{q}_{t}") for q in range(geo.num_pages + 1)),
        )

    def read(self, x: z3.ArithRef) -> z3.ArithRef:
        """``M[x]``; ``x == -1`` reads the sentinel, as Python indexing does."""
        return z3.If(x == -1, self.sentinel, pick(self.M, x))

    def well_formed(self) -> z3.BoolRef:
        """M1 (§7) and G1: sentinel -1, page 0 unmapped and never free, values 0 or real SWA slots."""
        geo = self.geo
        return z3.And(
            self.sentinel == -1,
            z3.Not(self.swa_free[0]),
            *[self.M[x] == 0 for x in range(geo.P)],
            *[z3.Or(m == 0, geo.real_slot(m)) for m in self.M],
        )


# ---- M3: free_swa -------------------------------------------------------------------------


@dataclass(frozen=True)
class SlotList:
    """A symbolic index tensor: ``length`` real full slots ``idx[0..length-1]``."""

    idx: tuple[z3.ArithRef, ...]
    length: z3.ArithRef

    MAX = 3

    @staticmethod
    def fresh(geo: Geometry, tag: str) -> SlotList:
        t = f"{geo.tag}_{tag}"
        return SlotList(tuple(z3.Int(f"idx_{i}_{t}") for i in range(SlotList.MAX)), z3.Int(f"k_{t}"))

    def given(self, i: int) -> z3.BoolRef:
        return i < self.length

    def hypotheses(self, geo: Geometry) -> list[z3.BoolRef]:
        real = [z3.Implies(self.given(i), geo.real_slot(x)) for i, x in enumerate(self.idx)]
        return [self.length >= 1, self.length <= self.MAX, *real]


class FreeSwaVariant(Enum):
    """The sound ``free_swa`` and its broken twins."""

    SOUND = "0.5.23"
    NO_CLEAR = "does not clear M"
    GIVEN_SLOTS_ONLY = "clears only the given slots (0.5.12)"
    NO_POSITIVE_FILTER = "no > 0 filter"


def free_swa(
    pre: Mapping, idx: SlotList, post: Mapping, variant: FreeSwaVariant = FreeSwaVariant.SOUND
) -> z3.BoolRef:
    """``free_swa(idx)``: release the pages of ``M[idx][M[idx] > 0]``; zero M on the pages ``idx`` touches."""
    geo, P = pre.geo, pre.geo.P
    values = [pre.read(f) for f in idx.idx]
    positive = variant is not FreeSwaVariant.NO_POSITIVE_FILTER
    live = [z3.And(idx.given(i), v > 0 if positive else True) for i, v in enumerate(values)]
    released = [z3.Or([z3.And(live[i], v / P == q) for i, v in enumerate(values)]) for q in range(geo.num_pages + 1)]

    def cleared(x: int) -> z3.BoolRef:
        if variant is FreeSwaVariant.NO_CLEAR:
            return z3.BoolVal(False)
        if variant is FreeSwaVariant.GIVEN_SLOTS_ONLY:
            return z3.Or([z3.And(idx.given(i), f == x) for i, f in enumerate(idx.idx)])
        return z3.Or([z3.And(idx.given(i), f / P == x // P) for i, f in enumerate(idx.idx)])

    return z3.And(
        *[post.M[x] == z3.If(cleared(x), 0, pre.M[x]) for x in range(geo.num_slots)],
        post.sentinel == pre.sentinel,
        *[post.swa_free[q] == z3.Or(pre.swa_free[q], released[q]) for q in range(geo.num_pages + 1)],
    )


def _page_start(x: z3.ArithRef, P: int) -> z3.ArithRef:
    """First slot of the page holding ``x``, written without division: ``x - x mod P``."""
    return x - x % P


def clears_mapping(pre: Mapping, idx: SlotList, post: Mapping) -> z3.BoolRef:
    """M3: zero on every slot of every page ``idx`` touches, unchanged elsewhere, sentinel kept."""
    P = pre.geo.P

    def touched(x: int) -> z3.BoolRef:
        on_page = [z3.And(_page_start(f, P) <= x, x < _page_start(f, P) + P) for f in idx.idx]
        return z3.Or([z3.And(idx.given(i), here) for i, here in enumerate(on_page)])

    return z3.And(
        post.sentinel == -1,
        *[z3.If(touched(x), post.M[x] == 0, post.M[x] == pre.M[x]) for x in range(pre.geo.num_slots)],
    )


def frees_exactly_mapped(pre: Mapping, idx: SlotList, post: Mapping) -> z3.BoolRef:
    """M3: the SWA pages released are exactly those holding ``M[f] > 0`` for given ``f``; never page 0."""
    P = pre.geo.P

    def mapped_into(q: int) -> z3.BoolRef:
        return z3.Or([
            z3.And(idx.given(i), pre.read(f) > 0, q * P <= pre.read(f), pre.read(f) < q * P + P)
            for i, f in enumerate(idx.idx)
        ])

    exact = [post.swa_free[q] == z3.Or(pre.swa_free[q], mapped_into(q)) for q in range(1, pre.geo.num_pages + 1)]
    return z3.And(z3.Not(post.swa_free[0]), *exact)


def _explain_free_swa(geo: Geometry, slots: list[int], before: list[int], after: list[int],
                      free_before: list[bool], free_after: list[bool]) -> str:
    """First M3 violation of a concrete ``free_swa`` step."""
    touched = {f // geo.P for f in slots}
    for x in range(geo.num_slots):
        if x // geo.P in touched and after[x]:
            return f"slot {x} on a touched page keeps M={after[x]}"
        if x // geo.P not in touched and after[x] != before[x]:
            return f"slot {x} outside the touched pages changed M {before[x]}->{after[x]}"
    mapped = {before[f] // geo.P for f in slots if before[f] > 0}
    for q in range(geo.num_pages + 1):
        released = free_after[q] and not free_before[q]
        if q == 0 and free_after[0]:
            return "the reserved SWA page 0 is released"
        if released and q not in mapped:
            return f"SWA page {q} is released but no given slot maps into it"
        if q in mapped and not free_after[q]:
            return f"SWA page {q} is mapped from a given slot but not released"
    return "the sentinel changed"


def _true_at(flags: list[bool]) -> list[int]:
    return [i for i, flag in enumerate(flags) if flag]


def _render_free_swa(geo: Geometry, model: z3.ModelRef, pre: Mapping, idx: SlotList, post: Mapping) -> str:
    slots = [as_int(model, f) for f in idx.idx[: as_int(model, idx.length)]]
    before = [as_int(model, m) for m in pre.M]
    after = [as_int(model, m) for m in post.M]
    free_before = [as_bool(model, b) for b in pre.swa_free]
    free_after = [as_bool(model, b) for b in post.swa_free]
    touched = sorted({f // geo.P for f in slots})
    shown = [x for x in range(geo.num_slots) if x // geo.P in touched]
    table = ", ".join(f"M[{x}] {before[x]}->{after[x]}" for x in shown)
    pages = f"SWA free pages {_true_at(free_before)}->{_true_at(free_after)}"
    explained = _explain_free_swa(geo, slots, before, after, free_before, free_after)
    return f"P={geo.P} free_swa({slots}): {explained} [{table}; {pages}]"


def _free_swa_obligation(
    name: str, statement: str, prop: Callable[[Mapping, SlotList, Mapping], z3.BoolRef], *,
    variant: FreeSwaVariant = FreeSwaVariant.SOUND, expect: Expect = "proved", twin_of: str | None = None,
) -> Obligation:
    """For each geometry: well-formed pre-state, free_swa step, not prop."""

    def violated(geo: Geometry) -> z3.BoolRef:
        pre, post, idx = Mapping.fresh(geo, "pre"), Mapping.fresh(geo, "post"), SlotList.fresh(geo, "F")
        step = free_swa(pre, idx, post, variant)
        return z3.And(pre.well_formed(), *idx.hypotheses(geo), step, z3.Not(prop(pre, idx, post)))

    def render(model: z3.ModelRef) -> str:
        geo = next(g for g in GEOMETRIES if as_bool(model, violated(g)))
        pre, post, idx = Mapping.fresh(geo, "pre"), Mapping.fresh(geo, "post"), SlotList.fresh(geo, "F")
        return _render_free_swa(geo, model, pre, idx, post)

    return Obligation(
        f"{COMPONENT}.free_swa.{name}", COMPONENT, FAMILY, statement, expect,
        lambda: [z3.Or([violated(g) for g in GEOMETRIES])], render, twin_of,
    )


# ---- M4: alloc_extend_swa_tail ----------------------------------------------------------


@dataclass(frozen=True)
class TailRequest:
    """One tail preallocation: positions ``[p, s)`` get full slots ``F[j]``; the last ``t`` get SWA.

    ``F`` is any list of distinct real full slots with ``F[j] mod P == j mod P`` (the
    paged ``alloc_extend`` geometry); ``swa_pages`` are the fresh pages of the tail.
    """

    p: z3.ArithRef
    s: z3.ArithRef
    t: z3.ArithRef
    F: tuple[z3.ArithRef, ...]
    swa_pages: tuple[z3.ArithRef, ...]

    @staticmethod
    def fresh(geo: Geometry) -> TailRequest:
        g = geo.tag
        return TailRequest(
            z3.Int(f"p_{g}"), z3.Int(f"s_{g}"), z3.Int(f"t_{g}"),
            tuple(z3.Int(f"F_{j}_{g}") for j in range(geo.max_tokens)),
            tuple(z3.Int(f"swa_page_{i}_{g}") for i in range(geo.num_pages)),
        )

    def new(self, j: int) -> z3.BoolRef:
        """Position ``j`` is allocated by this call."""
        return z3.And(self.p <= j, j < self.s)

    def in_tail(self, j: int) -> z3.BoolRef:
        return z3.And(self.s - self.t <= j, j < self.s)

    def swa_slot(self, geo: Geometry, k: z3.ArithRef) -> z3.ArithRef:
        """Slot ``k`` of the tail's fresh SWA sequence (prefix 0, ``last_loc = -1``)."""
        return pick([self.swa_pages[i // geo.P] * geo.P + i % geo.P for i in range(geo.max_tokens)], k)

    def hypotheses(self, geo: Geometry, pre: Mapping, *, aligned: bool = True) -> list[z3.BoolRef]:
        P, n_swa = geo.P, (self.t + geo.P - 1) / geo.P
        full = [z3.Implies(self.new(j), z3.And(geo.real_slot(f), f % P == j % P)) for j, f in enumerate(self.F)]
        swa = [z3.Implies(i < n_swa, z3.And(geo.real_page(q), pick(pre.swa_free, q, False)))
               for i, q in enumerate(self.swa_pages)]
        return [
            self.p >= 0, self.p <= self.s, self.s <= geo.max_tokens, self.t >= 0, self.t <= self.s - self.p,
            *([(self.s - self.t) % P == 0] if aligned else []),  # U1
            distinct_when([self.new(j) for j in range(len(self.F))], self.F), *full,
            distinct_when([i < n_swa for i in range(len(self.swa_pages))], self.swa_pages), *swa,
        ]


class TailVariant(Enum):
    SOUND = "post-#25805, clears also when the tail is empty"
    PRE_25805 = "no clear of the non-tail slots"
    ZERO_TAIL_EARLY_RETURN = "SGLang returns before clearing when the tail is empty (R2)"
    ONE_SLOT_LATE = "tail mapping starts one slot late"


def alloc_extend_swa_tail(
    pre: Mapping, req: TailRequest, post: Mapping, variant: TailVariant = TailVariant.SOUND
) -> z3.BoolRef:
    """``M[F[-t:]] = S``, then ``M[F[:-t]] = 0``; the tail's SWA pages leave the free list."""
    geo = pre.geo
    shift = 1 if variant is TailVariant.ONE_SLOT_LATE else 0
    clears = {
        TailVariant.SOUND: z3.BoolVal(True),
        TailVariant.PRE_25805: z3.BoolVal(False),
        TailVariant.ZERO_TAIL_EARLY_RETURN: req.t > 0,
        TailVariant.ONE_SLOT_LATE: z3.BoolVal(True),
    }[variant]

    def written(x: int) -> z3.ArithRef:
        out: z3.ArithRef = pre.M[x]
        for j, f in enumerate(req.F):
            k = j - (req.s - req.t) - shift
            value = z3.If(k >= 0, req.swa_slot(geo, k), z3.If(clears, 0, pre.M[x]))
            out = z3.If(z3.And(req.new(j), f == x), value, out)
        return out

    n_swa = (req.t + geo.P - 1) / geo.P
    taken = [z3.Or([z3.And(i < n_swa, q == page) for i, q in enumerate(req.swa_pages)])
             for page in range(geo.num_pages + 1)]
    return z3.And(
        *[post.M[x] == written(x) for x in range(geo.num_slots)],
        post.sentinel == pre.sentinel,
        *[post.swa_free[page] == z3.And(pre.swa_free[page], z3.Not(taken[page])) for page in range(geo.num_pages + 1)],
    )


def maps_exactly_tail(pre: Mapping, req: TailRequest, post: Mapping) -> z3.BoolRef:
    """M4: ``M'[F_j] > 0`` iff ``j`` is in the tail; tail slots fresh, distinct, same in-page offset.

    Stated per concrete full slot ``x`` (``F_j == x``) so that no symbolic read of
    ``M'`` is needed.
    """
    geo, P = pre.geo, pre.geo.P
    claims = []
    for x in range(geo.num_slots):
        m = post.M[x]
        fresh_slot = z3.And(geo.real_slot(m), m % P == x % P, pick(pre.swa_free, m / P, False))
        for j, f in enumerate(req.F):
            at = z3.And(req.new(j), f == x)
            claims.append(z3.Implies(at, z3.And((m > 0) == req.in_tail(j), z3.Implies(req.in_tail(j), fresh_slot))))
    tail_slot = [
        z3.Or([z3.And(req.in_tail(j), req.new(j), f == x) for j, f in enumerate(req.F)]) for x in range(geo.num_slots)
    ]
    distinct = distinct_when(tail_slot, post.M)
    return z3.And(*claims, distinct, post.sentinel == -1)


def _explain_tail(geo: Geometry, s: int, t: int, rows: list[tuple[int, int, int, int]], free: list[bool]) -> str:
    """First M4 violation among ``(position, slot, M before, M after)`` rows."""
    seen: dict[int, int] = {}
    for j, slot, _, after in rows:
        tail = j >= s - t
        if not tail and after:
            return f"position {j} is outside the tail but slot {slot} keeps M={after}"
        if tail and not after:
            return f"tail position {j} (slot {slot}) is unmapped"
        if tail and after % geo.P != j % geo.P:
            return f"tail position {j} maps to SWA slot {after}, in-page offset {after % geo.P} != {j % geo.P}"
        if tail and after in seen:
            return f"tail positions {seen[after]} and {j} share SWA slot {after}"
        if tail and not free[after // geo.P]:
            return f"tail position {j} maps to SWA slot {after} of a page that was not free"
        seen[after] = j
    return "the sentinel changed"


def _render_tail(geo: Geometry, model: z3.ModelRef, pre: Mapping, req: TailRequest, post: Mapping) -> str:
    p, s, t = (as_int(model, x) for x in (req.p, req.s, req.t))
    rows = []
    for j in range(p, s):
        f = as_int(model, req.F[j])
        rows.append((j, f, as_int(model, pre.M[f]), as_int(model, post.M[f])))
    free = [as_bool(model, b) for b in pre.swa_free]
    table = "; ".join(f"pos {j}{'*' if j >= s - t else ''} slot {f} M {a}->{b}" for j, f, a, b in rows)
    return (f"P={geo.P} alloc_extend_swa_tail(prefix={p}, seq={s}, tail={t}): "
            f"{_explain_tail(geo, s, t, rows, free)} [{table}; * = tail]")


def _tail_obligation(
    name: str, statement: str, *, variant: TailVariant = TailVariant.SOUND, aligned: bool = True,
    nonempty_tail: bool = False, expect: Expect = "proved", twin_of: str | None = None,
) -> Obligation:
    """For each geometry: well-formed pre-state, the tail allocation, not M4 (``t >= 1`` if asked)."""

    def parts(geo: Geometry) -> tuple[Mapping, TailRequest, Mapping]:
        return Mapping.fresh(geo, "pre"), TailRequest.fresh(geo), Mapping.fresh(geo, "post")

    def violated(geo: Geometry) -> z3.BoolRef:
        pre, req, post = parts(geo)
        hypotheses = [*req.hypotheses(geo, pre, aligned=aligned), req.t >= (1 if nonempty_tail else 0)]
        step = alloc_extend_swa_tail(pre, req, post, variant)
        return z3.And(pre.well_formed(), *hypotheses, step, z3.Not(maps_exactly_tail(pre, req, post)))

    def render(model: z3.ModelRef) -> str:
        geo = next(g for g in GEOMETRIES if as_bool(model, violated(g)))
        return _render_tail(geo, model, *parts(geo))

    return Obligation(
        f"{COMPONENT}.alloc_extend_swa_tail.{name}", COMPONENT, FAMILY, statement, expect,
        lambda: [z3.Or([violated(g) for g in GEOMETRIES])], render, twin_of,
    )


# ---- M5: composite alloc_extend -----------------------------------------------------------


@dataclass(frozen=True)
class ExtendRequest:
    """One request extending ``[p, s)``; ``last_loc`` is the full slot of token ``p - 1`` (-1 if none)."""

    p: z3.ArithRef
    s: z3.ArithRef
    last_loc: z3.ArithRef
    full_pages: tuple[z3.ArithRef, ...]
    swa_pages: tuple[z3.ArithRef, ...]

    @staticmethod
    def fresh(geo: Geometry) -> ExtendRequest:
        g = geo.tag
        return ExtendRequest(
            z3.Int(f"p_{g}"), z3.Int(f"s_{g}"), z3.Int(f"last_loc_{g}"),
            tuple(z3.Int(f"full_page_{i}_{g}") for i in range(geo.num_pages)),
            tuple(z3.Int(f"swa_page_{i}_{g}") for i in range(geo.num_pages)),
        )

    def new(self, j: int) -> z3.BoolRef:
        return z3.And(self.p <= j, j < self.s)


def paged_slots(
    geo: Geometry, req: ExtendRequest, last_loc: z3.ArithRef, pages: Sequence[z3.ArithRef]
) -> list[z3.ArithRef]:
    """The paged ``alloc_extend`` kernel (§1.3): slot of each position ``j`` (meaningful for ``p <= j < s``)."""
    P = geo.P
    n1, _, _ = extend_parts_terms(req.p, req.s, P)
    first_new = ceil_p_term(req.p, P)
    return [
        z3.If(j < req.p + n1, last_loc + 1 + (j - req.p), pick(pages, (j - first_new) / P) * P + j % P)
        for j in range(geo.max_tokens)
    ]


def alloc_extend(
    pre: Mapping, req: ExtendRequest, post: Mapping, *, swa_fresh: bool = False
) -> tuple[z3.BoolRef, list[z3.ArithRef], list[z3.ArithRef]]:
    """Composite ``alloc_extend``: same kernel on both pools, SWA continuing from ``M[last_loc]``.

    Returns the step and the full and SWA slot of each position. ``swa_fresh``
    (broken) allocates the SWA side as a new sequence instead.
    """
    geo = pre.geo
    full = paged_slots(geo, req, req.last_loc, req.full_pages)
    if swa_fresh:
        fresh = ExtendRequest(z3.IntVal(0), req.s - req.p, z3.IntVal(-1), req.swa_pages, req.swa_pages)
        swa_seq = paged_slots(geo, fresh, z3.IntVal(-1), req.swa_pages)
        swa = [pick(swa_seq, j - req.p) for j in range(geo.max_tokens)]
    else:
        swa = paged_slots(geo, req, pre.read(req.last_loc), req.swa_pages)

    def written(x: int) -> z3.ArithRef:
        out: z3.ArithRef = pre.M[x]
        for j in range(geo.max_tokens):
            out = z3.If(z3.And(req.new(j), full[j] == x), swa[j], out)
        return out

    step = z3.And(*[post.M[x] == written(x) for x in range(geo.num_slots)], post.sentinel == pre.sentinel)
    return step, full, swa


def extend_hypotheses(
    geo: Geometry, pre: Mapping, req: ExtendRequest, *, mapped_last_loc: bool = True, swa_fresh: bool = False
) -> list[z3.BoolRef]:
    """Lengths, debug precondition on ``last_loc``, fresh distinct pages, and M2/M5 for ``last_loc``.

    When a partial page is continued, ``M[last_loc]`` has ``last_loc``'s in-page offset
    and lies on an allocated SWA page, and (the M5 precondition, dropped by a twin)
    is positive.
    """
    P = geo.P
    n_new = (req.s + P - 1) / P - (req.p + P - 1) / P
    n_swa = (req.s - req.p + P - 1) / P if swa_fresh else n_new
    continues = req.p % P != 0
    swa_last = pre.read(req.last_loc)
    fresh = []
    for pages, free, count in ((req.full_pages, None, n_new), (req.swa_pages, pre.swa_free, n_swa)):
        active = [i < count for i in range(len(pages))]
        fresh.append(distinct_when(active, pages))
        for i, q in enumerate(pages):
            free_q = pick(free, q, False) if free is not None else True
            fresh.append(z3.Implies(active[i], z3.And(geo.real_page(q), free_q)))
    last = [
        z3.If(req.p == 0, req.last_loc == -1, z3.And(geo.real_slot(req.last_loc), (req.last_loc + 1) % P == req.p % P)),
        z3.Implies(continues, z3.And(swa_last % P == req.last_loc % P, z3.Not(pick(pre.swa_free, swa_last / P, True)))),
        *([z3.Implies(continues, swa_last > 0)] if mapped_last_loc else []),
        # the continued full page is not among the fresh ones
        *[z3.Implies(z3.And(continues, i < n_new), page != req.last_loc / P) for i, page in enumerate(req.full_pages)],
    ]
    return [req.p >= 0, req.p <= req.s, req.s <= geo.max_tokens, *fresh, *last]


def maps_one_to_one(
    geo: Geometry, req: ExtendRequest, post: Mapping, full: list[z3.ArithRef], swa: list[z3.ArithRef]
) -> z3.BoolRef:
    """M5: ``M'[F_j] == S_j``, a real SWA slot with the in-page offset of ``F_j``; all distinct."""
    P = geo.P
    per_position = [
        z3.Implies(req.new(j), z3.And(geo.real_slot(swa[j]), swa[j] % P == full[j] % P))
        for j in range(geo.max_tokens)
    ]
    written = [
        z3.Implies(z3.And(req.new(j), full[j] == x), post.M[x] == swa[j])
        for j in range(geo.max_tokens) for x in range(geo.num_slots)
    ]
    return z3.And(*per_position, *written, distinct_when([req.new(j) for j in range(geo.max_tokens)], swa))


def _explain_extend(geo: Geometry, pairs: list[tuple[int, int, int]]) -> str:
    """First M5 violation among ``(position, full slot, SWA slot)`` triples."""
    seen: dict[int, int] = {}
    for j, full, swa in pairs:
        if swa < geo.P:
            return f"position {j} gets SWA slot {swa} on the reserved page 0"
        if swa >= geo.num_slots:
            return f"position {j} gets SWA slot {swa}, past the pool"
        if swa % geo.P != full % geo.P:
            return f"position {j}: SWA slot {swa} has in-page offset {swa % geo.P}, full slot {full} has {full % geo.P}"
        if swa in seen:
            return f"positions {seen[swa]} and {j} share SWA slot {swa}"
        seen[swa] = j
    return "a new full slot's mapping is not its SWA slot"


def _extend_obligation(
    name: str, statement: str, *, mapped_last_loc: bool = True, swa_fresh: bool = False,
    expect: Expect = "proved", twin_of: str | None = None,
) -> Obligation:
    """For each geometry: well-formed pre-state, composite alloc_extend, not M5."""

    def violated(geo: Geometry) -> z3.BoolRef:
        pre, req, post = Mapping.fresh(geo, "pre"), ExtendRequest.fresh(geo), Mapping.fresh(geo, "post")
        step, full, swa = alloc_extend(pre, req, post, swa_fresh=swa_fresh)
        hypotheses = extend_hypotheses(geo, pre, req, mapped_last_loc=mapped_last_loc, swa_fresh=swa_fresh)
        return z3.And(pre.well_formed(), *hypotheses, step,
                      z3.Not(maps_one_to_one(geo, req, post, full, swa)))

    def render(model: z3.ModelRef) -> str:
        geo = next(g for g in GEOMETRIES if as_bool(model, violated(g)))
        pre, req, post = Mapping.fresh(geo, "pre"), ExtendRequest.fresh(geo), Mapping.fresh(geo, "post")
        _, full, swa = alloc_extend(pre, req, post, swa_fresh=swa_fresh)
        p, s, last = (as_int(model, x) for x in (req.p, req.s, req.last_loc))
        pairs = [(j, as_int(model, full[j]), as_int(model, swa[j])) for j in range(p, s)]
        table = ", ".join(f"pos {j}: full {f} -> swa {w}" for j, f, w in pairs)
        swa_last = as_int(model, pre.read(req.last_loc))
        head = f"P={geo.P} alloc_extend(prefix={p}, seq={s}, last_loc={last}, M[last_loc]={swa_last})"
        return f"{head}: {_explain_extend(geo, pairs)} [{table}]"

    return Obligation(
        f"{COMPONENT}.alloc_extend.{name}", COMPONENT, FAMILY, statement, expect,
        lambda: [z3.Or([violated(g) for g in GEOMETRIES])], render, twin_of,
    )


_BOUND = "(bounded: P=2 with 3 pages and P=4 with 2 pages per pool)"

OBLIGATIONS: tuple[Obligation, ...] = (
    _free_swa_obligation(
        "clears_mapping",
        f"M3 {_BOUND}: after free_swa(idx), M is 0 on every slot of every full page idx touches, "
        "unchanged elsewhere, and the -1 sentinel stays",
        clears_mapping,
    ),
    _free_swa_obligation(
        "clears_mapping.no_clear", "a free_swa that does not clear M leaves live-looking entries",
        clears_mapping, variant=FreeSwaVariant.NO_CLEAR, expect="counterexample",
        twin_of="swa_allocator.free_swa.clears_mapping",
    ),
    _free_swa_obligation(
        "clears_mapping.given_slots_only",
        "clearing only the given slots (0.5.12) leaves stale M on the rest of a touched page",
        clears_mapping, variant=FreeSwaVariant.GIVEN_SLOTS_ONLY, expect="counterexample",
        twin_of="swa_allocator.free_swa.clears_mapping",
    ),
    _free_swa_obligation(
        "frees_exactly_mapped",
        f"M3 {_BOUND}: free_swa(idx) releases exactly the SWA pages of {{M[f] : f in idx, M[f] > 0}}, "
        "never page 0",
        frees_exactly_mapped,
    ),
    _free_swa_obligation(
        "frees_exactly_mapped.no_positive_filter",
        "without the M[f] > 0 filter an unmapped slot releases the reserved SWA page 0",
        frees_exactly_mapped, variant=FreeSwaVariant.NO_POSITIVE_FILTER, expect="counterexample",
        twin_of="swa_allocator.free_swa.frees_exactly_mapped",
    ),
    _tail_obligation(
        "maps_exactly_tail",
        f"M4 {_BOUND}: after alloc_extend_swa_tail(p, s, t) with (s - t) mod P == 0 (U1), position j in "
        "[p, s) is mapped iff j >= s - t, to a distinct fresh SWA slot with the in-page offset of j",
    ),
    _tail_obligation(
        "maps_exactly_tail.pre_25805",
        "without the non-tail clear (0.5.12) stale M survives on prefix slots, even with a nonempty tail",
        variant=TailVariant.PRE_25805, nonempty_tail=True, expect="counterexample",
        twin_of="swa_allocator.alloc_extend_swa_tail.maps_exactly_tail",
    ),
    _tail_obligation(
        "maps_exactly_tail.zero_tail_early_return",
        "SGLang's early return for swa_tail_len == 0 (R2) skips the clear",
        variant=TailVariant.ZERO_TAIL_EARLY_RETURN, expect="counterexample",
        twin_of="swa_allocator.alloc_extend_swa_tail.maps_exactly_tail",
    ),
    _tail_obligation(
        "maps_exactly_tail.one_slot_late",
        "a tail mapping that starts one slot late leaves the first tail position unmapped",
        variant=TailVariant.ONE_SLOT_LATE, expect="counterexample",
        twin_of="swa_allocator.alloc_extend_swa_tail.maps_exactly_tail",
    ),
    _tail_obligation(
        "maps_exactly_tail.unaligned_tail",
        "without U1 a tail position lands on an SWA slot of another in-page offset",
        aligned=False, expect="counterexample", twin_of="swa_allocator.alloc_extend_swa_tail.maps_exactly_tail",
    ),
    _extend_obligation(
        "maps_one_to_one",
        f"M5 {_BOUND}: composite alloc_extend with M[last_loc] > 0 when continuing a partial page maps each "
        "new full slot to a distinct real SWA slot with the same in-page offset",
    ),
    _extend_obligation(
        "maps_one_to_one.unmapped_last_loc",
        "continuing a partial page from an unmapped last_loc writes into the reserved SWA page 0",
        mapped_last_loc=False, expect="counterexample", twin_of="swa_allocator.alloc_extend.maps_one_to_one",
    ),
    _extend_obligation(
        "maps_one_to_one.swa_fresh_sequence",
        "allocating the SWA side as a fresh sequence breaks the in-page offsets",
        swa_fresh=True, expect="counterexample", twin_of="swa_allocator.alloc_extend.maps_one_to_one",
    ),
)
