"""``hisparse_host``: HiSparse paged host pool rows (PR #23606; sglang_semantics.md §4.4, §4.6 H0-H4, §9 S7).

Z3 terms mirroring the arithmetic of ``kvproof.reference.hisparse_host``
(:func:`row_width_term`, :func:`allocated_len_after_term`, :func:`host_new_pages_term`,
:func:`host_slot_term`) over symbolic integers: ``alloc_paged_token_slots(r, start, n)``
of §4.4 with host page size ``P >= 1``, a row holding ``a = j * P`` slots before the call
(H1), ``start >= 0``, ``n >= 1``, ``end = start + n``; the coordinator's call sites of
§4.5 (staging, ``_eager_backup_previous_token``, ``request_finished``). The host pages of
a row are an uninterpreted function ``page: block -> host page``.
``tests/spec/test_hisparse_host.py`` evaluates the builders on concrete integers and
compares them with the reference (drift test), and replays S7 through it.

Obligations (each sound one has broken twins that Z3 refutes with concrete numbers):

* ``alloc_paged_token_slots.div_shift`` (lemma): ``(x + w*P) div P == x div P + w`` and ``(w*P) div P == w`` for
  ``P >= 1``; its instances are hypotheses of ``alloc_paged_token_slots.new_pages_count`` (Z3's non-linear
  division reasoning times out on the composed query, not on the lemma);
* ``alloc_paged_token_slots.allocated_len_multiple`` (H1): the allocated length after the call is a multiple of
  ``P`` (written ``k * P`` with the explicit page count ``k``);
* ``alloc_paged_token_slots.covers_request``: after the call every requested position has a host slot
  (``alloc_len >= end``) and the row never shrinks (``>= a``);
* ``alloc_paged_token_slots.new_pages_count``: the call takes ``ceil((end - a)/P)`` pages when ``end > a`` and
  none otherwise;
* ``alloc_paged_token_slots.slots_distinct_in_own_pages_in_order`` (H1, H2): with pairwise distinct host pages
  per row, ``slot(pos) = page(pos div P)*P + pos mod P`` gives distinct slots to
  distinct positions, lies in the page of its block, and increases with the position
  within one page;
* ``alloc_paged_token_slots.no_hole`` (H4): with ``start <= a`` (upstream's assert) every newly allocated page
  holds a requested position; without it (S7's ``start = 2000``) pages are reserved
  for positions nobody asked for;
* ``alloc_paged_token_slots.row_width_fits`` / ``alloc_paged_token_slots.row_width_exact`` (§4.3): ``ceil_P(end) <= max_context_len + P``
  whenever ``end <= max_context_len``, and ``ceil_P(end) <= W <=> end <= floor_P(W)``;
* ``request_finished.release_restores_pool`` (H2, H3): ``request_finished`` frees the whole allocated
  length and keeps ``available + sum(alloc_len) == size`` in whole pages; the
  pre-#23606 release of ``compressed_len`` slots leaks;
* ``eager_backup_previous_token.backup_within_allocated`` (H4, by induction): after staging ``n`` tokens and the
  skipped first backup, every eager backup of position ``seq_len - 2`` starts at most
  at the allocated length, and the invariant ``alloc_len >= seq_len - 2`` (a multiple
  of ``P``) holds again for ``seq_len + 1``;
* ``admit_request_into_staging.s7_vector``: S7's numbers at ``P = 64``: staging 1 000 tokens takes 16 pages
  (``alloc_len = 1024``), backups of positions 1 000-1 023 none, position 1 024 one
  (``alloc_len = 1088``), the release frees 17 pages; ``start = 2000`` would leave
  reserved pages with no requested position (the hole the assert forbids). Its twin
  is the pre-#23606 coordinator's token-granular ``alloc(1000)`` / ``alloc(3)`` at
  ``P_h = 64``, which breaks the page rule (§4.7).

Queries are quantifier-free; page-aligned values are products ``k * P`` with an explicit
witness ``k`` (see ``terms.part2_pages_term``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import z3

from kvproof.spec._solver import Obligation, as_int
from kvproof.spec.terms import IntLike, ceil_div_term, ceil_p_term, floor_p_term, lift, zmax

__all__ = [
    "OBLIGATIONS",
    "row_width_term",
    "allocated_len_after_term",
    "allocated_pages_after_term",
    "host_new_pages_term",
    "host_slot_term",
    "row_pages",
    "div_shift_facts",
    "CallVars",
    "S7",
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
        return SlotVars(*z3.Ints("P start n x y"), z3.Function("page", z3.IntSort(), z3.IntSort()))

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
    return z3.Ints("P free_pages j1 j2 size compressed_len")


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
    return z3.Ints("P n k s")


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
            _fits_build(_no_padding), _fits_render(_no_padding), expect="counterexample", twin_of="alloc_paged_token_slots.row_width_fits",
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
            _release_build(True), _release_render(True), expect="counterexample", twin_of="request_finished.release_restores_pool",
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


OBLIGATIONS: tuple[Obligation, ...] = _obligations()
