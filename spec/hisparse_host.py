"""``hisparse_host``: HiSparse paged host pool rows (PR #23606; sglang_semantics.md §4.4-§4.6 H0-H4, §9 S7).

Obligations are named ``hisparse_host.<op>.<claim>`` after the reference operation they are
about, or ``hisparse_host.pool.<claim>`` for the whole-state invariant; a broken twin
appends what it breaks (Z3 refutes every twin with concrete numbers).

**The transition system** (:data:`SYSTEM`, built with :mod:`kvproof.spec._ts`): the pool
and the request table as slot counts (free slots, slots direct ``alloc`` calls hand out,
and per request slot its allocated length, skip-first-backup flag and written prefix),
each count as ``pages * P + extra`` so that whole pages (H0, H1) have an explicit witness;
constants ``P``, the pool's pages, ``max_context_len`` and the coordinator (``PAGED`` or
``PRE_23606``). One relation per reference operation, the reads included, named like it:
:func:`alloc`, :func:`alloc_page`, :func:`alloc_paged_token_slots`,
:func:`request_finished`, :func:`set_host_data`, :func:`admit_request_into_staging`,
:func:`eager_backup_previous_token`, :func:`allocated_host_indices`,
:func:`get_host_data`. ``tests/spec/test_drift_hisparse_host.py`` checks that each accepts
the steps of seeded reference runs of both coordinators. Over it:

* ``pool.initiation`` and ``<op>.keeps_pool`` for every state-changing op: H0-H3 on counts
  and "the written prefix lies in the row" (:func:`invariant_clauses`) are inductive
  under #23606. Twins: a pool sized by the requested slot count (§4.2); the pre-#23606
  token-granular ``alloc(n)`` and staging (§4.7); ``alloc_page`` taking slots for pages;
  ``alloc_paged_token_slots`` without ``max(a, .)``; a release keeping the skip flag (H3);
  a copy without the ownership check; the pre-#23606 backup batch (H1 at ``P_h > 1``);
* ``eager_backup_previous_token.backs_up_prefix`` (H4 on data): every position before the
  current token has host data at the next call (twin: the skip flag never cleared);
* ``allocated_host_indices.whole_pages``: the release read returns whole pages (twin: the
  pre-#23606 read up to ``compressed_len``);
* ``get_host_data.reads_staged_values``: after staging, the staged positions read back
  (twin: read before the staging copy completes).

**The arithmetic** of ``alloc_paged_token_slots(r, start, n)`` (:func:`row_width_term`,
:func:`allocated_len_after_term`, :func:`host_new_pages_term`, :func:`host_slot_term`, host
page size ``P >= 1``, a row of ``a = j * P`` slots, ``start >= 0``, ``n >= 1``,
``end = start + n``; the host pages of a row an uninterpreted ``page: block -> host page``)
and the coordinator's call sites (§4.5). ``tests/spec/test_hisparse_host.py`` evaluates the
builders on concrete integers against the reference and replays S7 through it.

* ``alloc_paged_token_slots.div_shift`` (lemma): ``(x + w*P) div P == x div P + w`` and
  ``(w*P) div P == w`` for ``P >= 1``; its instances are hypotheses of ``new_pages_count``
  (Z3's non-linear division reasoning times out on the composed query, not on the lemma);
* ``alloc_paged_token_slots.allocated_len_multiple`` (H1): the allocated length after the
  call is ``k * P`` for the explicit page count ``k``;
* ``alloc_paged_token_slots.covers_request``: after the call every requested position has
  a host slot (``alloc_len >= end``) and the row never shrinks (``>= a``);
* ``alloc_paged_token_slots.new_pages_count``: the call takes ``ceil((end - a)/P)`` pages
  when ``end > a`` and none otherwise;
* ``alloc_paged_token_slots.slots_distinct_in_own_pages_in_order`` (H1, H2): with pairwise
  distinct host pages per row, ``slot(pos) = page(pos div P)*P + pos mod P`` gives
  distinct slots to distinct positions, in the page of their block, increasing within a
  page;
* ``alloc_paged_token_slots.no_hole`` (H4): with ``start <= a`` (upstream's assert) every
  new page holds a requested position; without it (S7's ``start = 2000``) pages are
  reserved for positions nobody asked for;
* ``alloc_paged_token_slots.row_width_fits`` / ``row_width_exact`` (§4.3):
  ``ceil_P(end) <= max_context_len + P`` whenever ``end <= max_context_len``, and
  ``ceil_P(end) <= W <=> end <= floor_P(W)``;
* ``request_finished.release_restores_pool`` (H2, H3): the release frees the whole
  allocated length and keeps ``available + sum(alloc_len) == size`` in whole pages; the
  pre-#23606 release of ``compressed_len`` slots leaks;
* ``eager_backup_previous_token.backup_within_allocated`` (H4, by induction): after staging
  ``n`` tokens and the skipped first backup, every backup of position ``seq_len - 2``
  starts at most at the allocated length, and ``alloc_len >= seq_len - 2`` (a multiple of
  ``P``) holds again for ``seq_len + 1``;
* ``admit_request_into_staging.s7_vector``: S7 at ``P = 64``: staging 1 000 tokens takes 16
  pages (``alloc_len = 1024``), backups of positions 1 000-1 023 none, position 1 024 one
  (``alloc_len = 1088``), the release frees 17 pages; ``start = 2000`` would reserve a page
  with no requested position. Its twin is the pre-#23606 coordinator's token-granular
  ``alloc(1000)`` / ``alloc(3)`` at ``P_h = 64``, which breaks the page rule (§4.7).

Queries are quantifier-free; page-aligned values are products ``k * P`` with an explicit
witness ``k`` (see ``terms.part2_pages_term``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import z3

from kvproof.spec import _ts
from kvproof.spec._solver import Obligation, as_bool, as_int
from kvproof.spec.terms import IntLike, ceil_div_term, ceil_p_term, floor_p_term, lift, zmax

__all__ = [
    "OBLIGATIONS",
    "R_SLOTS",
    "S7",
    "SYSTEM",
    "Action",
    "CallVars",
    "Count",
    "Row",
    "State",
    "admit_request_into_staging",
    "alloc",
    "alloc_page",
    "alloc_paged_token_slots",
    "allocated_host_indices",
    "allocated_len_after_term",
    "allocated_pages_after_term",
    "cells",
    "columns",
    "describe",
    "div_shift_facts",
    "eager_backup_previous_token",
    "get_host_data",
    "host_new_pages_term",
    "host_slot_term",
    "init",
    "invariant_clauses",
    "request_finished",
    "row_pages",
    "row_width_term",
    "set_host_data",
    "system",
]

COMPONENT = "hisparse_host"
FAMILY = "hisparse_host"

PageFn = Callable[[z3.ArithRef], z3.ArithRef]


# ---- term builders (mirror kvproof.reference.hisparse_host) ---------------------------


def row_width_term(max_context_len: IntLike, page_size: IntLike) -> z3.ArithRef:
    """Width of a ``req_to_host_pool`` row: ``max_context_len + P`` (§4.3)."""
    return lift(max_context_len) + lift(page_size)


def allocated_len_after_term(allocated_len: IntLike, start_pos: IntLike, num_tokens: IntLike,
                             page_size: IntLike) -> z3.ArithRef:
    """``alloc_len`` after ``alloc_paged_token_slots``: ``max(a, ceil_P(start + n))``, ``a`` for ``n <= 0``."""
    a, n = lift(allocated_len), lift(num_tokens)
    return z3.If(n <= 0, a, zmax(a, ceil_p_term(lift(start_pos) + n, page_size)))


def allocated_pages_after_term(pages: IntLike, start_pos: IntLike, num_tokens: IntLike,
                               page_size: IntLike) -> z3.ArithRef:
    """The page count ``k`` with ``allocated_len_after(j * P, ...) == k * P`` (the explicit witness of H1)."""
    j, n, p = lift(pages), lift(num_tokens), lift(page_size)
    end = lift(start_pos) + n
    return z3.If(n <= 0, j, z3.If(j * p >= ceil_p_term(end, p), j, ceil_div_term(end, p)))


def host_new_pages_term(allocated_len: IntLike, start_pos: IntLike, num_tokens: IntLike,
                        page_size: IntLike) -> z3.ArithRef:
    """Pages the call takes: ``(allocated_len_after - a) div P``."""
    a = lift(allocated_len)
    return (allocated_len_after_term(a, start_pos, num_tokens, page_size) - a) / lift(page_size)


def host_slot_term(page: PageFn, position: IntLike, page_size: IntLike) -> z3.ArithRef:
    """Host slot of ``position``: ``page(position div P) * P + position mod P`` (one host page per block)."""
    pos, p = lift(position), lift(page_size)
    return page(pos / p) * p + pos % p


def row_pages(pages: Sequence[int]) -> PageFn:
    """A concrete row's host pages as a page function (``-1`` past the row), for evaluation."""

    def page(block: z3.ArithRef) -> z3.ArithRef:
        term: z3.ArithRef = z3.IntVal(-1)
        for b in reversed(range(len(pages))):
            term = z3.If(block == b, pages[b], term)
        return term

    return page


def div_shift_facts(x: IntLike, w: IntLike, page_size: IntLike) -> list[z3.BoolRef]:
    """Instances of lemma ``div_shift``: ``(x + w*P) div P == x div P + w`` and ``(w*P) div P == w``."""
    x, w, p = lift(x), lift(w), lift(page_size)
    return [(x + w * p) / p == x / p + w, (w * p) / p == w]


