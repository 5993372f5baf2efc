"""hisparse_host: the Z3 terms must not drift from the reference, S7 is the reference's run, twins read as numbers.

Each builder of ``kvproof.spec.hisparse_host`` is evaluated on concrete integers with
``z3.simplify`` and compared with ``kvproof.reference.hisparse_host`` (sglang_semantics.md
§4.3, §4.4). The ``s7_vector`` numbers are replayed through the reference's coordinator
call sites (§4.5, §9 S7), and the broken twins' counterexamples are parsed back and
checked against the reference's arithmetic and operations.
"""

from __future__ import annotations

import re

import pytest
import z3
from hypothesis import given
from hypothesis import strategies as st

from kvproof.reference import hisparse_host as hh
from kvproof.reference.arith import ceil_div, ceil_p, floor_p
from kvproof.reference.errors import InvalidOperation
from kvproof.spec import TEST_BUDGET, obligations, run
from kvproof.spec import hisparse_host as spec


def value(term: z3.ExprRef) -> int | bool:
    """A closed Z3 term as a Python value."""
    simple = z3.simplify(term)
    if z3.is_bool(simple):
        assert z3.is_true(simple) or z3.is_false(simple), simple
        return z3.is_true(simple)
    assert isinstance(simple, z3.IntNumRef), simple
    return simple.as_long()


pages = st.integers(1, 128)


@given(P=pages, M=st.integers(1, 10_000))
def test_row_width_term(P: int, M: int) -> None:
    assert value(spec.row_width_term(M, P)) == hh.row_width(M, P)


@given(P=pages, a=st.integers(0, 5_000), start=st.integers(0, 5_000), n=st.integers(-3, 3_000))
def test_allocation_terms(P: int, a: int, start: int, n: int) -> None:
    """Any ``a`` (the reference does not require H1 here), ``n <= 0`` included."""
    assert value(spec.allocated_len_after_term(a, start, n, P)) == hh.allocated_len_after(a, start, n, P)
    assert value(spec.host_new_pages_term(a, start, n, P)) == hh.host_new_pages(a, start, n, P)


@given(P=pages, j=st.integers(0, 60), start=st.integers(0, 5_000), n=st.integers(-3, 3_000))
def test_page_count_witness(P: int, j: int, start: int, n: int) -> None:
    """The explicit witness of H1: ``allocated_len_after(j*P, ...) == k*P``, and ``k - j`` pages are new."""
    k = value(spec.allocated_pages_after_term(j, start, n, P))
    assert k * P == hh.allocated_len_after(j * P, start, n, P)
    assert k - j == hh.host_new_pages(j * P, start, n, P)


@given(P=pages, data=st.data())
def test_host_slot_term(P: int, data: st.DataObject) -> None:
    row = data.draw(st.lists(st.integers(0, 500), min_size=1, max_size=12, unique=True))
    pos = data.draw(st.integers(0, len(row) * P - 1))
    assert value(spec.host_slot_term(spec.row_pages(row), pos, P)) == hh.host_slot(row, pos, P)


@given(P=pages, x=st.integers(-5_000, 5_000), w=st.integers(-100, 100))
def test_div_shift_facts_hold(P: int, x: int, w: int) -> None:
    assert all(value(f) for f in spec.div_shift_facts(x, w, P))


def test_row_pages_is_minus_one_past_the_row() -> None:
    assert value(spec.row_pages([3, 1])(z3.IntVal(2))) == -1


# ---- S7 through the reference ---------------------------------------------------------------

S7 = spec.S7
CONFIG = hh.HostPoolConfig(page_size=64, num_pages=40, max_req_slots=4, max_context_len=2048)


def test_s7_vector_is_the_references_run() -> None:
    p = S7["P"]
    state = hh.initial_state(CONFIG)
    size = hh.available_size(state)
    state, slots = hh.admit_request_into_staging(state, 0, list(range(S7["prefill"])))
    assert len(slots) == S7["prefill"]
    assert len(state.rows[0]) == S7["staged"] == value(spec.allocated_len_after_term(0, 0, S7["prefill"], p))
    assert size - hh.available_size(state) == S7["staged_pages"] * p
    hh.check_host_pool(state)
    # seq_len prefill + 1 is skipped; positions 1000..1023 land in reserved slots
    for seq_len in range(S7["prefill"] + 1, S7["last_in_page"] + 3):
        before = hh.available_size(state)
        state, _ = hh.eager_backup_previous_token(state, [0], [seq_len], [seq_len])
        assert hh.available_size(state) == before and len(state.rows[0]) == S7["staged"]
    # position 1024 (seq_len 1026) opens one page
    state, written = hh.eager_backup_previous_token(state, [0], [S7["crossing"] + 2], [7])
    assert len(state.rows[0]) == S7["after_crossing"]
    assert size - hh.available_size(state) == (S7["staged_pages"] + 1) * p
    assert written == (state.rows[0][S7["crossing"]],)
    hh.check_host_pool(state)
    # upstream's assert: start 2000 > alloc_len 1088 is a hole
    with pytest.raises(InvalidOperation):
        hh.alloc_paged_token_slots(state, 0, S7["hole_start"], 1)
    before = hh.available_size(state)
    state = hh.request_finished(state, 0)
    assert hh.available_size(state) - before == S7["released_pages"] * p == size - before
    assert state.rows[0] == ()
    hh.check_host_pool(state)


