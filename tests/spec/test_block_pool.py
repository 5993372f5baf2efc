"""block_pool: every twin reads as numbers, the terms are the reference's.

``kvproof.spec.block_pool`` (docs/block_pool.md §1-§5, vLLM 0.33.0's v1 KV cache manager): names
``block_pool.<op>.<claim>`` after the reference operation (or the vLLM function whose formula it is about); the
term builders are evaluated on concrete integers against ``kvproof.reference.block_pool`` (§3), the hit shape the
model assumes is checked on the reference's hits, the twins' numbers are replayed through the reference, and
witnesses show that the premises of the proofs admit the runs they are about (every operation enabled and
effective, a shared block, a nulled SWA entry, a refused call).
"""

from __future__ import annotations

import functools
import re
import subprocess
import sys

import pytest
import z3
from hypothesis import given
from hypothesis import strategies as st

from kvproof.reference import block_pool as ref
from kvproof.reference.errors import OutOfMemory
from kvproof.spec import TEST_BUDGET, Result, _ts, collect, obligations, run, systems
from kvproof.spec import block_pool as spec

NAMES = {ob.name: ob for ob in spec.OBLIGATIONS}
OPS = ("allocate_slots", "free", "remove_skipped_blocks", "cache_blocks", "evict_blocks", "reset_prefix_cache")
#: vLLM functions whose formulas obligations are about besides the transitions (all in the reference too)
FORMULAS = ("get_num_skipped_tokens", "max_admission_blocks_per_request", "contiguous_blocks_for_hit",
            "get_num_blocks_to_allocate")
SYSTEM = spec.SYSTEM


@functools.cache
def result(name: str) -> Result:
    return run(NAMES[name], **TEST_BUDGET)


def value(term: z3.ExprRef) -> int:
    simple = z3.simplify(term)
    assert isinstance(simple, z3.IntNumRef), simple
    return simple.as_long()


def numbers(detail: str) -> dict[str, int]:
    return {k: int(v) for k, v in re.findall(r"\b(\w+)=(-?\d+)", detail)}


# ---- registry shape (every verdict: tests/spec/test_obligations.py) -------------------------------------


def test_the_module_has_the_registry_shape() -> None:
    """Names ``block_pool.<op>.<claim>``; each sound obligation has a twin named after it."""
    assert collect({"block_pool": spec}) == spec.OBLIGATIONS
    assert systems("block_pool") == (SYSTEM,)
    for ob in spec.OBLIGATIONS:
        op = ob.name.split(".")[1]
        assert op == "pool" or (op in (*OPS, *FORMULAS) and callable(getattr(ref, op))), ob.name
        if ob.twin_of is not None:
            assert NAMES[ob.twin_of].twin_of is None and ob.name.startswith(ob.twin_of + "."), ob.name
    sound = {ob.name for ob in spec.OBLIGATIONS if ob.twin_of is None}
    assert sound == {ob.twin_of for ob in spec.OBLIGATIONS if ob.twin_of is not None}


@pytest.mark.parametrize("op", OPS)
def test_every_operation_is_the_subject_of_obligations(op: str) -> None:
    """``kvproof prove -k <op>`` finds the obligations about each transition."""
    found = obligations("block_pool", op)
    assert found and any(ob.name.startswith(f"block_pool.{op}.") for ob in found)


def test_transitions_are_named_like_the_reference_operations() -> None:
    assert SYSTEM.ops == OPS
    assert all(callable(getattr(ref, op)) for op in OPS)
    assert (spec.NULL, spec.FULL, spec.SWA) == (ref.NULL_BLOCK, ref.FULL, ref.SWA)


def test_the_allocate_slots_parts_cover_the_invariant() -> None:
    """``allocate_slots.keeps_{counts,lists,keys}`` together are its consecution: every clause in exactly one."""
    names = [name for name, _ in spec.invariant_clauses(spec.State.fresh("x"))]
    for name in names:
        assert sum(name.startswith(prefixes) for prefixes in spec.CLAUSE_PARTS.values()) == 1, name
    parts = {ob.name.removeprefix("block_pool.allocate_slots.") for ob in spec.OBLIGATIONS
             if ob.twin_of is None and ob.name.startswith("block_pool.allocate_slots.keeps_")}
    assert parts == {f"keeps_{part}" for part in spec.CLAUSE_PARTS}
    for op in OPS[1:]:
        assert f"block_pool.{op}.keeps_invariant" in NAMES