# ---- shared helpers ---------------------------------------------------------------------


_obligation = functools.partial(Obligation.of_component, COMPONENT)


@dataclass(frozen=True)
class CallVars:
    """One ``alloc_paged_token_slots(r, start, n)``: page size ``P``, ``j`` pages held (``a = j*P``)."""

    P: z3.ArithRef
    j: z3.ArithRef
    start: z3.ArithRef
    n: z3.ArithRef

    @staticmethod
    def fresh() -> CallVars:
        return CallVars(*z3.Ints("P j start n"))

    @property
    def a(self) -> z3.ArithRef:
        return self.j * self.P

    @property
    def end(self) -> z3.ArithRef:
        return self.start + self.n

    def hypotheses(self) -> list[z3.BoolRef]:
        """H1 before the call (``a = j*P``, ``j >= 0``), a non-empty request from ``start >= 0``."""
        return [self.P >= 1, self.j >= 0, self.start >= 0, self.n >= 1]

    def text(self, m: z3.ModelRef) -> str:
        p, j = as_int(m, self.P), as_int(m, self.j)
        start, n = as_int(m, self.start), as_int(m, self.n)
        return f"P={p} a={j * p} ({j} page{'' if j == 1 else 's'}) start={start} n={n} end={start + n}"


AfterRule = Callable[[CallVars], z3.ArithRef]


def sound_after(v: CallVars) -> z3.ArithRef:
    """The reference: ``max(a, ceil_P(end))``."""
    return allocated_len_after_term(v.a, v.start, v.n, v.P)


def after_no_round_up(v: CallVars) -> z3.ArithRef:
    """Wrong: ``max(a, end)`` (token-granular growth)."""
    return zmax(v.a, v.end)


def after_floor_end(v: CallVars) -> z3.ArithRef:
    """Wrong: ``max(a, floor_P(end))`` (rounds the end down)."""
    return zmax(v.a, floor_p_term(v.end, v.P))


def after_no_max(v: CallVars) -> z3.ArithRef:
    """Wrong: ``ceil_P(end)`` (forgets the pages already held)."""
    return ceil_p_term(v.end, v.P)


# ---- allocated_len_multiple (H1) ----------------------------------------------------------


def _not_multiple(x: z3.ArithRef, p: z3.ArithRef, witness: z3.ArithRef | None) -> z3.BoolRef:
    """``x`` is not a multiple of ``P``: ``x != witness * P`` for the formula's explicit page count (a proof),
    or, with no witness (a broken twin's search), ``x == q*P + r`` with a remainder ``0 < r < P``."""
    if witness is not None:
        return x != witness * p
    q, r = z3.Ints("q r")
    return z3.And(x == q * p + r, r >= 1, r < p)


def _multiple_build(rule: AfterRule, witness: Callable[[CallVars], z3.ArithRef] | None
                    ) -> Callable[[], list[z3.BoolRef]]:
    def build() -> list[z3.BoolRef]:
        v = CallVars.fresh()
        return [*v.hypotheses(), _not_multiple(rule(v), v.P, None if witness is None else witness(v))]

    return build


def _multiple_render(rule: AfterRule) -> Callable[[z3.ModelRef], str]:
    def render(m: z3.ModelRef) -> str:
        v = CallVars.fresh()
        after, p = as_int(m, rule(v)), as_int(m, v.P)
        return f"{v.text(m)} -> allocated length {after} = {after // p}*{p} + {after % p}, not a multiple of P"

    return render


def _sound_pages_witness(v: CallVars) -> z3.ArithRef:
    return allocated_pages_after_term(v.j, v.start, v.n, v.P)


# ---- covers_request --------------------------------------------------------------------------


def _covers_build(rule: AfterRule) -> Callable[[], list[z3.BoolRef]]:
    def build() -> list[z3.BoolRef]:
        v = CallVars.fresh()
        after = rule(v)
        return [*v.hypotheses(), z3.Not(z3.And(after >= v.end, after >= v.a))]

    return build


def _covers_render(rule: AfterRule) -> Callable[[z3.ModelRef], str]:
    def render(m: z3.ModelRef) -> str:
        v = CallVars.fresh()
        after, a, end = as_int(m, rule(v)), as_int(m, v.a), as_int(m, v.end)
        what = (f"positions [{after}, {end}) have no host slot" if after < end
                else f"the row shrinks from {a} to {after}")
        return f"{v.text(m)} -> allocated length {after}: {what}"

    return render


# ---- new_pages_count -------------------------------------------------------------------------

PagesRule = Callable[[CallVars], z3.ArithRef]


def sound_pages(v: CallVars) -> z3.ArithRef:
    return host_new_pages_term(v.a, v.start, v.n, v.P)


def pages_from_n(v: CallVars) -> z3.ArithRef:
    """Wrong: ``ceil(n/P)`` pages whenever the rounded end passes ``a`` (ignores the pages held)."""
    return z3.If(ceil_p_term(v.end, v.P) > v.a, ceil_div_term(v.n, v.P), 0)


def pages_floor(v: CallVars) -> z3.ArithRef:
    """Wrong: ``floor((end - a)/P)`` pages."""
    return z3.If(v.end > v.a, (v.end - v.a) / v.P, 0)


def _needed_pages(v: CallVars) -> z3.ArithRef:
    return z3.If(v.end > v.a, ceil_div_term(v.end - v.a, v.P), 0)


def _pages_build(rule: PagesRule) -> Callable[[], list[z3.BoolRef]]:
    def build() -> list[z3.BoolRef]:
        v = CallVars.fresh()
        c = ceil_div_term(v.end, v.P)
        taken = z3.If(v.a >= c * v.P, 0, c - v.j)  # the page count of after - a
        lemma = [*div_shift_facts(v.end + v.P - 1, -v.j, v.P), *div_shift_facts(0, taken, v.P)]
        return [*v.hypotheses(), *lemma, rule(v) != _needed_pages(v)]

    return build


def _pages_render(rule: PagesRule) -> Callable[[z3.ModelRef], str]:
    def render(m: z3.ModelRef) -> str:
        v = CallVars.fresh()
        return (f"{v.text(m)} -> takes {as_int(m, rule(v))} pages, needs {as_int(m, _needed_pages(v))} "
                f"(ceil((end - a)/P), 0 when end <= a)")

    return render


# ---- slots_distinct_in_own_pages_in_order (H1, H2) ----------------------------------------

SlotRule = Callable[[PageFn, z3.ArithRef, z3.ArithRef], z3.ArithRef]


def slot_pos_offset(page: PageFn, pos: z3.ArithRef, p: z3.ArithRef) -> z3.ArithRef:
    """Wrong: ``page(b)*P + pos`` (the position, not its offset in the page)."""
    return page(pos / p) * p + pos


def slot_page_plus_offset(page: PageFn, pos: z3.ArithRef, p: z3.ArithRef) -> z3.ArithRef:
    """Wrong: ``page(b) + pos mod P`` (a page index used as a slot)."""
    return page(pos / p) + pos % p


@dataclass(frozen=True)
class SlotVars:
    """Page size, the request ``[start, end)``, two positions ``x < y`` in it, the row's host pages."""

    P: z3.ArithRef
    start: z3.ArithRef
    n: z3.ArithRef
    x: z3.ArithRef
    y: z3.ArithRef
    page: z3.FuncDeclRef

    @staticmethod
    def fresh() -> SlotVars:
        p, start, n, x, y = (z3.Int(name) for name in ("P", "start", "n", "x", "y"))
        return SlotVars(p, start, n, x, y, z3.Function("page", z3.IntSort(), z3.IntSort()))

    def blocks(self) -> tuple[z3.ArithRef, z3.ArithRef]:
        return self.x / self.P, self.y / self.P

    def hypotheses(self, injective: bool) -> list[z3.BoolRef]:
        bx, by = self.blocks()
        facts = [self.P >= 1, self.start >= 0, self.n >= 1, self.start <= self.x, self.x < self.y,
                 self.y < self.start + self.n, self.page(bx) >= 0, self.page(by) >= 0]
        if injective:  # distinct host pages in one row (H2), the instance at the two blocks
            facts.append(z3.Implies(bx != by, self.page(bx) != self.page(by)))
        return facts


def _slot_parts(v: SlotVars, rule: SlotRule) -> dict[str, z3.BoolRef]:
    bx, by = v.blocks()
    sx, sy = rule(v.page, v.x, v.P), rule(v.page, v.y, v.P)
    return {"distinct": sx != sy, "own_x": sx / v.P == v.page(bx), "own_y": sy / v.P == v.page(by),
            "ordered": z3.Implies(bx == by, sx < sy)}


def _slots_build(rule: SlotRule, injective: bool) -> Callable[[], list[z3.BoolRef]]:
    def build() -> list[z3.BoolRef]:
        v = SlotVars.fresh()
        return [*v.hypotheses(injective), z3.Not(z3.And(*_slot_parts(v, rule).values()))]

    return build