def test_s7_pre_23606_staging_breaks_the_page_rule() -> None:
    pre = CONFIG.model_copy(update={"coordinator": hh.Coordinator.PRE_23606})
    with pytest.raises(InvalidOperation, match="page rule"):
        hh.admit_request_into_staging(hh.initial_state(pre), 0, list(range(S7["prefill"])))
    (twin,) = obligations(name_filter="hisparse_host.admit_request_into_staging.s7_vector.pre_23606_token_alloc")
    detail = run(twin, **TEST_BUDGET).detail
    assert "alloc(1000) = 15*64 + 40" in detail and "alloc(3)" in detail and "P_h=64" in detail


# ---- twins: the rendered numbers are real ----------------------------------------------------


def _numbers(detail: str) -> dict[str, int]:
    return {k: int(v) for k, v in re.findall(r"\b(\w+)=(-?\d+)", detail)}


def _refuted(name: str) -> str:
    (ob,) = [ob for ob in obligations(component="hisparse_host") if ob.name == f"hisparse_host.{name}"]
    result = run(ob, **TEST_BUDGET)
    assert result.ok and result.status == "counterexample", result
    assert re.search(r"\d", result.detail)
    return result.detail


def test_every_twin_renders_numbers() -> None:
    twins = [ob for ob in obligations(component="hisparse_host") if ob.twin_of is not None]
    assert len(twins) >= 15
    for ob in twins:
        detail = _refuted(ob.name.removeprefix("hisparse_host."))
        assert _numbers(detail), f"{ob.name}: {detail}"
        assert "div0" not in detail and "mod0" not in detail


@pytest.mark.parametrize("name", ["alloc_paged_token_slots.allocated_len_multiple.no_round_up",
                                  "alloc_paged_token_slots.covers_request.floor_end",
                                  "alloc_paged_token_slots.covers_request.no_max",
                                  "alloc_paged_token_slots.new_pages_count.from_n",
                                  "alloc_paged_token_slots.new_pages_count.floor"])
def test_call_twins_break_what_the_reference_keeps(name: str) -> None:
    x = _numbers(_refuted(name))
    p, a, start, n = x["P"], x["a"], x["start"], x["n"]
    assert a % p == 0 and start >= 0 and n >= 1 and x["end"] == start + n
    after = hh.allocated_len_after(a, start, n, p)
    assert after % p == 0 and after >= start + n and after >= a
    needed = ceil_div(start + n - a, p) if start + n > a else 0
    assert hh.host_new_pages(a, start, n, p) == needed
    if name.startswith("alloc_paged_token_slots.new_pages_count"):
        assert f"needs {needed}" in _refuted(name)


def _row_of(a: int, p: int) -> hh.HostPoolState:
    config = hh.HostPoolConfig(page_size=p, num_pages=max(1, a // p) + 8, max_req_slots=1,
                               max_context_len=max(a, 1) + 4 * p)
    state = hh.initial_state(config)
    if a:
        state, _ = hh.alloc_paged_token_slots(state, 0, 0, a)
    return state


def test_no_hole_twin_is_a_call_the_reference_refuses() -> None:
    x = _numbers(_refuted("alloc_paged_token_slots.no_hole.precondition_dropped"))
    p, a, start, n = x["P"], x["a"], x["start"], x["n"]
    assert start > a
    with pytest.raises(InvalidOperation, match="hole"):
        hh.alloc_paged_token_slots(_row_of(a, p), 0, start, n)


def test_row_width_twins() -> None:
    x = _numbers(_refuted("alloc_paged_token_slots.row_width_fits.no_padding"))
    m, p, end = x["max_context_len"], x["P"], x["end"]
    assert end <= m < ceil_p(end, p) <= hh.row_width(m, p)
    y = _numbers(_refuted("alloc_paged_token_slots.row_width_exact.end_within_width"))
    assert floor_p(y["width"], y["P"]) < y["end"] <= y["width"] < ceil_p(y["end"], y["P"])


def test_release_twin_leaks() -> None:
    detail = _refuted("request_finished.release_restores_pool.pre_23606_compressed_len")
    x = _numbers(detail)
    a1, a2 = map(int, re.search(r"alloc_len=\((\d+), (\d+)\)", detail).groups())
    assert x["available"] + a1 + a2 == x["size"] and x["compressed_len"] < a1
    assert f"leaks {a1 - x['compressed_len']} slots" in detail


@pytest.mark.parametrize("name", ["eager_backup_previous_token.backup_within_allocated.no_page_extension",
                                  "eager_backup_previous_token.backup_within_allocated.end_at_start"])
def test_backup_twins_leave_a_hole_the_reference_fills(name: str) -> None:
    x = _numbers(_refuted(name))
    p, a, s = x["P"], x["alloc_len"], x["seq_len"]
    assert a % p == 0 and a >= p and s - 2 <= a
    after = hh.allocated_len_after(a, s - 2, 1, p)  # the reference's backup extends the row
    assert after >= s - 1
    state = _row_of(a, p)
    state, _ = hh.alloc_paged_token_slots(state, 0, s - 2, 1)
    hh.alloc_paged_token_slots(state, 0, s - 1, 1)  # the next backup: no hole


def test_slot_twins_collide_or_leave_the_page() -> None:
    for name in ("position_offset", "page_plus_offset", "repeated_pages"):
        detail = _refuted(f"alloc_paged_token_slots.slots_distinct_in_own_pages_in_order.{name}")
        assert "both get slot" in detail or "lies in host page" in detail, detail
        x = _numbers(detail)
        assert x["P"] >= 1 and x["x"] < x["y"]