def test_every_twin_reads_as_numbers() -> None:
    twins = [ob for ob in spec.OBLIGATIONS if ob.twin_of is not None]
    assert len(twins) >= 20
    for ob in twins:
        detail = result(ob.name).detail
        assert re.search(r"\d", detail) and "div0" not in detail and "mod0" not in detail, (ob.name, detail)
        arithmetic = ob.name.split(".")[1] in FORMULAS[:3] or ".admits_alone." in ob.name
        assert arithmetic or detail.startswith("step | op(arguments)"), (ob.name, detail)


@pytest.mark.parametrize(("name", "says"), [
    ("pool.initiation.null_block_free", "V3: the null block is never in the free queue"),
    ("allocate_slots.keeps_counts.touch_keeps_free", "V3: a block is queued iff its count is 0"),
    ("free.keeps_invariant.duplicate_free", "a count below zero"),
    ("free.keeps_invariant.null_counted", "the null block 0 is in the free queue"),
    ("free.keeps_invariant.null_not_skipped", "null: the null block's count is not maintained"),
    ("remove_skipped_blocks.keeps_window.plus_two", "the window of token"),
    ("allocate_slots.refusal_changes_nothing.group_by_group", "returned None but changed the state"),
    ("allocate_slots.accepted_never_runs_out.each_group_alone", "group 1's get_new_blocks ran out"),
    ("get_num_blocks_to_allocate.sum_leaves_the_queue.evictable_not_counted", "left the free queue"),
    ("allocate_slots.admits_alone.gate_without_cap", "it is never admitted"),
])
def test_twins_say_what_broke(name: str, says: str) -> None:
    assert says in result(f"block_pool.{name}").detail


# ---- the term builders against the reference (docs/block_pool.md §3) ---------------------------------------

sizes = st.sampled_from(spec.BLOCK_SIZES)


def _config(B: int, W: int, L: int, T: int | None = None, N: int = 64) -> ref.BlockPoolConfig:
    return ref.BlockPoolConfig(block_size=B, num_blocks=N, sliding_window=W, max_model_len=L, max_in_flight_tokens=T)


@given(n=st.integers(0, 300), W=st.integers(2, 70), B=sizes)
def test_skipped_tokens_term(n: int, W: int, B: int) -> None:
    cfg = _config(B, W, 300)
    assert value(spec.skipped_tokens_term(n, W)) == ref.get_num_skipped_tokens(cfg, ref.SWA, n)
    assert ref.get_num_skipped_tokens(cfg, ref.FULL, n) == 0
    assert value(spec.bounded_div(spec.skipped_tokens_term(n, W), z3.IntVal(B))) == max(0, n - W + 1) // B


@given(W=st.integers(2, 200), B=st.integers(1, 64))
def test_contiguous_blocks_for_hit_term(W: int, B: int) -> None:
    assert value(spec.contiguous_blocks_for_hit_term(W, B)) == ref.contiguous_blocks_for_hit(W, B)


@given(B=st.integers(1, 32), W=st.integers(2, 300), T=st.integers(1, 300), L=st.integers(1, 600))
def test_max_admission_blocks_term(B: int, W: int, T: int, L: int) -> None:
    cfg = _config(B, W, L, T)
    assert value(spec.max_admission_blocks_term(W, B, T, L)) == ref.max_admission_blocks_per_request(cfg, ref.SWA)
    assert ref.max_admission_blocks_per_request(cfg, ref.FULL) is None