def _slots_render(rule: SlotRule) -> Callable[[z3.ModelRef], str]:
    def render(m: z3.ModelRef) -> str:
        v = SlotVars.fresh()
        bx, by = v.blocks()
        p, x, y = as_int(m, v.P), as_int(m, v.x), as_int(m, v.y)
        gx, gy = as_int(m, v.page(bx)), as_int(m, v.page(by))
        sx, sy = as_int(m, rule(v.page, v.x, v.P)), as_int(m, rule(v.page, v.y, v.P))
        start, n = as_int(m, v.start), as_int(m, v.n)
        broken = [
            *([f"both get slot {sx}"] if sx == sy else []),
            *([f"slot {sx} of x lies in host page {sx // p}, not {gx}"] if sx // p != gx else []),
            *([f"slot {sy} of y lies in host page {sy // p}, not {gy}"] if sy // p != gy else []),
            *([f"same page but slot {sx} >= {sy}"] if x // p == y // p and sx >= sy else []),
        ]
        return (f"P={p} request [{start}, {start + n}) x={x} (block {x // p} -> page {gx}) y={y} "
                f"(block {y // p} -> page {gy}): slots {sx}, {sy}; " + "; ".join(broken))

    return render


# ---- no_hole (H4) ----------------------------------------------------------------------------


def _no_hole_build(precondition: bool) -> Callable[[], list[z3.BoolRef]]:
    def build() -> list[z3.BoolRef]:
        v, b = CallVars.fresh(), z3.Int("b")
        after = sound_after(v)
        new_block = [v.j <= b, (b + 1) * v.P <= after]  # block b = positions [b*P, (b+1)*P) is new
        holds_request = z3.And(b * v.P < v.end, (b + 1) * v.P > v.start)
        facts = [*v.hypotheses(), *new_block, z3.Not(holds_request)]
        return [*facts, v.start <= v.a] if precondition else [*facts, v.P >= 2]

    return build


def _no_hole_render(m: z3.ModelRef) -> str:
    v, b = CallVars.fresh(), z3.Int("b")
    p, bb = as_int(m, v.P), as_int(m, b)
    return (f"{v.text(m)} -> allocated length {as_int(m, sound_after(v))}; new page of block {bb} "
            f"(positions [{bb * p}, {bb * p + p})) holds no requested position of "
            f"[{as_int(m, v.start)}, {as_int(m, v.end)})")


# ---- row_width_fits / row_width_exact (§4.3) --------------------------------------------------


def _fits_build(width: Callable[[z3.ArithRef, z3.ArithRef], z3.ArithRef]) -> Callable[[], list[z3.BoolRef]]:
    def build() -> list[z3.BoolRef]:
        p, m_len, start, n = z3.Ints("P max_context_len start n")
        end = start + n
        return [p >= 1, m_len >= 1, start >= 0, n >= 1, end <= m_len,
                z3.Not(ceil_p_term(end, p) <= width(m_len, p))]

    return build


def _fits_render(width: Callable[[z3.ArithRef, z3.ArithRef], z3.ArithRef]) -> Callable[[z3.ModelRef], str]:
    def render(m: z3.ModelRef) -> str:
        p, m_len, start, n = z3.Ints("P max_context_len start n")
        end = start + n
        return (f"max_context_len={as_int(m, m_len)} P={as_int(m, p)} start={as_int(m, start)} n={as_int(m, n)} "
                f"end={as_int(m, end)} -> ceil_P(end)={as_int(m, ceil_p_term(end, p))} > row width "
                f"{as_int(m, width(m_len, p))}")

    return render


def _no_padding(m_len: z3.ArithRef, p: z3.ArithRef) -> z3.ArithRef:
    return m_len


def _exact_build(bound: Callable[[z3.ArithRef, z3.ArithRef], z3.ArithRef]) -> Callable[[], list[z3.BoolRef]]:
    def build() -> list[z3.BoolRef]:
        p, w, end = z3.Ints("P width end")
        return [p >= 1, w >= 0, end >= 0, (ceil_p_term(end, p) <= w) != (end <= bound(w, p))]

    return build


def _exact_render(bound: Callable[[z3.ArithRef, z3.ArithRef], z3.ArithRef]) -> Callable[[z3.ModelRef], str]:
    def render(m: z3.ModelRef) -> str:
        p, w, end = z3.Ints("P width end")
        cp, bd = as_int(m, ceil_p_term(end, p)), as_int(m, bound(w, p))
        e, wv = as_int(m, end), as_int(m, w)
        return (f"P={as_int(m, p)} width={wv} end={e}: ceil_P(end)={cp} {'<=' if cp <= wv else '>'} width but "
                f"end {'<=' if e <= bd else '>'} bound {bd}")

    return render


# ---- release_restores_pool (H2, H3) ------------------------------------------------------------


def _release_vars() -> tuple[z3.ArithRef, ...]:
    return tuple(z3.Int(name) for name in ("P", "free_pages", "j1", "j2", "size", "compressed_len"))


def _release_build(pre_23606: bool) -> Callable[[], list[z3.BoolRef]]:
    def build() -> list[z3.BoolRef]:
        p, f, j1, j2, size, cl = _release_vars()
        available, a1, a2 = f * p, j1 * p, j2 * p
        freed = cl if pre_23606 else a1  # request_finished frees allocated_host_indices: alloc_len slots
        facts = [p >= 1, f >= 0, j1 >= 0, j2 >= 0, available + a1 + a2 == size]
        if pre_23606:  # freed table[r, :compressed_len]: the sequence's length, at most the row
            facts += [cl >= 0, cl <= a1]
        available2, a1_after = available + freed, z3.IntVal(0)  # row reset to -1, alloc_len 0 (H3)
        goal = z3.And(available2 + a1_after + a2 == size, available2 == (f + j1) * p)
        return [*facts, z3.Not(goal)]

    return build


def _release_render(pre_23606: bool) -> Callable[[z3.ModelRef], str]:
    def render(m: z3.ModelRef) -> str:
        p, f, j1, j2, size, cl = (as_int(m, t) for t in _release_vars())
        a1 = j1 * p
        freed = cl if pre_23606 else a1
        what = f"frees compressed_len={cl} slots" if pre_23606 else f"frees {a1} slots"
        total = f * p + freed + j2 * p
        partial = f", the last freed page is partial ({freed % p} of {p} slots, H0)" if freed % p else ""
        return (f"P={p} size={size} available={f * p} alloc_len=({a1}, {j2 * p}): release of request 0 {what}, "
                f"row reset -> available {f * p + freed} + owned {j2 * p} = {total} of {size} (leaks "
                f"{size - total} slots{partial})")

    return render


# ---- backup_within_allocated (H4, induction) -----------------------------------------------

BackupRule = Callable[[z3.ArithRef, z3.ArithRef, z3.ArithRef], z3.ArithRef]


def sound_backup(a: z3.ArithRef, s: z3.ArithRef, p: z3.ArithRef) -> z3.ArithRef:
    """``alloc_paged_token_slots(r, seq_len - 2, 1)``'s new allocated length."""
    return allocated_len_after_term(a, s - 2, 1, p)


def backup_no_extension(a: z3.ArithRef, s: z3.ArithRef, p: z3.ArithRef) -> z3.ArithRef:
    """Wrong: the backup writes into the row but never extends it by a page."""
    return a


def backup_end_at_start(a: z3.ArithRef, s: z3.ArithRef, p: z3.ArithRef) -> z3.ArithRef:
    """Wrong: the page end rounded from ``start`` instead of ``start + 1`` (``ceil_P(start)``)."""
    return zmax(a, ceil_p_term(s - 2, p))


def _backup_vars() -> tuple[z3.ArithRef, ...]:
    return tuple(z3.Int(name) for name in ("P", "n", "k", "s"))


def _backup_build(rule: BackupRule) -> Callable[[], list[z3.BoolRef]]:
    """Base and step of the invariant ``alloc_len = k*P, k >= 1, alloc_len >= seq_len - 2`` (a staged row)."""

    def build() -> list[z3.BoolRef]:
        p, n, k, s = _backup_vars()
        # base: staging n tokens (seq_len n + 1, whose first backup is skipped) -> the next call's seq_len n + 2
        k0 = allocated_pages_after_term(0, 0, n, p)
        a0 = allocated_len_after_term(0, 0, n, p)
        base_broken = z3.Or(a0 != k0 * p, k0 < 1, a0 < (n + 2) - 2)
        # step: the call at seq_len s backs up position s - 2 = start
        a = k * p
        a2 = rule(a, s, p)
        witness = allocated_pages_after_term(k, s - 2, 1, p) if rule is sound_backup else None
        step_broken = z3.Or(s - 2 > a, _not_multiple(a2, p, witness), a2 < k * p, a2 < (s + 1) - 2)
        return [p >= 1, n >= 1, k >= 1, s >= 2, a >= s - 2, z3.Or(base_broken, step_broken)]

    return build


def _backup_render(rule: BackupRule) -> Callable[[z3.ModelRef], str]:
    def render(m: z3.ModelRef) -> str:
        p, n, k, s = _backup_vars()
        pv, nv, kv, sv = (as_int(m, t) for t in (p, n, k, s))
        a0 = as_int(m, allocated_len_after_term(0, 0, n, p))
        a, a2 = kv * pv, as_int(m, rule(k * p, s, p))
        if a0 < nv or a0 < pv or a0 % pv:
            return f"P={pv}: staging {nv} tokens leaves alloc_len {a0} (next backup position {nv})"
        head = f"P={pv} alloc_len={a} seq_len={sv}: backup of position {sv - 2}"
        if sv - 2 > a:
            return f"{head} > alloc_len (hole)"
        if a2 < sv - 1:
            return (f"{head} leaves alloc_len {a2}; the next call (seq_len {sv + 1}) backs up position {sv - 1} "
                    f"> {a2} (hole)")
        if a2 < a:
            return f"{head} shrinks the row to {a2}"
        return f"{head} leaves alloc_len {a2}, not a multiple of P"

    return render


# ---- s7_vector (§4.7, §9 S7) -------------------------------------------------------------------

S7 = {"P": 64, "prefill": 1000, "staged": 1024, "staged_pages": 16, "first_backup": 1000, "last_in_page": 1023,
      "crossing": 1024, "after_crossing": 1088, "released_pages": 17, "hole_start": 2000, "batch": 3}
"""§4.7 / §9 S7 at ``P_h = 64`` (``batch``: a backup batch of 3 requests, the pre-#23606 ``alloc(#reqs)``)."""


def _s7_build() -> list[z3.BoolRef]:
    p, pos, b = 64, z3.Int("pos"), z3.Int("b")
    staged = allocated_len_after_term(0, 0, S7["prefill"], p)
    crossing = allocated_len_after_term(S7["staged"], S7["crossing"], 1, p)
    hole_after = allocated_len_after_term(S7["after_crossing"], S7["hole_start"], 1, p)
    claims = z3.And(
        staged == S7["staged"], host_new_pages_term(0, 0, S7["prefill"], p) == S7["staged_pages"],
        # positions 1000..1023 (seq_len 1002..1025) land in reserved slots: no page, same length
        z3.Implies(z3.And(S7["first_backup"] <= pos, pos <= S7["last_in_page"]),
                   z3.And(host_new_pages_term(S7["staged"], pos, 1, p) == 0,
                          allocated_len_after_term(S7["staged"], pos, 1, p) == S7["staged"])),
        host_new_pages_term(S7["staged"], S7["crossing"], 1, p) == 1, crossing == S7["after_crossing"],
        crossing / p == S7["released_pages"], crossing % p == 0,
        # start = 2000 > 1088 (upstream asserts): page 17 would be reserved, no requested position in it
        z3.Implies(b == S7["after_crossing"] // p,
                   z3.And(S7["hole_start"] > S7["after_crossing"], (b + 1) * p <= hole_after,
                          z3.Not(z3.And(b * p < S7["hole_start"] + 1, (b + 1) * p > S7["hole_start"])))),
    )
    return [z3.Not(claims)]


def _s7_render(m: z3.ModelRef) -> str:
    return f"S7 numbers do not hold at pos={as_int(m, z3.Int('pos'))} b={as_int(m, z3.Int('b'))}"


def _s7_pre_build() -> list[z3.BoolRef]:
    p, prefill, batch = z3.Ints("P prefill batch")
    page_rule = z3.And(floor_p_term(prefill, p) == prefill, floor_p_term(batch, p) == batch)
    return [p == S7["P"], prefill == S7["prefill"], batch == S7["batch"], z3.Not(page_rule)]


def _s7_pre_render(m: z3.ModelRef) -> str:
    p, prefill, batch = (as_int(m, t) for t in z3.Ints("P prefill batch"))
    return (f"pre-#23606 coordinator at P_h={p}: staging alloc({prefill}) = {prefill // p}*{p} + {prefill % p} and "
            f"backup alloc({batch}) for a batch of {batch} requests = {batch // p}*{p} + {batch % p}: not whole "
            f"pages (alloc asserts n % P_h == 0)")


# ---- div_shift lemma -------------------------------------------------------------------------


def _shift_build(shift: bool) -> Callable[[], list[z3.BoolRef]]:
    def build() -> list[z3.BoolRef]:
        p, x, w = z3.Ints("P x w")
        if shift:
            return [p >= 1, z3.Not(z3.And(*div_shift_facts(x, w, p)))]
        # wrong generalisation: (x + w) div P == x div P + w div P for any w
        return [p >= 1, (x + w) / p != x / p + w / p]

    return build


def _shift_render(m: z3.ModelRef) -> str:
    p, x, w = (as_int(m, t) for t in z3.Ints("P x w"))
    return f"P={p} x={x} w={w}: (x + w) div P = {(x + w) // p}, x div P + w div P = {x // p + w // p}"


# ---- the transition system: one transition per operation of kvproof.reference.hisparse_host ---------
#
# The host pool and the request table as counts: free host slots, slots handed out by direct ``alloc``
# / ``alloc_page`` calls (owned by no row), and per request slot its allocated length, its
# skip-first-backup flag and its written prefix (row positions ``[0, filled)`` hold host data). A slot
# count is whole pages plus extra slots (``pages * P + extra``, ``0 <= extra < P``): the explicit page
# count is the witness H0 and H1 need (``extra == 0``). The page size, the pool's pages,
# ``max_context_len`` and the coordinator are constants: one Z3 symbol in every state.

R_SLOTS = 2
"""Request slots of the model: two rows share the pool (a backup batch of two, one row released)."""


@dataclass(frozen=True)
class Count:
    """A number of host slots as ``pages * P + extra`` (``0 <= extra < P``: ``extra == 0`` is whole pages)."""

    pages: z3.ArithRef
    extra: z3.ArithRef

    @staticmethod
    def fresh(name: str) -> Count:
        return Count(z3.Int(f"{name}_pages"), z3.Int(f"{name}_extra"))

    def slots(self, P: IntLike) -> z3.ArithRef:
        return self.pages * lift(P) + self.extra

    def is_(self, slots: IntLike, P: IntLike) -> z3.BoolRef:
        """This count holds ``slots`` slots."""
        return z3.And(self.pages == lift(slots) / lift(P), self.extra == lift(slots) % lift(P))

    def same(self, other: Count) -> z3.BoolRef:
        return z3.And(self.pages == other.pages, self.extra == other.extra)

    @staticmethod
    def of(slots: IntLike, P: IntLike) -> Count:
        """``slots`` as a count (``slots div P`` pages, ``slots mod P`` extra)."""
        return Count(lift(slots) / lift(P), lift(slots) % lift(P))

    @staticmethod
    def whole(pages: IntLike) -> Count:
        return Count(lift(pages), z3.IntVal(0))

    def plus(self, other: Count, P: IntLike, *, sign: int = 1) -> Count:
        """``self + other`` (``sign=-1``: ``self - other``): pages add, extra slots add with a carry."""
        extra = self.extra + sign * other.extra
        return Count(self.pages + sign * other.pages + extra / lift(P), extra % lift(P))

    def well_formed(self, P: IntLike) -> z3.BoolRef:
        return z3.And(self.pages >= 0, self.extra >= 0, self.extra < lift(P))


@dataclass(frozen=True)
class Row:
    """One request slot's row: allocated length, skip-first-backup flag, written prefix."""

    alen: Count
    skip: z3.BoolRef
    filled: z3.ArithRef

    @staticmethod
    def fresh(tag: str) -> Row:
        return Row(Count.fresh(f"alen{tag}"), z3.Bool(f"skip{tag}"), z3.Int(f"filled{tag}"))


@dataclass(frozen=True)
class State:
    """Free slots, slots owned by no row, the rows; constants ``P``, the pool's pages, ``M``, the coordinator."""

    P: z3.ArithRef
    num_pages: z3.ArithRef
    M: z3.ArithRef
    paged: z3.BoolRef
    free: Count
    loose: Count
    rows: tuple[Row, ...]

    @staticmethod
    def fresh(tag: str, n: int = R_SLOTS) -> State:
        """Variables ``name@tag``; the constants are the same symbols in every state."""
        return State(z3.Int("P"), z3.Int("num_pages"), z3.Int("max_context_len"), z3.Bool("paged"),
                         Count.fresh(f"free@{tag}"), Count.fresh(f"loose@{tag}"),
                         tuple(Row.fresh(f"{r}@{tag}") for r in range(n)))

    @property
    def width(self) -> z3.ArithRef:
        return row_width_term(self.M, self.P)

    @property
    def avail(self) -> z3.ArithRef:
        return self.free.slots(self.P)

    def alen(self, r: int) -> z3.ArithRef:
        return self.rows[r].alen.slots(self.P)


@dataclass(frozen=True)
class Action:
    """An operation's arguments as the model reads them.

    ``req`` is the request slot; ``start`` / ``n`` are ``alloc_paged_token_slots``' (``n`` is also
    ``alloc``'s ``need_size``, ``alloc_page``'s ``k`` and the number of values staged); per request slot
    ``batch`` / ``seq`` are an eager backup's entries and ``upto`` is one past the last row position a
    ``set_host_data`` / ``get_host_data`` touches (0: none); ``count`` is a read's result: the slots
    ``allocated_host_indices`` returns, the ``None`` values ``get_host_data`` returns.
    """

    req: z3.ArithRef
    start: z3.ArithRef
    n: z3.ArithRef
    batch: tuple[z3.BoolRef, ...]
    seq: tuple[z3.ArithRef, ...]
    upto: tuple[z3.ArithRef, ...]
    count: z3.ArithRef

    @staticmethod
    def fresh(tag: str, n: int = R_SLOTS) -> Action:
        t = f"_arg@{tag}"
        return Action(z3.Int(f"req{t}"), z3.Int(f"start{t}"), z3.Int(f"n{t}"),
                          tuple(z3.Bool(f"batch{r}{t}") for r in range(n)),
                          tuple(z3.Int(f"seq{r}{t}") for r in range(n)), tuple(z3.Int(f"upto{r}{t}") for r in range(n)),
                          z3.Int(f"count{t}"))


def _row_is(v: Row, alen: Count, skip: z3.BoolRef | bool, filled: IntLike) -> z3.BoolRef:
    return z3.And(v.alen.same(alen), v.skip == skip, v.filled == lift(filled))


def _same_row(u: Row, v: Row) -> z3.BoolRef:
    return z3.And(v.alen.same(u.alen), v.skip == u.skip, v.filled == u.filled)


def _valid_req(s: State, req: z3.ArithRef) -> z3.BoolRef:
    """``_check_req``: a request slot indexes the table."""
    return z3.And(req >= 0, req < len(s.rows))


def _at(s: State, req: z3.ArithRef, value: Callable[[int], z3.ExprRef]) -> z3.ExprRef:
    """``value(r)`` of the row ``req`` (an ``If`` chain; ``req`` is a valid slot)."""
    term = value(len(s.rows) - 1)
    for r in reversed(range(len(s.rows) - 1)):
        term = z3.If(req == r, value(r), term)
    return term


def _one_row(s: State, t: State, req: z3.ArithRef, alen: Count, skip: z3.BoolRef | bool,
             filled: IntLike) -> list[z3.BoolRef]:
    """Row ``req`` becomes ``(alen, skip, filled)``, the others stay."""
    return [z3.If(req == r, _row_is(v, alen, skip, filled), _same_row(u, v))
            for r, (u, v) in enumerate(zip(s.rows, t.rows, strict=True))]


def _row_count(s: State, req: z3.ArithRef) -> Count:
    """Row ``req``'s allocated length as a count."""
    return Count(_at(s, req, lambda r: s.rows[r].alen.pages), _at(s, req, lambda r: s.rows[r].alen.extra))


def _pool(s: State, t: State, taken: Count | None = None, *, loose: bool = False,
          returned: bool = False) -> list[z3.BoolRef]:
    """``taken`` slots leave the free list (``returned``: come back); ``loose``: the caller holds them (no row)."""
    if taken is None:
        return [t.free.same(s.free), t.loose.same(s.loose)]
    free = s.free.plus(taken, s.P, sign=1 if returned else -1)
    held = s.loose.plus(taken, s.P) if loose else s.loose
    return [t.free.same(free), t.loose.same(held)]


def alloc(s: State, a: Action, t: State, *, page_rule: bool = True) -> z3.BoolRef:
    """``alloc(need_size)`` (§4.2): the first ``need_size`` free slots, whole pages only (the page rule), for
    the caller (no row holds them); ``OutOfMemory`` (no step) when short.

    ``page_rule=False`` is a broken twin: the pre-#23606 coordinator's token-granular ``alloc(n)`` (§4.7).
    """
    rule = [a.n % s.P == 0] if page_rule else []
    return z3.And(a.n >= 0, *rule, a.n <= s.avail, *_pool(s, t, Count.of(a.n, s.P), loose=True),
                  *(_same_row(u, v) for u, v in zip(s.rows, t.rows, strict=True)))


def alloc_page(s: State, a: Action, t: State, *, whole_pages: bool = True) -> z3.BoolRef:
    """``alloc_page(k) = alloc(k * P_h)`` (§4.4).

    ``whole_pages=False`` is a broken twin: ``k`` slots instead of ``k`` pages, the page rule unchecked.
    """
    need = Count.whole(a.n) if whole_pages else Count.of(a.n, s.P)
    return z3.And(a.n >= 0, need.slots(s.P) <= s.avail, *_pool(s, t, need, loose=True),
                  *(_same_row(u, v) for u, v in zip(s.rows, t.rows, strict=True)))


def alloc_paged_token_slots(s: State, a: Action, t: State, *, keeps_held: bool = True
                            ) -> z3.BoolRef:
    """``alloc_paged_token_slots(req, start, n)`` (§4.4): nothing for ``n <= 0``; else ``start <= a`` (no
    hole), the rounded end within the row, and ``host_new_pages`` whole pages appended to the row.

    ``keeps_held=False`` is a broken twin: the row set to ``ceil_P(end)`` without ``max(a, .)``.
    """
    held = _row_count(s, a.req)
    a_len, end = held.slots(s.P), a.start + a.n
    taken = Count.whole(host_new_pages_term(a_len, a.start, a.n, s.P))
    alen = held.plus(taken, s.P)
    if not keeps_held:  # the row's pages past ceil_P(end) are dropped; new pages when it passes the row
        alen = Count.whole(ceil_div_term(end, s.P))
        taken = Count.whole(zmax(0, alen.pages - held.pages))
    skip, filled = _at(s, a.req, lambda r: s.rows[r].skip), _at(s, a.req, lambda r: s.rows[r].filled)
    row = _one_row(s, t, a.req, alen, skip, filled)
    call = z3.And(a.start >= 0, a.start <= a_len, ceil_p_term(end, s.P) <= s.width, taken.slots(s.P) <= s.avail,
                  *_pool(s, t, taken), *row)
    nothing = z3.And(*_pool(s, t), *(_same_row(u, v) for u, v in zip(s.rows, t.rows, strict=True)))
    return z3.And(_valid_req(s, a.req), z3.If(a.n <= 0, nothing, call))


def request_finished(s: State, a: Action, t: State, *, clears_skip: bool = True) -> z3.BoolRef:
    """``request_finished(req)`` (§4.5): the row's slots back to the free list, the row reset to -1, length 0,
    its skip flag cleared (H3).

    ``clears_skip=False`` is a broken twin: the skip flag survives the release.
    """
    skip = z3.BoolVal(False) if clears_skip else _at(s, a.req, lambda r: s.rows[r].skip)
    return z3.And(_valid_req(s, a.req), *_pool(s, t, _row_count(s, a.req), returned=True),
                  *_one_row(s, t, a.req, Count.whole(0), skip, 0))


def set_host_data(s: State, a: Action, t: State, *, owned_only: bool = True) -> z3.BoolRef:
    """``set_host_data(slots, values)``: the device-to-host copy into host slots some row owns (positions below
    the rows' allocated lengths); no slot moves; writes below ``upto`` may extend a row's written prefix up
    to ``upto`` (not past a gap they leave).

    ``owned_only=False`` is a broken twin: without ``_check_slots`` a copy writes row positions past the
    allocated length (table entries -1: slots the row does not own).
    """
    facts = _pool(s, t)
    for r, (u, v, x) in enumerate(zip(s.rows, t.rows, a.upto, strict=True)):
        facts += [x >= 0, v.alen.same(u.alen), v.skip == u.skip, v.filled >= u.filled, v.filled <= zmax(u.filled, x)]
        if owned_only:
            facts.append(x <= s.alen(r))
    return z3.And(facts)


def admit_request_into_staging(s: State, a: Action, t: State, *, rounds_up: bool = True,
                               copies: bool = True) -> z3.BoolRef:
    """``admit_request_into_staging(req, values)`` (§4.5): an empty row (H3), ``1 <= n <= max_context_len``;
    ``PAGED``: ``alloc_paged_token_slots(req, 0, n)`` (``ceil_P(n)`` slots), ``PRE_23606``: ``alloc(n)`` (the
    page rule); then the copy of the ``n`` values and the skip flag set.

    Broken twins: ``rounds_up=False`` takes ``n`` slots under ``PAGED`` too (token-granular, no page rule);
    ``copies=False`` is the row read before the staging copy completes (§4.5: the request waits for it).
    """
    n = a.n
    paged = Count.whole(ceil_div_term(n, s.P)) if rounds_up else Count.of(n, s.P)
    token = Count.of(n, s.P)
    alen = Count(z3.If(s.paged, paged.pages, token.pages), z3.If(s.paged, paged.extra, token.extra))
    rule = z3.If(s.paged, paged.slots(s.P) <= s.width, n % s.P == 0)
    held = _row_count(s, a.req)
    empty = z3.And(held.pages == 0, held.extra == 0)
    return z3.And(_valid_req(s, a.req), n >= 1, empty, n <= s.M, rule, alen.slots(s.P) <= s.avail, *_pool(s, t, alen),
                  *_one_row(s, t, a.req, alen, True, n if copies else 0))


def eager_backup_previous_token(s: State, a: Action, t: State, *, clears_skip: bool = True,
                                pre_23606: bool = False) -> z3.BoolRef:
    """``eager_backup_previous_token(reqs, seq_lens, values)`` (§4.5): every entry is staged with a previous
    token (``seq_len >= 2``); an entry admitted since the last backup is skipped once; the others back up
    position ``seq_len - 2`` (H4: at most the allocated length). ``PAGED``: ``alloc_paged_token_slots(r,
    seq_len - 2, 1)`` per entry, all or nothing; ``PRE_23606``: one ``alloc`` (the page rule) for the entries
    whose position extends their row, one slot each.

    Broken twins: ``clears_skip=False`` never clears the skip flag; ``pre_23606=True`` runs the pre-#23606
    coordinator whatever the state's.
    """
    paged = z3.BoolVal(False) if pre_23606 else s.paged
    facts, taken_pages, fresh = [], [], []
    for r, (u, v, on, seq) in enumerate(zip(s.rows, t.rows, a.batch, a.seq, strict=True)):
        a_len, kept, pos = s.alen(r), z3.And(on, z3.Not(u.skip)), seq - 2
        facts.append(z3.Implies(on, z3.And(a_len > 0, seq >= 2)))
        facts.append(z3.Implies(kept, z3.And(pos <= a_len, z3.Implies(paged, ceil_p_term(pos + 1, s.P) <= s.width))))
        k = z3.If(kept, host_new_pages_term(a_len, pos, 1, s.P), 0)
        grows = z3.And(kept, pos == a_len)  # pre-#23606: the scatter appends one slot
        taken_pages.append(k)
        fresh.append(z3.If(grows, 1, 0))
        by_page, by_slot = u.alen.plus(Count.whole(k), s.P), u.alen.plus(Count.of(z3.If(grows, 1, 0), s.P), s.P)
        alen = Count(z3.If(paged, by_page.pages, by_slot.pages), z3.If(paged, by_page.extra, by_slot.extra))
        extends = z3.And(kept, pos == u.filled)
        filled = z3.If(extends, z3.And(v.filled >= u.filled + 1, v.filled <= alen.slots(s.P)), v.filled == u.filled)
        skip = z3.And(u.skip, z3.Not(on)) if clears_skip else u.skip
        facts += [v.alen.same(alen), v.skip == skip, filled]
    pages, slots = Count.whole(z3.Sum(taken_pages)), Count.of(z3.Sum(fresh), s.P)
    taken = Count(z3.If(paged, pages.pages, slots.pages), z3.If(paged, pages.extra, slots.extra))
    rule = z3.Implies(z3.Not(paged), z3.Sum(fresh) % s.P == 0)
    return z3.And(*facts, rule, taken.slots(s.P) <= s.avail, *_pool(s, t, taken))


def allocated_host_indices(s: State, a: Action, t: State, *, compressed_len: bool = False
                           ) -> z3.BoolRef:
    """The read ``allocated_host_indices(req)`` (§4.4): ``count`` = the row's valid slots; no state change.

    ``compressed_len=True`` is a broken twin: the pre-#23606 release read of the written length.
    """
    count = _at(s, a.req, (lambda r: s.rows[r].filled) if compressed_len else s.alen)
    return z3.And(_valid_req(s, a.req), a.count == count, *_pool(s, t),
                  *(_same_row(u, v) for u, v in zip(s.rows, t.rows, strict=True)))


def get_host_data(s: State, a: Action, t: State) -> z3.BoolRef:
    """The read ``get_host_data(slots)``: slots some row owns; a read within every row's written prefix returns
    no ``None`` (``count``: the ``None`` values); no state change."""
    owned = [z3.And(x >= 0, x <= s.alen(r)) for r, x in enumerate(a.upto)]
    within = z3.And([x <= r.filled for x, r in zip(a.upto, s.rows, strict=True)])
    return z3.And(*owned, a.count >= 0, z3.Implies(within, a.count == 0), *_pool(s, t),
                  *(_same_row(u, v) for u, v in zip(s.rows, t.rows, strict=True)))


def init(s: State) -> z3.BoolRef:
    """``initial_state``: ``num_pages * P`` slots all free (``from_requested_size`` rounds the requested size
    to whole pages), every row empty, no flag; the ``PAGED`` coordinator (#23606)."""
    rows = [z3.And(r.alen.pages == 0, r.alen.extra == 0, z3.Not(r.skip), r.filled == 0) for r in s.rows]
    return z3.And(s.P >= 1, s.M >= 1, s.num_pages >= 1, s.paged, s.free.pages == s.num_pages, s.free.extra == 0,
                  s.loose.pages == 0, s.loose.extra == 0, *rows)


def invariant_clauses(s: State) -> list[tuple[str, z3.BoolRef]]:
    """H0-H3 of §4.6 on slot counts, and the data clause, for the ``PAGED`` coordinator (#23606).

    H0: the free list and the slots direct ``alloc`` calls hold are whole pages. H1: each row's
    allocated length is whole pages, at most the row width. H2: free + held by no row + rows == the
    pool. H3: an empty row has no skip flag and no data. Data: the written prefix lies in the row.
    """
    counts = [s.free, s.loose, *(r.alen for r in s.rows)]
    clauses = [("constants: P >= 1, max_context_len >= 1, the #23606 coordinator",
                z3.And(s.P >= 1, s.M >= 1, s.num_pages >= 0, s.paged)),
               ("counts: pages >= 0, 0 <= extra slots < P", z3.And([c.well_formed(s.P) for c in counts])),
               ("H0: free slots and slots held by no row are whole pages",
                z3.And(s.free.extra == 0, s.loose.extra == 0)),
               ("H2: free + held by no row + rows == the pool",
                s.avail + s.loose.slots(s.P) + z3.Sum([s.alen(r) for r in range(len(s.rows))]) == s.num_pages * s.P)]
    for i, r in enumerate(s.rows):
        clauses += [(f"H1: row {i} is whole pages within the row width",
                     z3.And(r.alen.extra == 0, s.alen(i) <= s.width)),
                    (f"H3: empty row {i} has no skip flag and no data",
                     z3.Implies(r.alen.pages == 0, z3.And(z3.Not(r.skip), r.filled == 0))),
                    (f"data: row {i}'s written prefix lies in the row", z3.And(r.filled >= 0, r.filled <= s.alen(i)))]
    return clauses


# ---- rendering ------------------------------------------------------------------------------------------


def columns(n: int = R_SLOTS) -> tuple[str, ...]:
    return ("P pages M", "free", "held by no row", *(f"row {r}" for r in range(n)))


def cells(m: z3.ModelRef, s: State) -> tuple[str, ...]:
    """A state's row: the constants, free slots, slots held by no row, each row as
    ``alloc_len A written F [skip]`` (slot counts; ``+e`` marks extra slots past whole pages)."""
    p = as_int(m, s.P)

    def slots(c: Count) -> str:
        pages, extra = as_int(m, c.pages), as_int(m, c.extra)
        return f"{pages * p + extra}" + (f" ({pages}*{p}+{extra})" if extra else "")

    def row(r: Row) -> str:
        if not (as_int(m, r.alen.pages) or as_int(m, r.alen.extra) or as_int(m, r.filled) or as_bool(m, r.skip)):
            return ""
        return f"alloc_len {slots(r.alen)} written {as_int(m, r.filled)}" + (" skip" if as_bool(m, r.skip) else "")

    coordinator = "" if as_bool(m, s.paged) else " pre-#23606"
    return (f"P={p} {as_int(m, s.num_pages)} pages M={as_int(m, s.M)}{coordinator}", slots(s.free), slots(s.loose),
            *(row(r) for r in s.rows))


def describe(m: z3.ModelRef, step: _ts.Step[State, Action]) -> str:
    """The call of a step: ``alloc_paged_token_slots(req 0, start 4, n 1)``, ``eager_backup_previous_token(
    row 0 seq_len 6)``."""
    op, a = step.op_name(m), step.action
    req = f"req {as_int(m, a.req)}"
    if op in ("alloc", "alloc_page"):
        return f"{op}({'need_size' if op == 'alloc' else 'k'} {as_int(m, a.n)})"
    if op == "alloc_paged_token_slots":
        return f"{op}({req}, start {as_int(m, a.start)}, n {as_int(m, a.n)})"
    if op == "admit_request_into_staging":
        return f"{op}({req}, {as_int(m, a.n)} values)"
    if op == "request_finished":
        return f"{op}({req})"
    if op == "allocated_host_indices":
        return f"{op}({req}) -> {as_int(m, a.count)} slots"
    if op == "eager_backup_previous_token":
        entries = [f"row {r} seq_len {as_int(m, q)}" for r, (on, q) in enumerate(zip(a.batch, a.seq, strict=True))
                   if as_bool(m, on)]
        return f"{op}({', '.join(entries)})"
    touched = ", ".join(f"row {r} [0, {as_int(m, x)})" for r, x in enumerate(a.upto) if as_int(m, x))
    return f"{op}({touched})" + (f" -> {as_int(m, a.count)} None" if op == "get_host_data" else "")


def system(n: int = R_SLOTS) -> _ts.TransitionSystem[State, Action]:
    """The model with ``n`` request slots (every relation is written for any ``n``)."""
    return _ts.TransitionSystem(
        component=COMPONENT, state=functools.partial(State.fresh, n=n),
        action=functools.partial(Action.fresh, n=n), init=init,
        transitions={"alloc": alloc, "alloc_page": alloc_page, "alloc_paged_token_slots": alloc_paged_token_slots,
                     "request_finished": request_finished, "set_host_data": set_host_data,
                     "admit_request_into_staging": admit_request_into_staging,
                     "eager_backup_previous_token": eager_backup_previous_token,
                     "allocated_host_indices": allocated_host_indices, "get_host_data": get_host_data},
        invariant=invariant_clauses, columns=columns(n), cells=cells, describe=describe)


SYSTEM: _ts.TransitionSystem[State, Action] = system()
"""Every operation of ``kvproof.reference.hisparse_host`` (the reads included), by its name, over two rows."""


# ---- obligations over the transitions --------------------------------------------------------------


def _init_requested_size(s: State) -> z3.BoolRef:
    """Twin: the free list ``arange(size)`` for the requested size, not rounded to whole pages (§4.2)."""
    size = z3.Int("requested_size")
    rows = [z3.And(r.alen.pages == 0, r.alen.extra == 0, z3.Not(r.skip), r.filled == 0) for r in s.rows]
    return z3.And(s.P >= 1, s.M >= 1, size >= 1, s.num_pages == size / s.P, s.paged, s.free.is_(size, s.P),
                  s.loose.pages == 0, s.loose.extra == 0, *rows)


def _consecution_at(system: _ts.TransitionSystem[State, Action], op: str,
                    narrow: Callable[[State], Sequence[z3.BoolRef]]) -> _ts.Check:
    """Consecution through ``op`` from invariant states that also satisfy ``narrow`` (a twin's search)."""

    def build() -> list[z3.BoolRef]:
        step = _ts.Step.fresh(system)
        return [system.holds(step.pre), *narrow(step.pre), step.relation([op]), z3.Not(system.holds(step.post))]

    def render(m: z3.ModelRef) -> str:
        step = _ts.Step.fresh(system)
        return _ts.step_table(system, m, step, f"broken after step 1: {_ts.first_broken(system, m, step.post)}")

    return _ts.Check(build, render)


def _whole_pages_read(system: _ts.TransitionSystem[State, Action]) -> _ts.Check:
    """From an invariant state, ``allocated_host_indices`` returns whole pages (what ``request_finished`` frees)."""
    def safe(step: _ts.Step[State, Action]) -> z3.BoolRef:
        s, a = step.pre, step.action
        return a.count == _at(s, a.req, lambda r: s.rows[r].alen.pages) * s.P

    def explain(m: z3.ModelRef, step: _ts.Step[State, Action]) -> str:
        p, count = as_int(m, step.pre.P), as_int(m, step.action.count)
        return (f"the read returns {count} = {count // p}*{p} + {count % p} slots: freeing them returns a partial "
                f"page to the free list (H0)")

    return _ts.safety(system, safe, explain, ["allocated_host_indices"])


def _prefix_protocol(s: State, a: Action, *, after: bool) -> z3.BoolRef:
    """H4 on data for the batch entries at ``seq_len`` (``after``: at the next call's ``seq_len + 1``): every
    position before the previous token is backed up, and a flagged row (skipped once) has the previous token
    too."""
    out = []
    for r, on, seq in zip(s.rows, a.batch, a.seq, strict=True):
        nxt = seq + 1 if after else seq
        out.append(z3.Implies(on, z3.And(r.filled >= nxt - 2, z3.Implies(r.skip, r.filled >= nxt - 1))))
    return z3.And(out)


def _backs_up_prefix(system: _ts.TransitionSystem[State, Action]) -> _ts.Check:
    """``eager_backup_previous_token`` keeps :func:`_prefix_protocol` from one call to the next."""

    def build() -> list[z3.BoolRef]:
        step = _ts.Step.fresh(system)
        s, a = step.pre, step.action
        return [system.holds(s), _prefix_protocol(s, a, after=False), step.relation(["eager_backup_previous_token"]),
                z3.Not(_prefix_protocol(step.post, a, after=True))]

    def render(m: z3.ModelRef) -> str:
        step = _ts.Step.fresh(system)
        lost = [f"row {r}: the call at seq_len {as_int(m, q) + 1} finds positions [0, {as_int(m, v.filled)}) "
                f"backed up, position {as_int(m, q) - 1} never"
                for r, (v, on, q) in enumerate(zip(step.post.rows, step.action.batch, step.action.seq, strict=True))
                if as_bool(m, on) and not as_bool(m, _prefix_protocol(step.post, step.action, after=True))]
        return _ts.step_table(system, m, step, "; ".join(lost) or "prefix lost")

    return _ts.Check(build, render)


def _reads_staged(system: _ts.TransitionSystem[State, Action]) -> _ts.Check:
    """From an invariant state, stage ``n`` values into a row, then read its positions ``[0, n)``: no ``None``."""

    def build() -> list[z3.BoolRef]:
        u = _ts.Unrolling.fresh(system, 2)
        stage, read = u.step(0), u.step(1)
        s1, a0, a1 = stage.post, stage.action, read.action
        ranges = [x == z3.If(a0.req == r, a0.n, 0) for r, x in enumerate(a1.upto)]
        return [system.holds(stage.pre), stage.relation(["admit_request_into_staging"]),
                read.relation(["get_host_data"]), *ranges, s1.P >= 1, a1.count != 0]

    def render(m: z3.ModelRef) -> str:
        u = _ts.Unrolling.fresh(system, 2)
        rows = (_ts.TraceRow(0, "any", "(any invariant state)", system.cells(m, u.states[0])),
                *(_ts.TraceRow(i + 1, st.op_name(m), system.describe(m, st), system.cells(m, st.post))
                  for i, st in enumerate(u.steps())))
        return _ts.Trace(system.columns, rows, f"the read returns {as_int(m, u.actions[1].count)} None values "
                                               f"for staged positions").table()

    return _ts.Check(build, render)


def _transition_obligations() -> tuple[Obligation, ...]:
    def ob(suffix: str, statement: str, check: _ts.Check, twin_of: str | None = None) -> Obligation:
        return _ts.obligation(SYSTEM, suffix, statement, check, family=FAMILY, twin_of=twin_of)

    def keeps(op: str, statement: str, twin: str, twin_statement: str, broken: Callable[..., z3.BoolRef]
              ) -> tuple[Obligation, Obligation]:
        return (ob(f"{op}.keeps_pool", statement, _ts.consecution(SYSTEM, [op])),
                ob(f"{op}.keeps_pool.{twin}", twin_statement,
                   _ts.consecution(SYSTEM.with_transitions(**{op: broken}), [op]), f"{op}.keeps_pool"))

    return (
        ob("pool.initiation", "the initial pool (size whole pages, all free, every row empty) satisfies H0-H3",
           _ts.initiation(SYSTEM)),
        ob("pool.initiation.requested_size",
           "a pool sized by the requested slot count (without HostKVCache's rounding to whole pages) starts with a "
           "partial page on its free list",
           _ts.initiation(dataclasses.replace(SYSTEM, init=_init_requested_size)), "pool.initiation"),
        *keeps("alloc", "alloc (whole pages, from the free list, all or nothing) keeps H0-H3",
               "no_page_rule", "a token-granular alloc(n) (the pre-#23606 coordinator's, §4.7) leaves a partial page "
               "at the head of the free list", functools.partial(alloc, page_rule=False)),
        *keeps("alloc_page", "alloc_page(k) takes k whole pages and keeps H0-H3",
               "k_slots", "an alloc_page(k) that takes k slots instead of k pages leaves a partial page (H0)",
               functools.partial(alloc_page, whole_pages=False)),
        *keeps("alloc_paged_token_slots",
               "alloc_paged_token_slots (start <= a, the rounded end within the row, host_new_pages whole pages) keeps "
               "H0-H3 and the row's written prefix",
               "no_max",
               "setting the row to ceil_P(end) without max(a, .) shrinks it: its slots past the end leak (H2)",
               functools.partial(alloc_paged_token_slots, keeps_held=False)),
        *keeps("request_finished", "request_finished frees the whole row, resets it and its flag, and keeps H0-H3",
               "skip_flag_kept", "a release that keeps the skip-first-backup flag leaves an empty row flagged (H3)",
               functools.partial(request_finished, clears_skip=False)),
        *keeps("set_host_data", "set_host_data into owned slots moves no slot and keeps H0-H3 and the data clause",
               "unowned_slots", "without the ownership check a copy writes row positions past the allocated length "
                                "(slots the row does not own)",
               functools.partial(set_host_data, owned_only=False)),
        *keeps("admit_request_into_staging",
               "staging n values into an empty row (ceil_P(n) slots under #23606) keeps H0-H3",
               "token_granular", "staging that takes exactly n slots (no round-up, no page rule) leaves partial pages "
               "(H0, H1)", functools.partial(admit_request_into_staging, rounds_up=False)),
        ob("eager_backup_previous_token.keeps_pool",
           "an eager backup batch (skip once, positions seq_len - 2 <= alloc_len, whole pages, all or nothing) keeps "
           "H0-H3", _ts.consecution(SYSTEM, ["eager_backup_previous_token"])),
        ob("eager_backup_previous_token.keeps_pool.pre_23606",
           "the pre-#23606 coordinator's backup (one alloc for the batch, one slot per extended row) breaks H1 at "
           "P_h > 1 (§4.7; search narrowed to P >= 2)",
           _consecution_at(SYSTEM.with_transitions(eager_backup_previous_token=functools.partial(
               eager_backup_previous_token, pre_23606=True)), "eager_backup_previous_token", lambda s: [s.P >= 2]),
           "eager_backup_previous_token.keeps_pool"),
        ob("eager_backup_previous_token.backs_up_prefix",
           "H4 on data: if every position before a batch entry's previous token is backed up (and a flagged row's "
           "previous token too), the same holds at the next call's seq_len + 1",
           _backs_up_prefix(SYSTEM)),
        ob("eager_backup_previous_token.backs_up_prefix.skip_flag_kept",
           "a backup that never clears the skip-first-backup flag skips the row again: the position after the staged "
           "prefix is never backed up",
           _backs_up_prefix(SYSTEM.with_transitions(eager_backup_previous_token=functools.partial(
               eager_backup_previous_token, clears_skip=False))),
           "eager_backup_previous_token.backs_up_prefix"),
        ob("allocated_host_indices.whole_pages",
           "from any H0-H3 state allocated_host_indices returns whole pages (what request_finished gives back)",
           _whole_pages_read(SYSTEM)),
        ob("allocated_host_indices.whole_pages.compressed_len",
           "the pre-#23606 release read of the row up to compressed_len (the written length) returns a partial page",
           _whole_pages_read(SYSTEM.with_transitions(allocated_host_indices=functools.partial(
               allocated_host_indices, compressed_len=True))),
           "allocated_host_indices.whole_pages"),
        ob("get_host_data.reads_staged_values",
           "from any H0-H3 state, after staging n values into a row, get_host_data of its positions [0, n) returns "
           "no None",
           _reads_staged(SYSTEM)),
        ob("get_host_data.reads_staged_values.before_copy_completes",
           "a read of the staged positions before the staging copy completes (the request must wait for its event, "
           "§4.5) can return None",
           _reads_staged(SYSTEM.with_transitions(admit_request_into_staging=functools.partial(
               admit_request_into_staging, copies=False))),
           "get_host_data.reads_staged_values"),
    )


# ---- registry ---------------------------------------------------------------------------------


def _obligations() -> tuple[Obligation, ...]:
    return (
        _obligation(
            "alloc_paged_token_slots.div_shift",
            "for P >= 1 and integers x, w: (x + w*P) div P == x div P + w and (w*P) div P == w (instances are "
            "hypotheses of alloc_paged_token_slots.new_pages_count)",
            _shift_build(True), _shift_render,
        ),
        _obligation(
            "alloc_paged_token_slots.div_shift.any_addend",
            "the shift does not generalise to addends that are not multiples of P: (x + w) div P != x div P + "
            "w div P",
            _shift_build(False), _shift_render, expect="counterexample", twin_of="alloc_paged_token_slots.div_shift",
        ),
        _obligation(
            "alloc_paged_token_slots.allocated_len_multiple",
            "H1: for P >= 1, a = j*P, start >= 0, n >= 1: allocated_len_after(a, start, n) = max(a, ceil_P(start + "
            "n)) is k*P for k = j or ceil((start + n)/P)",
            _multiple_build(sound_after, _sound_pages_witness), _multiple_render(sound_after),
        ),
        _obligation(
            "alloc_paged_token_slots.allocated_len_multiple.no_round_up",
            "growing the row to max(a, end) (no round-up to a page) breaks H1",
            _multiple_build(after_no_round_up, None), _multiple_render(after_no_round_up),
            expect="counterexample", twin_of="alloc_paged_token_slots.allocated_len_multiple",
        ),
        _obligation(
            "alloc_paged_token_slots.covers_request",
            "after alloc_paged_token_slots(start, n) the allocated length is >= start + n (every requested position "
            "has a host slot) and >= a (the row never shrinks)",
            _covers_build(sound_after), _covers_render(sound_after),
        ),
        _obligation(
            "alloc_paged_token_slots.covers_request.floor_end",
            "rounding the end down (max(a, floor_P(end))) leaves the last requested positions without host slots",
            _covers_build(after_floor_end), _covers_render(after_floor_end),
            expect="counterexample", twin_of="alloc_paged_token_slots.covers_request",
        ),
        _obligation(
            "alloc_paged_token_slots.covers_request.no_max",
            "setting the length to ceil_P(end) without max(a, .) shrinks the row on a call inside it",
            _covers_build(after_no_max), _covers_render(after_no_max),
            expect="counterexample", twin_of="alloc_paged_token_slots.covers_request",
        ),
        _obligation(
            "alloc_paged_token_slots.new_pages_count",
            "host_new_pages = (allocated_len_after - a) div P equals ceil((end - a)/P) when end > a and 0 when "
            "end <= a",
            _pages_build(sound_pages), _pages_render(sound_pages),
        ),
        _obligation(
            "alloc_paged_token_slots.new_pages_count.from_n",
            "ceil(n/P) new pages (sized from the request, not from end - a) over-allocates when start < a",
            _pages_build(pages_from_n), _pages_render(pages_from_n),
            expect="counterexample", twin_of="alloc_paged_token_slots.new_pages_count",
        ),
        _obligation(
            "alloc_paged_token_slots.new_pages_count.floor",
            "floor((end - a)/P) new pages misses the last, partial page",
            _pages_build(pages_floor), _pages_render(pages_floor),
            expect="counterexample", twin_of="alloc_paged_token_slots.new_pages_count",
        ),
        _obligation(
            "alloc_paged_token_slots.slots_distinct_in_own_pages_in_order",
            "H1/H2: with pairwise distinct non-negative host pages per row, slot(pos) = page(pos div P)*P + pos mod P "
            "gives requested positions x < y distinct slots, each in the host page of its block, increasing within "
            "a page",
            _slots_build(host_slot_term, True), _slots_render(host_slot_term),
        ),
        _obligation(
            "alloc_paged_token_slots.slots_distinct_in_own_pages_in_order.position_offset",
            "slot = page(b)*P + pos (the position instead of its offset) leaves the block's host page",
            _slots_build(slot_pos_offset, True), _slots_render(slot_pos_offset),
            expect="counterexample", twin_of="alloc_paged_token_slots.slots_distinct_in_own_pages_in_order",
        ),
        _obligation(
            "alloc_paged_token_slots.slots_distinct_in_own_pages_in_order.page_plus_offset",
            "slot = page(b) + pos mod P (a page index used as a slot) gives two positions one slot",
            _slots_build(slot_page_plus_offset, True), _slots_render(slot_page_plus_offset),
            expect="counterexample", twin_of="alloc_paged_token_slots.slots_distinct_in_own_pages_in_order",
        ),
        _obligation(
            "alloc_paged_token_slots.slots_distinct_in_own_pages_in_order.repeated_pages",
            "a row whose host pages repeat (a stale alloc_len reusing the previous owner's pages, H3) gives two "
            "positions one slot",
            _slots_build(host_slot_term, False), _slots_render(host_slot_term),
            expect="counterexample", twin_of="alloc_paged_token_slots.slots_distinct_in_own_pages_in_order",
        ),
        _obligation(
            "alloc_paged_token_slots.no_hole",
            "H4: with start <= a (upstream's assert), every page the call allocates (blocks a/P .. alloc_len/P - 1) "
            "holds at least one requested position start <= pos < end",
            _no_hole_build(True), _no_hole_render,
        ),
        _obligation(
            "alloc_paged_token_slots.no_hole.precondition_dropped",
            "without start <= a (e.g. S7's start = 2000 with alloc_len 1088) the call reserves pages that hold no "
            "requested position (search narrowed to P >= 2)",
            _no_hole_build(False), _no_hole_render, expect="counterexample", twin_of="alloc_paged_token_slots.no_hole",
        ),
        _obligation(
            "alloc_paged_token_slots.row_width_fits",
            "for end = start + n <= max_context_len: ceil_P(end) <= max_context_len + P, the width of a "
            "req_to_host_pool row",
            _fits_build(row_width_term), _fits_render(row_width_term),
        ),
        _obligation(
            "alloc_paged_token_slots.row_width_fits.no_padding",
            "rows of width max_context_len (without the + P padding) overflow when the rounded end passes it",
            _fits_build(_no_padding), _fits_render(_no_padding), expect="counterexample",
            twin_of="alloc_paged_token_slots.row_width_fits",
        ),
        _obligation(
            "alloc_paged_token_slots.row_width_exact",
            "for P >= 1, width >= 0, end >= 0: ceil_P(end) <= width <=> end <= floor_P(width) (the exact "
            "precondition of a call)",
            _exact_build(floor_p_term), _exact_render(floor_p_term),
        ),
        _obligation(
            "alloc_paged_token_slots.row_width_exact.end_within_width",
            "end <= width is not the precondition: the rounded end can still pass the width",
            _exact_build(lambda w, p: w), _exact_render(lambda w, p: w),
            expect="counterexample", twin_of="alloc_paged_token_slots.row_width_exact",
        ),
        _obligation(
            "request_finished.release_restores_pool",
            "H2/H3: request_finished frees alloc_len slots and resets the row: available + sum(alloc_len) == size "
            "is kept (two requests) and available stays whole pages",
            _release_build(False), _release_render(False),
        ),
        _obligation(
            "request_finished.release_restores_pool.pre_23606_compressed_len",
            "the pre-#23606 release frees the row's first compressed_len slots (compressed_len <= alloc_len) and "
            "leaks the rest",
            _release_build(True), _release_render(True), expect="counterexample",
            twin_of="request_finished.release_restores_pool",
        ),
        _obligation(
            "eager_backup_previous_token.backup_within_allocated",
            "H4 by induction: after staging n tokens (alloc_len ceil_P(n) >= P) and the skipped first backup, "
            "alloc_len >= seq_len - 2 holds; then each backup of position seq_len - 2 has start <= alloc_len and "
            "leaves alloc_len >= (seq_len + 1) - 2, a multiple of P",
            _backup_build(sound_backup), _backup_render(sound_backup),
        ),
        _obligation(
            "eager_backup_previous_token.backup_within_allocated.no_page_extension",
            "a backup that never extends the row by a page leaves the next position past alloc_len (a hole)",
            _backup_build(backup_no_extension), _backup_render(backup_no_extension),
            expect="counterexample", twin_of="eager_backup_previous_token.backup_within_allocated",
        ),
        _obligation(
            "eager_backup_previous_token.backup_within_allocated.end_at_start",
            "rounding the page end from start instead of start + 1 does not extend the row at a page boundary",
            _backup_build(backup_end_at_start), _backup_render(backup_end_at_start),
            expect="counterexample", twin_of="eager_backup_previous_token.backup_within_allocated",
        ),
        _obligation(
            "admit_request_into_staging.s7_vector",
            "S7 at P=64: staging 1000 tokens takes 16 pages (alloc_len 1024), backups of positions 1000-1023 none, "
            "position 1024 one (alloc_len 1088), release frees 17 pages; start=2000 would reserve page 17 for "
            "no requested position",
            _s7_build, _s7_render,
        ),
        _obligation(
            "admit_request_into_staging.s7_vector.pre_23606_token_alloc",
            "the pre-#23606 coordinator's token-granular staging alloc(1000) and backup alloc(3) at P_h = 64 break "
            "the page rule",
            _s7_pre_build, _s7_pre_render, expect="counterexample", twin_of="admit_request_into_staging.s7_vector",
        ),
    )


OBLIGATIONS: tuple[Obligation, ...] = _obligations() + _transition_obligations()
