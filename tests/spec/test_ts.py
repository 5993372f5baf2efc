"""The transition-system kit ``kvproof.spec._ts`` on a toy system (sglang_semantics.md §7: the induction scheme).

A counter ``c`` with ops ``inc`` (``c < 3``: ``c + 1``) and ``reset`` (``c = 0``), and a
ghost flag ``dirty`` (``c > 0``). Its invariant ``0 <= c <= 3`` is inductive; a broken
``inc`` without the guard is not.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import z3

from kvproof.spec import _ts
from kvproof.spec._solver import Expect, Obligation, as_bool, as_int, run
from kvproof.spec._ts import Search, Step, Target, TransitionSystem, TransitionSystemError


@dataclass(frozen=True)
class Counter:
    c: z3.ArithRef
    dirty: z3.BoolRef

    @staticmethod
    def fresh(tag: str) -> Counter:
        return Counter(z3.Int(f"c@{tag}"), z3.Bool(f"dirty@{tag}"))


@dataclass(frozen=True)
class By:
    amount: z3.ArithRef

    @staticmethod
    def fresh(tag: str) -> By:
        return By(z3.Int(f"amount@{tag}"))


def inc(s: Counter, a: By, t: Counter) -> z3.BoolRef:
    return z3.And(s.c < 3, a.amount == 1, t.c == s.c + a.amount, t.dirty)


def inc_unguarded(s: Counter, a: By, t: Counter) -> z3.BoolRef:
    return z3.And(a.amount == 1, t.c == s.c + a.amount, t.dirty)


def reset(s: Counter, a: By, t: Counter) -> z3.BoolRef:
    return z3.And(t.c == 0, *_ts.unchanged(s, t, "dirty"))


def cells(model: z3.ModelRef, s: Counter) -> tuple[str, ...]:
    return str(as_int(model, s.c)), "dirty" if as_bool(model, s.dirty) else ""


SYSTEM: TransitionSystem[Counter, By] = TransitionSystem(
    component="toy", state=Counter.fresh, action=By.fresh, init=lambda s: z3.And(s.c == 0, z3.Not(s.dirty)),
    transitions={"inc": inc, "reset": reset},
    invariant=lambda s: [("c >= 0", s.c >= 0), ("c <= 3", s.c <= 3)],
    columns=("c", "flag"), cells=cells,
    step_columns=("by",), step_cells=lambda m, step: (str(as_int(m, step.action.amount)),),
    describe=lambda m, step: f"{step.op_name(m)}({as_int(m, step.action.amount)})",
)
BROKEN = SYSTEM.with_transitions(inc=inc_unguarded)
AT_FOUR: Target[Counter, By] = Target("c reaches 4", lambda step: step.post.c == 4)


def _verdict(check: _ts.Check, expect: Expect = "proved") -> str:
    result = run(Obligation("toy.x", "toy", "toy", "a toy claim", expect, check.build, check.render))
    return f"{result.status}\n{result.detail}"


def test_induction_proves_the_invariant_and_refutes_the_broken_step() -> None:
    assert _verdict(_ts.initiation(SYSTEM)).startswith("proved")
    assert _verdict(_ts.consecution(SYSTEM)).startswith("proved")
    assert _verdict(_ts.consecution(SYSTEM, ("reset",))).startswith("proved")
    broken = _verdict(_ts.consecution(BROKEN, ("inc",)), "counterexample")
    assert broken.startswith("counterexample")
    assert "(any invariant state)" in broken and "broken after step 1: c <= 3" in broken
    assert "inc(1)" in broken


def test_bmc_finds_the_shortest_run_and_renders_it_as_a_table() -> None:
    assert _ts.find_trace(SYSTEM, AT_FOUR, 6) is None
    trace = _ts.find_trace(BROKEN, AT_FOUR, 6)
    assert trace is not None
    assert trace.ops() == ["init", "inc", "inc", "inc", "inc"]
    assert trace.violation == "step 4: c reaches 4"
    assert [row.values["c"] for row in trace.rows] == [0, 1, 2, 3, 4]
    header = trace.table().splitlines()[0]
    assert header.split(" | ") == ["step", "op(arguments)", "by", "c", "flag"]
    first = [cell.strip() for cell in trace.table().splitlines()[2].split(" | ")]
    assert first[:3] == ["0", "init", "-"], "no step led to the first state"


def test_reachable_and_bounded_checks() -> None:
    assert _verdict(_ts.reachable(BROKEN, AT_FOUR, 4), "counterexample").startswith("counterexample")
    assert _verdict(_ts.reachable(BROKEN, AT_FOUR, 5, any_step=True), "counterexample").startswith("counterexample")
    assert _verdict(_ts.reachable(BROKEN, AT_FOUR, 6, shortest=True), "counterexample").startswith("counterexample")
    assert _verdict(_ts.bounded(SYSTEM, AT_FOUR, 5)).startswith("proved")


def test_a_column_empty_in_every_row_is_left_out() -> None:
    trace = _ts.witness(SYSTEM, ["reset", "reset"])
    assert trace is not None
    assert "flag" not in trace.table() and trace.ops() == ["init", "reset", "reset"]
    assert _ts.witness(SYSTEM, ["reset"], changes=True) is None, "reset from the initial state changes nothing"


def test_search_narrows_the_runs() -> None:
    only_reset: Search[Counter, By] = Search(("reset",))
    assert _ts.find_trace(BROKEN, AT_FOUR, 5, search=only_reset) is None
    small: Search[Counter, By] = Search(facts=lambda step: [step.post.c <= 2])
    assert _ts.find_trace(BROKEN, AT_FOUR, 5, search=small) is None


def test_accepts_a_concrete_pair_and_names_the_conflict() -> None:
    def at(c: int, dirty: bool) -> Callable[[Counter], list[z3.BoolRef]]:
        return lambda s: [s.c == c, s.dirty == dirty]

    assert _ts.accepts(SYSTEM, "inc", at(1, True), at(2, True)).accepted
    assert _ts.accepts(SYSTEM, "reset", at(2, True), at(0, True), lambda a: [a.amount == 7]).accepted
    verdict = _ts.accepts(SYSTEM, "inc", at(3, True), at(4, True))
    assert verdict.status == "rejected" and "transition" in verdict.conflict
    assert "pre: c@pre == 3" in str(verdict)
    assert not _ts.accepts(SYSTEM, "reset", at(2, False), at(0, True)).accepted, "reset keeps the flag"


def test_misuse_raises_typed_errors() -> None:
    with pytest.raises(TransitionSystemError, match="no transition 'dec'"):
        SYSTEM.code("dec")
    with pytest.raises(TransitionSystemError, match="empty set of ops"):
        SYSTEM.select(())
    with pytest.raises(TransitionSystemError, match="no fields"):
        _ts.unchanged(Counter.fresh("a"), Counter.fresh("b"), "d")
    with pytest.raises(TransitionSystemError, match="at least one transition"):
        TransitionSystem("toy", Counter.fresh, By.fresh, lambda s: z3.BoolVal(True), {})
    with pytest.raises(TransitionSystemError, match="2 ops for an unrolling of depth 1"):
        _ts.Unrolling.fresh(SYSTEM, 1).run(["inc", "inc"])


def test_frames_and_steps() -> None:
    s, t = Counter.fresh("a"), Counter.fresh("b")
    assert [str(f) for f in _ts.unchanged_except(s, t, "c")] == ["dirty@a == dirty@b"]
    step = Step.fresh(SYSTEM)
    assert str(step.op) == "op@step" and SYSTEM.ops == ("inc", "reset")
    solver = z3.Solver()
    solver.add(step.relation(("reset",)), step.pre.c == 2)
    assert solver.check() == z3.sat and step.op_name(solver.model()) == "reset"
    assert _ts.Unrolling.depth_of(solver.model()) == 0


def test_combine_agrees_catches_a_combined_step_that_changes_a_transition() -> None:
    """A model's cheaper ``combine`` must equal each op's own relation; the kit's check refutes one that does not."""
    def combine(step: Step[Counter, By], ops: tuple[str, ...]) -> z3.BoolRef:
        return z3.Or([z3.And(step.is_(op), SYSTEM.transitions[op](step.pre, step.action, step.post)) for op in ops])

    def combine_unguarded(step: Step[Counter, By], ops: tuple[str, ...]) -> z3.BoolRef:
        broken = {"inc": inc_unguarded, "reset": reset}
        return z3.Or([z3.And(step.is_(op), broken[op](step.pre, step.action, step.post)) for op in ops])

    good = dataclasses.replace(SYSTEM, combine=combine)
    bad = dataclasses.replace(SYSTEM, combine=combine_unguarded)
    assert all(_ts.combine_agrees(good, op) for op in good.ops)
    assert not _ts.combine_agrees(bad, "inc") and _ts.combine_agrees(bad, "reset")


def test_has_successor_says_whether_the_model_lets_a_call_happen() -> None:
    def at(value: int) -> Callable[[Counter], list[tuple[z3.ExprRef, z3.ExprRef]]]:
        return lambda s: [(s.c, z3.IntVal(value)), (s.dirty, z3.BoolVal(value > 0))]

    assert _ts.has_successor(SYSTEM, "inc", at(2))
    assert not _ts.has_successor(SYSTEM, "inc", at(3))  # the guard: c < 3
    assert _ts.has_successor(SYSTEM, "reset", at(3))