@given(x=st.integers(-40, 400), B=sizes)
def test_bounded_division_is_division(x: int, B: int) -> None:
    b = z3.Int("B")
    assert value(z3.substitute(spec.bounded_div(x, b), (b, z3.IntVal(B)))) == x // B
    assert value(z3.substitute(spec.bounded_mul(x, b), (b, z3.IntVal(B)))) == x * B
    assert value(spec.cdiv_term(x, B)) == -(-x // B)


@given(B=sizes, W=st.integers(2, 12), data=st.data())
def test_num_blocks_to_allocate_term_and_the_hit_shape(B: int, W: int, data: st.DataObject) -> None:
    """A prefix cached by request 1, then request 2 sharing part of it: the reference's need per group is the term's
    (new request with its hit, capped and not; then running), and the SWA hit is what the model adopts: ``hb``
    entries whose last ``hb - skipped(hb * B) // B`` are real blocks (contiguous_blocks_for_hit.run_is_window)."""
    cfg = _config(B, W, 64, data.draw(st.integers(1, 20)), N=80)
    first = list(range(data.draw(st.integers(1, 30))))
    state, _ = ref.allocate_slots(ref.initial_state(cfg), 1, first, 0, len(first))
    if data.draw(st.booleans()):
        state = ref.free(state, 1)
    tokens = first[:data.draw(st.integers(0, len(first)))] + [1000 + i for i in range(data.draw(st.integers(1, 8)))]
    hit = ref.get_computed_blocks(state, tokens)
    hb = hit.num_tokens // B
    assert hit.num_tokens == hb * B
    for g in cfg.groups:
        skipped = max(0, hit.num_tokens - W + 1) // B if g == ref.SWA else 0
        blocks = hit.blocks[g]
        assert len(blocks) == hb and ref.NULL_BLOCK not in blocks[skipped:], (g, blocks)
        evictable = sum(1 for x in blocks[skipped:] if state.ref_cnt[x] == 0)
        for num_tokens, capped in ((len(tokens), True), (len(tokens), False), (hit.num_tokens + 1, False)):
            cap = ref.max_admission_blocks_per_request(cfg, g) if capped else None
            term = spec.num_blocks_to_allocate_term(B, num_tokens, running=False, held=0, hit_blocks=hb,
                                                    skipped_blocks=skipped, evictable=evictable, cap=cap)
            want = ref.get_num_blocks_to_allocate(state, g, 2, num_tokens, blocks, hit.num_tokens, capped)
            assert value(term) == want, (g, num_tokens, capped)
    new = data.draw(st.integers(1, len(tokens) - hit.num_tokens))
    try:
        state, _ = ref.allocate_slots(state, 2, tokens, 0, new, hit)
    except OutOfMemory:
        return
    held = [len(x) for x in ref.get_block_ids(state, 2)]
    more = data.draw(st.integers(hit.num_tokens + new, 64))
    for g in cfg.groups:
        term = spec.num_blocks_to_allocate_term(B, more, running=True, held=held[g], hit_blocks=0, skipped_blocks=0,
                                                evictable=0)
        assert value(term) == ref.get_num_blocks_to_allocate(state, g, 2, more, (), hit.num_tokens + new)


@given(B=sizes, W=st.integers(2, 10), T=st.integers(1, 12), L=st.integers(1, 40), data=st.data())
def test_admits_alone_holds_on_the_reference(B: int, W: int, T: int, L: int, data: st.DataObject) -> None:
    """V8 on the reference, at the model's pool size: a request whose capped requirement fits N - 1 is admitted."""
    cfg = _config(B, W, L, T, N=spec.N_BLOCKS)
    ntok = data.draw(st.integers(1, L))
    new = data.draw(st.integers(1, min(T, ntok)))
    blocks = -(-ntok // B)
    cap = ref.max_admission_blocks_per_request(cfg, ref.SWA)
    assert cap is not None
    if blocks + min(blocks, cap) > spec.N_BLOCKS - 1:
        return
    state, _ = ref.allocate_slots(ref.initial_state(cfg), 0, list(range(ntok)), 0, new, None, True)
    ref.check_block_pool(state)


# ---- the twins' numbers through the reference -----------------------------------------------------------------


def test_gate_without_cap_twin_is_a_request_the_reference_admits() -> None:
    """#39734: the twin's request fits (the reference, with the cap, admits it); charged cdiv(len, B) twice it does
    not."""
    detail = result("block_pool.allocate_slots.admits_alone.gate_without_cap").detail
    x = numbers(detail)
    ntok, new = map(int, re.search(r"a request of (\d+) tokens .* first chunk (\d+)", detail).groups())
    cfg = _config(x["B"], x["W"], x["L"], x["T"], N=spec.N_BLOCKS)
    state, _ = ref.allocate_slots(ref.initial_state(cfg), 0, list(range(ntok)), 0, new, None, True)
    ref.check_block_pool(state)
    assert 2 * -(-ntok // x["B"]) > spec.N_BLOCKS - 1


def test_window_twin_releases_a_block_the_reference_keeps() -> None:
    x = numbers(result("block_pool.get_num_skipped_tokens.window_reads_kept.plus_two").detail)
    i = int(re.search(r"block (\d+) \(positions", result(
        "block_pool.get_num_skipped_tokens.window_reads_kept.plus_two").detail).group(1))
    cfg = _config(x["B"], x["W"], 64)
    assert i >= ref.get_num_skipped_tokens(cfg, ref.SWA, x["n"]) // x["B"]  # the reference keeps block i


def test_cap_twin_is_within_the_references_cap() -> None:
    x = numbers(result("block_pool.max_admission_blocks_per_request.bounds_real_held.no_plus_one").detail)
    cfg = _config(x["B"], x["W"], x["L"], x["T"])
    skipped = ref.get_num_skipped_tokens(cfg, ref.SWA, x["c"]) // x["B"]
    real = -(-(x["c"] + x["t"]) // x["B"]) - skipped
    cap = ref.max_admission_blocks_per_request(cfg, ref.SWA)
    assert cap is not None and real == cap  # exactly the + 1 the twin drops


def test_floor_twin_is_not_the_references_run() -> None:
    x = numbers(result("block_pool.contiguous_blocks_for_hit.run_is_window.floor").detail)
    need = ref.contiguous_blocks_for_hit(x["W"], x["B"])
    skipped = max(0, x["hb"] * x["B"] - x["W"] + 1) // x["B"]
    assert max(0, x["hb"] - need) == skipped != max(0, x["hb"] - (x["W"] - 1) // x["B"])


def test_duplicate_free_twin_is_a_no_op_on_the_reference() -> None:
    """vLLM pops the bookkeeping: a second free of the request frees nothing. Which counterexample Z3 returns depends
    on the terms the process created before (a pytest worker's earlier tests), so the twin is refuted in a fresh
    interpreter, where its counterexample is the one this test reads."""
    code = ("from kvproof.spec import block_pool, run; print(run(next(ob for ob in block_pool.OBLIGATIONS if ob.name"
            " == 'block_pool.free.keeps_invariant.duplicate_free')).detail)")
    trace = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                           check=True).stdout
    assert re.search(r"\| free\(req (\d)\)[^\n]*\n[^\n]*\| free\(req \1\)", trace), trace
    cfg = _config(2, 3, 16, N=spec.N_BLOCKS)
    state, _ = ref.allocate_slots(ref.initial_state(cfg), 1, list(range(4)), 0, 4)
    once = ref.free(state, 1)
    assert ref.free(once, 1) == once
    ref.check_block_pool(once)


# ---- non-vacuity ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("ops", "changes"), [
    (["allocate_slots"], True),
    (["allocate_slots", "free"], True),
    (["allocate_slots", "remove_skipped_blocks"], True),
    (["allocate_slots", "evict_blocks"], True),
    (["allocate_slots", "free", "reset_prefix_cache"], True),
    (["allocate_slots", "cache_blocks"], False),  # allocate_slots has cached what it computed already
    (["allocate_slots", "allocate_slots"], True),  # a second request joins the first one's cached prefix
])
def test_every_transition_is_enabled_from_a_reachable_state(ops: list[str], changes: bool) -> None:
    trace = _ts.witness(SYSTEM, ops, changes=changes)
    assert trace is not None, ops
    assert trace.ops()[1:] == ops


def _path(ops: tuple[str, ...]) -> tuple[_ts.Unrolling[spec.State, spec.Action], z3.Solver]:
    u = _ts.Unrolling.fresh(SYSTEM, len(ops))
    solver = z3.Solver()
    solver.add(*u.path(), *u.run(ops))
    return u, solver


def test_the_invariant_admits_shared_blocks_nulls_and_cached_free_blocks() -> None:
    """A reachable state where a hit shares a block (count 2), a SWA entry is the null block, a freed block keeps its
    key in the free queue: the proofs are about states like it."""
    u, solver = _path(("allocate_slots", "free", "allocate_slots", "allocate_slots"))
    last = u.states[-1]
    solver.add(z3.Or([x == 2 for x in last.ref]), z3.Or([g.nulls > 0 for q in last.reqs for g in q.groups]),
               z3.Or([z3.And(q, c) for q, c in zip(last.inq, last.cached, strict=True)]), SYSTEM.holds(last))
    assert solver.check() == z3.sat


def test_a_refused_call_is_reachable() -> None:
    """``allocate_slots`` returns None from a reachable state (the refusal obligations are not vacuous)."""
    u, solver = _path(("allocate_slots", "allocate_slots"))
    solver.add(z3.Not(u.actions[1].ok))
    assert solver.check() == z3.sat
