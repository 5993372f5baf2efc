"""The Z3 terms of kvproof.spec and the pure-Python reference must not drift.

Each builder in ``kvproof.spec.terms`` is evaluated on concrete integers with
``z3.simplify`` and compared with ``kvproof.reference.arith`` (sglang_semantics.md
§1.3, §2.3); the ``swa_mask`` selection encoding is compared with a direct Python
rendering of ``get_cpu_copy`` / ``load_cpu_copy`` (§2.8).
"""

from __future__ import annotations

import functools

import z3
from hypothesis import given
from hypothesis import strategies as st

from kvproof.reference import arith
from kvproof.spec import swa_mask
from kvproof.spec._solver import closed_value as value
from kvproof.spec.terms import (
    ceil_div_term,
    ceil_p_term,
    decode_opens_page_term,
    extend_parts_terms,
    floor_p_term,
    is_multiple_term,
    new_pages_of_parts,
    num_new_pages_term,
    swa_tail_term,
)

pages = st.integers(1, 300)
lengths = st.integers(0, 20_000)




@given(L=st.integers(-5, 20_000), W=st.integers(1, 5_000), P=pages)
def test_swa_tail_term(L: int, W: int, P: int) -> None:
    assert value(swa_tail_term(L, W, P)) == arith.swa_tail_len(L, W, P)


def test_swa_tail_term_on_scenario_s1() -> None:
    table = {1: 1, 100: 100, 191: 191, 192: 128, 200: 136, 255: 191, 256: 128, 8192: 128, 8200: 136}
    assert {L: value(swa_tail_term(L, 128, 64)) for L in table} == table


@given(n=lengths, P=pages)
def test_rounding_terms(n: int, P: int) -> None:
    assert value(ceil_div_term(n, P)) == arith.ceil_div(n, P)
    assert value(ceil_p_term(n, P)) == arith.ceil_p(n, P)
    assert value(floor_p_term(n, P)) == arith.floor_p(n, P)
    assert value(is_multiple_term(n, P)) == (n % P == 0)


@given(data=st.data(), P=pages)
def test_extend_terms(data: st.DataObject, P: int) -> None:
    s = data.draw(lengths, label="seq_len")
    p = data.draw(st.integers(0, s), label="prefix_len")
    parts = extend_parts_terms(p, s, P)
    assert tuple(value(n) for n in parts) == arith.extend_parts(p, s, P)
    assert value(num_new_pages_term(p, s, P)) == arith.num_new_pages(p, s, P)
    assert value(new_pages_of_parts(parts[1], parts[2], P)) == arith.num_new_pages(p, s, P)


@given(s=st.integers(1, 20_000), P=pages)
def test_decode_term(s: int, P: int) -> None:
    assert value(decode_opens_page_term(s, P)) == arith.decode_opens_page(s, P)
    assert arith.decode_opens_page(s, P) == (arith.num_new_pages(s - 1, s, P) == 1)


def _python_load(old: list[bool], new: list[bool]) -> tuple[list[int], list[int]]:
    """§2.8 in plain Python: rows by source position, destinations by position."""
    saved = [j for j, bit in enumerate(old) if bit]
    row_mask = [new[j] for j in saved]  # new_mask[old_mask]
    rows = [j for j, keep in zip(saved, row_mask) if keep]
    dest = [j for j, keep in zip(saved, row_mask) if keep]  # t[old_mask][row_mask]
    return rows, dest


def _two_masks(n: int) -> st.SearchStrategy[tuple[list[bool], list[bool]]]:
    mask = st.lists(st.booleans(), min_size=n, max_size=n)
    return st.tuples(mask, mask)


masks = st.integers(1, swa_mask.MAX_LEN).flatmap(_two_masks)


@functools.cache
def _symbolic_mask_model() -> tuple[swa_mask.MaskCase, swa_mask.Load, tuple[z3.ArithRef, ...], z3.ArithRef]:
    """The symbolic copy/load terms, built once; examples substitute concrete masks."""
    case = swa_mask.MaskCase.fresh()
    return (case, swa_mask.load_cpu_copy(case), *swa_mask.copy(case))


@given(masks=masks)
def test_swa_mask_encoding(masks: tuple[list[bool], list[bool]]) -> None:
    old, new = masks
    pad = [False] * (swa_mask.MAX_LEN - len(old))
    case, load, saved, num_saved = _symbolic_mask_model()
    concrete = [(case.n, z3.IntVal(len(old)))]
    concrete += [(var, z3.BoolVal(bit)) for var, bit in zip(case.old + case.new, old + pad + new + pad)]

    def at(term: z3.ExprRef) -> int | bool:
        return value(z3.substitute(term, *concrete))

    rows = [at(x) for x in load.rows[: at(load.num_rows)]]
    dest = [at(x) for x in load.dest[: at(load.num_dest)]]
    expected_rows, expected_dest = _python_load(old, new)
    if not any(old) or not expected_dest:  # swa is None, or no destinations: load returns early
        expected_rows, expected_dest = [], []
    assert (rows, dest) == (expected_rows, expected_dest)
    assert [at(x) for x in saved[: at(num_saved)]] == [j for j, bit in enumerate(old) if bit]
