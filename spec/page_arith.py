"""Page-count arithmetic of the paged allocator (sglang_semantics.md §1.3, §7 G4).

For symbolic integers ``0 <= p <= s`` (prefix and sequence length) and ``P >= 1``,
using the three parts of ``alloc_extend`` exactly as ``reference.arith.extend_parts``
computes them (``terms.extend_parts_terms``):

* the parts add up to the extend length and have the right shapes;
* the kernel takes exactly ``get_num_new_pages = ceil(s/P) - ceil(p/P)`` pages, for
  one request and additively for a batch of two (so a batch consumes exactly that
  prefix of ``free_pages``, G4);
* part 1 stays inside the page of token ``p - 1`` and the new pages start on a
  page boundary;
* ``alloc_decode`` of token ``s - 1`` takes a page iff ``(s - 1) mod P == 0``.

Broken twins: the "extend length over P" page count, no ``min(s, .)`` clamp on
part 1, no early return after part 1, part 1 running to the *next* boundary, the
decode tests ``s mod P == 0`` and ``s mod P == 1`` (the latter wrong for ``P = 1``),
and a batch estimate from the total extend length.

Obligations are named after the op: ``swa_allocator.alloc_extend.*``,
``swa_allocator.alloc_decode.*``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import z3

from kvproof.spec._solver import Expect, Obligation, as_bool, as_int
from kvproof.spec.terms import (
    ceil_div_term,
    ceil_p_term,
    decode_opens_page_term,
    extend_parts_terms,
    floor_p_term,
    is_multiple_term,
    new_pages_of_parts,
    num_new_pages_term,
    part2_pages_term,
    zmin,
)

__all__ = ["OBLIGATIONS", "ExtendVars", "Parts"]

COMPONENT = "swa_allocator"
FAMILY = "page_arith"

Parts = tuple[z3.ArithRef, z3.ArithRef, z3.ArithRef]
PartsFormula = Callable[[z3.ArithRef, z3.ArithRef, z3.ArithRef], Parts]


@dataclass(frozen=True)
class ExtendVars:
    """One request extending from prefix ``p`` to ``s`` tokens with page size ``P``."""

    p: z3.ArithRef
    s: z3.ArithRef
    P: z3.ArithRef

    @staticmethod
    def fresh(tag: str = "") -> ExtendVars:
        return ExtendVars(z3.Int(f"p{tag}"), z3.Int(f"s{tag}"), z3.Int("P"))

    def hypotheses(self) -> list[z3.BoolRef]:
        return [self.p >= 0, self.p <= self.s, self.P >= 1]

    def values(self, model: z3.ModelRef) -> tuple[int, int, int]:
        return as_int(model, self.p), as_int(model, self.s), as_int(model, self.P)


# ---- extend_parts and its wrong variants ----------------------------------------------


def sound_parts(p: z3.ArithRef, s: z3.ArithRef, P: z3.ArithRef) -> Parts:
    """The reference's ``extend_parts`` (§1.3 parts 1/2/3)."""
    return extend_parts_terms(p, s, P)


def parts_without_early_return(p: z3.ArithRef, s: z3.ArithRef, P: z3.ArithRef) -> Parts:
    """Wrong: parts 2 and 3 computed even when part 1 already completes the request."""
    n1 = zmin(s, ceil_p_term(p, P)) - p
    return n1, floor_p_term(s, P) - ceil_p_term(p, P), s - floor_p_term(s, P)


def parts_without_clamp(p: z3.ArithRef, s: z3.ArithRef, P: z3.ArithRef) -> Parts:
    """Wrong: part 1 fills the partial page without the ``min(s, .)`` clamp."""
    n1 = ceil_p_term(p, P) - p
    done = p + n1 == s
    return n1, z3.If(done, 0, floor_p_term(s, P) - ceil_p_term(p, P)), z3.If(done, 0, s - floor_p_term(s, P))


def parts_next_boundary(p: z3.ArithRef, s: z3.ArithRef, P: z3.ArithRef) -> Parts:
    """Wrong: part 1 runs to the next boundary ``floor_P(p) + P`` even when ``p`` is aligned."""
    boundary = floor_p_term(p, P) + P
    n1 = zmin(s, boundary) - p
    done = p + n1 == s
    return n1, z3.If(done, 0, floor_p_term(s, P) - boundary), z3.If(done, 0, s - floor_p_term(s, P))


