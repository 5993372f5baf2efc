"""Lemma D2: the SWA tail of a PD decode preallocation (sglang_semantics.md §2.3, §7 D2).

``swa_tail_len(L) = L - floor_P(max(0, L - W))`` is proved, for symbolic integers
``L >= 1``, ``W >= 1``, ``P >= 1``, to be positive, to cover the window
(``>= min(L, W)``), to waste less than one page (``<= min(L, W + P - 1)``) and to
start on a page boundary (precondition U1 of ``alloc_extend_swa_tail``, §2.7).
The ``saving`` obligation bounds the SWA pages the tail takes against the old
full-length reservation of ``ceil(L/P)`` pages (§2.10).

Each broken twin swaps in a plausible wrong formula (no ``max(0, .)``, ``ceil_P``
for ``floor_P``, an unaligned ``min(L, W)``, the resume window ``L - 1 - W``) or a
wrong budget claim, and must produce a concrete ``L W P`` counterexample.

Obligations are named ``swa_allocator.swa_tail_len.<claim>[.<twin>]``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import z3

from kvproof.spec._solver import Expect, Obligation, as_int
from kvproof.spec.terms import (
    ceil_div_term,
    ceil_p_term,
    floor_p_term,
    is_multiple_term,
    swa_tail_term,
    zmax,
    zmin,
)

__all__ = ["OBLIGATIONS", "TailVars"]

COMPONENT = "swa_allocator"
FAMILY = "swa_tail"
NAME = f"{COMPONENT}.swa_tail_len"  # obligations are about reference.arith.swa_tail_len


@dataclass(frozen=True)
class TailVars:
    """Symbolic sequence length ``L``, window ``W`` and page size ``P``."""

    L: z3.ArithRef
    W: z3.ArithRef
    P: z3.ArithRef

    @staticmethod
    def fresh() -> TailVars:
        return TailVars(z3.Int("L"), z3.Int("W"), z3.Int("P"))

    def hypotheses(self) -> list[z3.BoolRef]:
        """The domain of ``_swa_tail_len`` in tail mode: positive length, window, page."""
        return [self.L >= 1, self.W >= 1, self.P >= 1]


TailFormula = Callable[[TailVars], z3.ArithRef]
Goal = Callable[[TailVars, z3.ArithRef], z3.BoolRef]
Describe = Callable[[dict[str, int], int], str]


# ---- the formula and its wrong variants ---------------------------------------------


def sound_tail(v: TailVars) -> z3.ArithRef:
    """The kvproof / SGLang formula (mirrors ``reference.arith.swa_tail_len``)."""
    return swa_tail_term(v.L, v.W, v.P)


def tail_without_max(v: TailVars) -> z3.ArithRef:
    """Wrong: ``L - floor_P(L - W)``; for ``L < W`` the start goes negative."""
    return v.L - floor_p_term(v.L - v.W, v.P)


def tail_with_ceil(v: TailVars) -> z3.ArithRef:
    """Wrong: ``L - ceil_P(max(0, L - W))`` rounds the start past the window."""
    return v.L - ceil_p_term(zmax(0, v.L - v.W), v.P)


def tail_min_window(v: TailVars) -> z3.ArithRef:
    """Wrong: exactly the window, ``min(L, W)``, ignoring page alignment."""
    return zmin(v.L, v.W)


def tail_resume_window(v: TailVars) -> z3.ArithRef:
    """Wrong: the resume-tail start ``floor_P(L - 1 - W)`` used for a fresh prefill."""
    return v.L - floor_p_term(zmax(0, v.L - 1 - v.W), v.P)


# ---- goals and how a violation reads ------------------------------------------------


def positive(v: TailVars, tail: z3.ArithRef) -> z3.BoolRef:
    return tail >= 1


def lower_bound(v: TailVars, tail: z3.ArithRef) -> z3.BoolRef:
    return tail >= zmin(v.L, v.W)


def upper_bound(v: TailVars, tail: z3.ArithRef) -> z3.BoolRef:
    return tail <= zmin(v.L, v.W + v.P - 1)


def page_aligned_start(v: TailVars, tail: z3.ArithRef) -> z3.BoolRef:
    return is_multiple_term(v.L - tail, v.P)


def saving(v: TailVars, tail: z3.ArithRef) -> z3.BoolRef:
    pages = ceil_div_term(tail, v.P)
    return z3.And(pages <= ceil_div_term(v.L, v.P), pages <= ceil_div_term(v.W - 1, v.P) + 1)


def saving_window_pages(v: TailVars, tail: z3.ArithRef) -> z3.BoolRef:
    """Wrong budget belief: the tail fits in ``ceil(W/P)`` pages (cf. R4, §2.11)."""
    return ceil_div_term(tail, v.P) <= ceil_div_term(v.W, v.P)


def _cdiv(n: int, d: int) -> int:
    return -(-n // d)


def _describe_positive(x: dict[str, int], tail: int) -> str:
    return f"tail={tail} < 1"


def _describe_lower(x: dict[str, int], tail: int) -> str:
    return f"tail={tail} < min(L, W)={min(x['L'], x['W'])}"


def _describe_upper(x: dict[str, int], tail: int) -> str:
    return f"tail={tail} > min(L, W+P-1)={min(x['L'], x['W'] + x['P'] - 1)}"


def _describe_aligned(x: dict[str, int], tail: int) -> str:
    return f"tail={tail}, start L-tail={x['L'] - tail} is not a multiple of P={x['P']}"


def _describe_saving(x: dict[str, int], tail: int) -> str:
    pages, P = _cdiv(tail, x["P"]), x["P"]
    return (
        f"tail={tail} takes {pages} SWA pages; old reservation ceil(L/P)={_cdiv(x['L'], P)}, "
        f"window bound ceil((W-1)/P)+1={_cdiv(x['W'] - 1, P) + 1}"
    )


def _describe_window_pages(x: dict[str, int], tail: int) -> str:
    return f"tail={tail} takes {_cdiv(tail, x['P'])} SWA pages > ceil(W/P)={_cdiv(x['W'], x['P'])}"


# ---- obligation factory -------------------------------------------------------------


def _render(formula: TailFormula, describe: Describe) -> Callable[[z3.ModelRef], str]:
    def render(model: z3.ModelRef) -> str:
        v = TailVars.fresh()
        x = {"L": as_int(model, v.L), "W": as_int(model, v.W), "P": as_int(model, v.P)}
        tail = as_int(model, formula(v))
        return f"L={x['L']} W={x['W']} P={x['P']} -> {describe(x, tail)}"

    return render


def _tail_obligation(
    suffix: str,
    statement: str,
    goal: Goal,
    describe: Describe,
    *,
    formula: TailFormula = sound_tail,
    expect: Expect = "proved",
    twin_of: str | None = None,
) -> Obligation:
    """hypotheses(L, W, P) and not goal(formula(L, W, P))."""

    def build() -> list[z3.BoolRef]:
        v = TailVars.fresh()
        return [*v.hypotheses(), z3.Not(goal(v, formula(v)))]

    return Obligation(
        name=f"{NAME}.{suffix}",
        component=COMPONENT,
        family=FAMILY,
        statement=statement,
        expect=expect,
        build=build,
        render=_render(formula, describe),
        twin_of=twin_of,
    )


def _twin(of: str, suffix: str, statement: str, goal: Goal, describe: Describe, formula: TailFormula) -> Obligation:
    return _tail_obligation(
        f"{of}.{suffix}", statement, goal, describe, formula=formula, expect="counterexample", twin_of=f"{NAME}.{of}"
    )


OBLIGATIONS: tuple[Obligation, ...] = (
    _tail_obligation(
        "positive", "for all L, W, P >= 1: swa_tail_len(L) >= 1", positive, _describe_positive
    ),
    _twin(
        "positive", "ceil_start", "with ceil_P for floor_P the tail can be empty",
        positive, _describe_positive, tail_with_ceil,
    ),
    _tail_obligation(
        "lower_bound", "for all L, W, P >= 1: swa_tail_len(L) >= min(L, W) (the tail covers the window)",
        lower_bound, _describe_lower,
    ),
    _twin(
        "lower_bound", "ceil_start", "with ceil_P for floor_P the tail misses part of the window",
        lower_bound, _describe_lower, tail_with_ceil,
    ),
    _tail_obligation(
        "upper_bound", "for all L, W, P >= 1: swa_tail_len(L) <= min(L, W + P - 1)",
        upper_bound, _describe_upper,
    ),
    _twin(
        "upper_bound", "no_max", "without max(0, L - W) the tail exceeds the sequence when L < W",
        upper_bound, _describe_upper, tail_without_max,
    ),
    _twin(
        "upper_bound", "resume_window", "starting at floor_P(L - 1 - W) (the resume tail) can take W + P tokens",
        upper_bound, _describe_upper, tail_resume_window,
    ),
    _tail_obligation(
        "page_aligned_start", "for all L, W, P >= 1: (L - swa_tail_len(L)) mod P == 0 (precondition U1)",
        page_aligned_start, _describe_aligned,
    ),
    _twin(
        "page_aligned_start", "min_window", "a tail of exactly min(L, W) tokens need not start on a page boundary",
        page_aligned_start, _describe_aligned, tail_min_window,
    ),
    _tail_obligation(
        "saving",
        "for all L, W, P >= 1: the tail's SWA pages ceil(tail/P) <= ceil(L/P) (the old full-length "
        "reservation) and <= ceil((W-1)/P) + 1, independent of L",
        saving, _describe_saving,
    ),
    _twin(
        "saving", "window_pages", "a budget of ceil(W/P) SWA pages per request is too small (cf. R4)",
        saving_window_pages, _describe_window_pages, sound_tail,
    ),
)
