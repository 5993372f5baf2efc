"""Z3 terms for the page and window arithmetic (sglang_semantics.md §1.1, §1.3, §2.3).

Each builder mirrors one function of ``kvproof.reference.arith`` over ``z3.Int``
terms (Python ints are accepted and lifted), so the proofs in this package talk
about the same formulas the reference executes. ``tests/spec/test_drift.py``
evaluates these builders on concrete integers with ``z3.simplify`` and compares
them with the reference: the spec and the reference must not drift.

Z3's Int ``/`` and ``%`` are Euclidean. For a divisor ``d >= 1`` they agree with
Python's ``//`` and ``%`` on every integer numerator, which is all these builders
rely on; callers state ``P >= 1`` as a hypothesis.
"""

from __future__ import annotations

from typing import TypeAlias

import z3

__all__ = [
    "IntLike",
    "ceil_div_term",
    "ceil_p_term",
    "decode_opens_page_term",
    "extend_parts_terms",
    "floor_p_term",
    "is_multiple_term",
    "lift",
    "new_pages_of_parts",
    "num_new_pages_term",
    "swa_tail_term",
    "zmax",
    "zmin",
]

IntLike: TypeAlias = z3.ArithRef | int


def lift(x: IntLike) -> z3.ArithRef:
    """``x`` as a Z3 integer term (so ``/`` is integer division, never float)."""
    return x if isinstance(x, z3.ArithRef) else z3.IntVal(x)


def zmax(a: IntLike, b: IntLike) -> z3.ArithRef:
    """``max(a, b)``."""
    a, b = lift(a), lift(b)
    return z3.If(a >= b, a, b)


def zmin(a: IntLike, b: IntLike) -> z3.ArithRef:
    """``min(a, b)``."""
    a, b = lift(a), lift(b)
    return z3.If(a <= b, a, b)


def ceil_div_term(n: IntLike, d: IntLike) -> z3.ArithRef:
    """``ceil(n / d)`` as ``(n + d - 1) div d``; exact for ``n >= 0``, ``d >= 1``."""
    n, d = lift(n), lift(d)
    return (n + d - 1) / d


def ceil_p_term(x: IntLike, page_size: IntLike) -> z3.ArithRef:
    """``ceil_P(x)``: ``x`` rounded up to a multiple of the page size."""
    return ceil_div_term(x, page_size) * lift(page_size)


def floor_p_term(x: IntLike, page_size: IntLike) -> z3.ArithRef:
    """``floor_P(x)``: ``x`` rounded down to a multiple of the page size."""
    x, p = lift(x), lift(page_size)
    return (x / p) * p


def is_multiple_term(x: IntLike, page_size: IntLike) -> z3.BoolRef:
    """``x mod P == 0``, written ``floor_P(x) == x``.

    Equivalent for ``P >= 1``; Z3's non-linear integer reasoning refutes the
    negation of this form reliably, while ``x % P == 0`` sometimes times out.
    """
    return floor_p_term(x, page_size) == lift(x)


def part2_pages_term(prefix_len: IntLike, seq_len: IntLike, page_size: IntLike) -> z3.ArithRef:
    """Whole new pages of part 2: ``floor(s/P) - ceil(p/P)``, or 0 when part 1 completes the request.

    Used as the explicit witness of "n2 is a multiple of P" (``n2 == k * P``): Z3 then
    needs only ring normalisation, where ``floor_P(n2) == n2`` asks it to simplify a
    quotient of products, which it does only for some random seeds.
    """
    p, s, P = lift(prefix_len), lift(seq_len), lift(page_size)
    n1 = zmin(s, ceil_p_term(p, P)) - p
    return z3.If(p + n1 == s, 0, s / P - ceil_div_term(p, P))


def extend_parts_terms(
    prefix_len: IntLike, seq_len: IntLike, page_size: IntLike
) -> tuple[z3.ArithRef, z3.ArithRef, z3.ArithRef]:
    """``(n1, n2, n3)`` of a paged ``alloc_extend`` for one request (§1.3 parts 1/2/3).

    ``n1`` continues the partial last page, ``n2`` fills whole new pages, ``n3``
    starts the last new page; when part 1 already completes the request,
    ``n2 = n3 = 0`` (the reference's early return).
    """
    p, s = lift(prefix_len), lift(seq_len)
    n1 = zmin(s, ceil_p_term(p, page_size)) - p
    done = p + n1 == s
    n2 = z3.If(done, 0, floor_p_term(s, page_size) - ceil_p_term(p, page_size))
    n3 = z3.If(done, 0, s - floor_p_term(s, page_size))
    return n1, n2, n3


def new_pages_of_parts(n2: IntLike, n3: IntLike, page_size: IntLike) -> z3.ArithRef:
    """Pages the kernel actually takes: ``n2 / P`` whole pages plus one if ``n3 > 0``."""
    n2, n3 = lift(n2), lift(n3)
    return n2 / lift(page_size) + z3.If(n3 > 0, 1, 0)


def num_new_pages_term(prefix_len: IntLike, seq_len: IntLike, page_size: IntLike) -> z3.ArithRef:
    """``get_num_new_pages`` for one request: ``ceil(s/P) - ceil(p/P)`` (§1.3)."""
    return ceil_div_term(seq_len, page_size) - ceil_div_term(prefix_len, page_size)


def decode_opens_page_term(seq_len: IntLike, page_size: IntLike) -> z3.BoolRef:
    """Decoding token ``s - 1`` opens a new page: ``(s - 1) mod P == 0`` (§1.3)."""
    return (lift(seq_len) - 1) % lift(page_size) == 0


def swa_tail_term(seq_len: IntLike, window: IntLike, page_size: IntLike) -> z3.ArithRef:
    """``swa_tail_len(L) = L - floor_P(max(0, L - W))``, and 0 for ``L <= 0`` (§2.3)."""
    L = lift(seq_len)
    return z3.If(L <= 0, 0, L - floor_p_term(zmax(0, L - lift(window)), page_size))