def _cdiv(n: int, d: int) -> int:
    return -(-n // d)


@dataclass(frozen=True)
class PartsValues:
    """Concrete ``p, s, P`` and the parts a formula gives for them."""

    p: int
    s: int
    P: int
    n1: int
    n2: int
    n3: int

    @property
    def pages(self) -> int:
        """Pages the kernel takes: ``n2 // P + [n3 > 0]``."""
        return self.n2 // self.P + (1 if self.n3 > 0 else 0)

    @property
    def needed(self) -> int:
        """``get_num_new_pages``: ``ceil(s/P) - ceil(p/P)``."""
        return _cdiv(self.s, self.P) - _cdiv(self.p, self.P)

    def __str__(self) -> str:
        return f"p={self.p} s={self.s} P={self.P} -> n1={self.n1} n2={self.n2} n3={self.n3}"


def _parts_values(model: z3.ModelRef, v: ExtendVars, parts: PartsFormula) -> PartsValues:
    n1, n2, n3 = (as_int(model, n) for n in parts(v.p, v.s, v.P))
    return PartsValues(*v.values(model), n1, n2, n3)


# ---- goals over one request, each with how its violation reads ------------------------


def parts_sum(v: ExtendVars, n: Parts) -> z3.BoolRef:
    return n[0] + n[1] + n[2] == v.s - v.p


def explain_parts_sum(x: PartsValues) -> str:
    return f"n1+n2+n3={x.n1 + x.n2 + x.n3} != s-p={x.s - x.p}"


def part_shapes(v: ExtendVars, n: Parts) -> z3.BoolRef:
    """n2 is a multiple of P, witnessed by the part-2 page count (robust for every solver seed)."""
    n1, n2, n3 = n
    k = part2_pages_term(v.p, v.s, v.P)
    return z3.And(n1 >= 0, n1 < v.P, n2 >= 0, n2 == k * v.P, n3 >= 0, n3 < v.P)


def explain_part_shapes(x: PartsValues) -> str:
    broken = [
        f"n1={x.n1} not in [0, P)" if not 0 <= x.n1 < x.P else "",
        f"n2={x.n2} < 0" if x.n2 < 0 else "",
        f"n2={x.n2} not a multiple of P" if x.n2 % x.P else "",
        f"n3={x.n3} not in [0, P)" if not 0 <= x.n3 < x.P else "",
    ]
    return ", ".join(text for text in broken if text)


def new_pages(v: ExtendVars, n: Parts) -> z3.BoolRef:
    return new_pages_of_parts(n[1], n[2], v.P) == num_new_pages_term(v.p, v.s, v.P)


def explain_new_pages(x: PartsValues) -> str:
    return f"kernel takes n2/P+[n3>0]={x.pages} pages != get_num_new_pages={x.needed}"


def new_pages_extend_len(v: ExtendVars, n: Parts) -> z3.BoolRef:
    """Wrong claim: the kernel takes ``ceil((s - p) / P)`` pages."""
    return new_pages_of_parts(n[1], n[2], v.P) == ceil_div_term(v.s - v.p, v.P)


def explain_new_pages_extend_len(x: PartsValues) -> str:
    return f"kernel takes {x.pages} pages != ceil((s-p)/P)={_cdiv(x.s - x.p, x.P)}"


def part1_in_last_page(v: ExtendVars, n: Parts) -> z3.BoolRef:
    n1, n2, n3 = n
    continues = z3.Implies(
        n1 > 0, z3.And(v.p >= 1, z3.Not(is_multiple_term(v.p, v.P)), (v.p + n1 - 1) / v.P == (v.p - 1) / v.P)
    )
    fresh_pages_aligned = z3.Implies(n2 + n3 > 0, is_multiple_term(v.p + n1, v.P))
    return z3.And(continues, fresh_pages_aligned)


def explain_part1(x: PartsValues) -> str:
    if x.n1 > 0 and x.p % x.P == 0:
        return f"part 1 writes {x.n1} slot(s) after token p-1={x.p - 1}, whose page is full or absent"
    if x.n1 > 0 and (x.p + x.n1 - 1) // x.P != (x.p - 1) // x.P:
        return f"part 1 positions {x.p}..{x.p + x.n1 - 1} leave the page of token {x.p - 1}"
    return f"the new pages start at position {x.p + x.n1}, not a page boundary"


RequestGoal = Callable[[ExtendVars, Parts], z3.BoolRef]


def _division_facts(v: ExtendVars, n: Parts) -> list[z3.BoolRef]:
    """``P*(x div P) <= x < P*(x div P) + P`` for each quotient the goals use (true for ``P >= 1``).

    Z3 knows these axioms, but stating the instances makes ``swa_allocator.alloc_extend.new_pages``
    independent of its random seed (``tests/spec/test_robustness.py``: seed 1 took 2-10 s
    without them); being true, they cannot hide a counterexample. Other goals do not get
    them: the extra terms slow ``part1_in_last_page`` down to a timeout.
    """
    facts = []
    for x in (v.s, v.s + v.P - 1, v.p + v.P - 1, n[1]):
        q = x / v.P
        facts += [v.P * q <= x, x < v.P * q + v.P]
    return facts


def _request_obligation(
    name: str,
    statement: str,
    goal: RequestGoal,
    explain: Callable[[PartsValues], str],
    *,
    parts: PartsFormula = sound_parts,
    expect: Expect = "proved",
    twin_of: str | None = None,
    division_facts: bool = False,
) -> Obligation:
    """hypotheses(p, s, P) and not goal(parts(p, s, P)) (plus the quotients' defining facts if asked)."""

    def build() -> list[z3.BoolRef]:
        v = ExtendVars.fresh()
        n = parts(v.p, v.s, v.P)
        return [*v.hypotheses(), *(_division_facts(v, n) if division_facts else []), z3.Not(goal(v, n))]

    def render(model: z3.ModelRef) -> str:
        values = _parts_values(model, ExtendVars.fresh(), parts)
        return f"{values}: {explain(values)}"

    return Obligation(name, COMPONENT, FAMILY, statement, expect, build, render, twin_of)


# ---- alloc_decode ---------------------------------------------------------------------


def _decode_obligation(
    name: str, statement: str, opens: Callable[[z3.ArithRef, z3.ArithRef], z3.BoolRef], *,
    expect: Expect = "proved", twin_of: str | None = None,
) -> Obligation:
    """For s >= 1: num_new_pages(s - 1, s) == [opens(s, P)]."""

    def build() -> list[z3.BoolRef]:
        s, P = z3.Int("s"), z3.Int("P")
        claim = num_new_pages_term(s - 1, s, P) == z3.If(opens(s, P), 1, 0)
        return [s >= 1, P >= 1, z3.Not(claim)]

    def render(model: z3.ModelRef) -> str:
        s, P = z3.Int("s"), z3.Int("P")
        pages = as_int(model, num_new_pages_term(s - 1, s, P))
        verdict = "opens" if as_bool(model, opens(s, P)) else "does not open"
        return (
            f"s={as_int(model, s)} P={as_int(model, P)} -> decoding token s-1 takes {pages} page(s), "
            f"but the test says it {verdict} a page"
        )

    return Obligation(name, COMPONENT, FAMILY, statement, expect, build, render, twin_of)


def opens_sound(s: z3.ArithRef, P: z3.ArithRef) -> z3.BoolRef:
    """The reference's ``decode_opens_page``: ``(s - 1) mod P == 0``."""
    return decode_opens_page_term(s, P)


def opens_s_mod_zero(s: z3.ArithRef, P: z3.ArithRef) -> z3.BoolRef:
    return s % P == 0


def opens_s_mod_one(s: z3.ArithRef, P: z3.ArithRef) -> z3.BoolRef:
    return s % P == 1


# ---- a batch of two requests ----------------------------------------------------------

BatchCount = Callable[[ExtendVars, ExtendVars], z3.ArithRef]


def batch_num_new_pages(a: ExtendVars, b: ExtendVars) -> z3.ArithRef:
    """``get_num_new_pages`` of the batch: sum of ``ceil(s_i/P) - ceil(p_i/P)``."""
    return num_new_pages_term(a.p, a.s, a.P) + num_new_pages_term(b.p, b.s, b.P)


def batch_extend_tokens(a: ExtendVars, b: ExtendVars) -> z3.ArithRef:
    """Wrong: pages estimated from the batch's total extend length."""
    return ceil_div_term((a.s - a.p) + (b.s - b.p), a.P)


def _kernel_pages(v: ExtendVars) -> z3.ArithRef:
    _, n2, n3 = extend_parts_terms(v.p, v.s, v.P)
    return new_pages_of_parts(n2, n3, v.P)


def _batch_obligation(name: str, statement: str, count: BatchCount, *,
                      expect: Expect = "proved", twin_of: str | None = None) -> Obligation:
    """Request 2's pages start where request 1's end; the batch total equals ``count``.

    Compositional: each request's page count is taken from the proved single-request
    lemma ``swa_allocator.alloc_extend.new_pages`` (restating its division terms for two requests
    at once only makes the non-linear search harder). A broken twin searches small
    numbers only (``P <= 4``, ``s_i <= 8``): any counterexample refutes it, and small
    ones read better and are found reliably.
    """

    def build() -> list[z3.BoolRef]:
        a, b = ExtendVars.fresh("1"), ExtendVars.fresh("2")
        lemma = [new_pages(v, sound_parts(v.p, v.s, v.P)) for v in (a, b)]
        # the kernel indexes free_pages with the cumulative get_num_new_pages
        offset_b = num_new_pages_term(a.p, a.s, a.P)
        written = [(0, _kernel_pages(a)), (offset_b, _kernel_pages(b))]
        contiguous = z3.And(written[0][0] + written[0][1] == written[1][0])
        total = written[1][0] + written[1][1]
        small = [a.P <= 4, a.s <= 8, b.s <= 8] if expect == "counterexample" else []
        return [*a.hypotheses(), *b.hypotheses(), *lemma, *small, z3.Not(z3.And(contiguous, total == count(a, b)))]

    def render(model: z3.ModelRef) -> str:
        a, b = ExtendVars.fresh("1"), ExtendVars.fresh("2")
        rows = [f"request {i}: p={x.values(model)[0]} s={x.values(model)[1]}" for i, x in ((1, a), (2, b))]
        taken = as_int(model, _kernel_pages(a) + _kernel_pages(b))
        claimed = as_int(model, count(a, b))
        return f"P={as_int(model, a.P)}; {'; '.join(rows)} -> the kernel takes {taken} pages, claimed {claimed}"

    return Obligation(name, COMPONENT, FAMILY, statement, expect, build, render, twin_of)


OBLIGATIONS: tuple[Obligation, ...] = (
    _request_obligation(
        "swa_allocator.alloc_extend.parts_sum", "for all 0 <= p <= s, P >= 1: n1 + n2 + n3 == s - p", parts_sum,
        explain_parts_sum,
    ),
    _request_obligation(
        "swa_allocator.alloc_extend.parts_sum.no_early_return",
        "computing parts 2 and 3 after part 1 already completed the request miscounts",
        parts_sum, explain_parts_sum, parts=parts_without_early_return, expect="counterexample",
        twin_of="swa_allocator.alloc_extend.parts_sum",
    ),
    _request_obligation(
        "swa_allocator.alloc_extend.part_shapes",
        "for all 0 <= p <= s, P >= 1: 0 <= n1 < P, n2 >= 0 and a multiple of P, 0 <= n3 < P",
        part_shapes, explain_part_shapes,
    ),
    _request_obligation(
        "swa_allocator.alloc_extend.part_shapes.no_clamp",
        "without the min(s, .) clamp part 1 overshoots and part 2 goes negative",
        part_shapes, explain_part_shapes, parts=parts_without_clamp, expect="counterexample",
        twin_of="swa_allocator.alloc_extend.part_shapes",
    ),
    _request_obligation(
        "swa_allocator.alloc_extend.new_pages",
        "for all 0 <= p <= s, P >= 1: n2/P + [n3 > 0] == ceil(s/P) - ceil(p/P) (get_num_new_pages)",
        new_pages, explain_new_pages, division_facts=True,
    ),
    _request_obligation(
        "swa_allocator.alloc_extend.new_pages.extend_len_over_p",
        "the page count is not ceil((s - p)/P)",
        new_pages_extend_len, explain_new_pages_extend_len, expect="counterexample",
        twin_of="swa_allocator.alloc_extend.new_pages",
        division_facts=True,
    ),
    _request_obligation(
        "swa_allocator.alloc_extend.part1_in_last_page",
        "for all 0 <= p <= s, P >= 1: if n1 > 0 the continued slots stay in the page of token p-1, "
        "and new pages start at a page boundary",
        part1_in_last_page, explain_part1,
    ),
    _request_obligation(
        "swa_allocator.alloc_extend.part1_in_last_page.next_boundary",
        "continuing to floor_P(p) + P writes into the (full or absent) page of token p-1 when p is aligned",
        part1_in_last_page, explain_part1, parts=parts_next_boundary, expect="counterexample",
        twin_of="swa_allocator.alloc_extend.part1_in_last_page",
    ),
    _decode_obligation(
        "swa_allocator.alloc_decode.new_page_iff",
        "for all s >= 1, P >= 1: decoding token s-1 takes a page iff (s-1) mod P == 0",
        opens_sound,
    ),
    _decode_obligation(
        "swa_allocator.alloc_decode.new_page_iff.s_mod_p_zero", "the test s mod P == 0 is off by one",
        opens_s_mod_zero, expect="counterexample", twin_of="swa_allocator.alloc_decode.new_page_iff",
    ),
    _decode_obligation(
        "swa_allocator.alloc_decode.new_page_iff.s_mod_p_one", "the shortcut s mod P == 1 misses P == 1",
        opens_s_mod_one, expect="counterexample", twin_of="swa_allocator.alloc_decode.new_page_iff",
    ),
    _batch_obligation(
        "swa_allocator.alloc_extend.batch_pages_additive",
        "for two requests (0 <= p_i <= s_i, P >= 1), given alloc_extend.new_pages per request: request 2's "
        "pages follow request 1's without gap or overlap and the batch takes exactly get_num_new_pages pages",
        batch_num_new_pages,
    ),
    _batch_obligation(
        "swa_allocator.alloc_extend.batch_pages_additive.extend_tokens",
        "the batch's pages are not ceil(total extend tokens / P)",
        batch_extend_tokens, expect="counterexample", twin_of="swa_allocator.alloc_extend.batch_pages_additive",
    ),
)
