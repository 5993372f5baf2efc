"""The transition-system kit every spec model shares (sglang_semantics.md §7 invariants, §9 scenarios).

A model of a component is one :class:`TransitionSystem` value: how to make a fresh
copy of its state and of an action's arguments, the initial states, one relation per
operation **named exactly like the reference function** (``alloc_extend``,
``free_swa`` ...), the named clauses of its inductive invariant, and how to render a
state and a step. Everything generic lives here, written once:

* :class:`Step` / :class:`Unrolling` — one step ``pre --op(action)--> post``, and a
  path of ``depth`` steps from the initial states. The operation of a step is a Z3
  integer the kit owns (``op@<tag>``, the index of the op in
  :attr:`TransitionSystem.ops`); :meth:`Step.is_` says "this step performs ``op``".
  A :class:`Search` narrows the runs (some ops only, extra facts per step).
* bounded model checking towards a :class:`Target` (something that goes wrong in a
  step): :func:`bmc` (exactly ``depth`` steps), :func:`shortest_bmc` (iterative
  deepening with one incremental solver), :func:`find_trace`, and :func:`witness`
  (non-vacuity: a run doing exactly the given ops);
* induction: :func:`initiation`, :func:`consecution` (over all ops or some),
  :func:`safety`, :func:`bounded` and :func:`reachable` build :class:`Check` values
  (facts whose conjunction is UNSAT iff the claim holds, plus a renderer), and
  :func:`obligation` names them ``<component>.<suffix>``;
* :class:`Trace` — every counterexample is a step table (one row per state, the
  call that led to it, columns from the system's ``cells``), never a model dump;
* :func:`accepts` — drift tests: does the transition ``op`` relate a concrete
  pre-state to a concrete post-state? (solved in a fresh context; a rejection names
  the facts that conflict, from the solver's unsat core).

Frame conditions are explicit: a relation states every field of the post-state,
usually with :func:`unchanged` / :func:`unchanged_except` for the fields it does not
write. The kit imports z3 and the standard library only (``kvproof.spec`` is a leaf).

Cost: a step over several ops is by default the disjunction of their relations. A
model may pass ``combine`` to build that step more cheaply (ops sharing one formula,
or effect-style ops ``(guard, post-state terms)`` sharing one frame of ``If`` chains);
it must agree with ``transitions`` op by op (test it), and single-op steps always use
``transitions[op]``. :meth:`TransitionSystem.with_transitions` swaps a relation (a
twin's broken op); :meth:`Check.also` adds facts (a twin's readability pins, or a
lemma another obligation proves).

A minimal system::

    SYSTEM = TransitionSystem(
        component="swa_allocator", state=State.fresh, action=Action.fresh, init=init,
        transitions={"alloc": alloc, "free": free}, invariant=invariant_clauses,
        columns=("free pages",), cells=cells, describe=describe)
    OBLIGATIONS = (obligation(SYSTEM, "no_leak.consecution", "...", consecution(SYSTEM), family="..."), ...)
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, SupportsInt, TypeVar

import z3

from kvproof.spec._solver import Obligation, as_bool, as_int

__all__ = [
    "EVERYTHING",
    "Acceptance",
    "Check",
    "Clause",
    "Relation",
    "Search",
    "Step",
    "Target",
    "Trace",
    "TraceRow",
    "TransitionSystem",
    "TransitionSystemError",
    "Unrolling",
    "accepts",
    "accepts_pinned",
    "bmc",
    "bounded",
    "combine_agrees",
    "consecution",
    "evaluate",
    "find_trace",
    "first_broken",
    "has_successor",
    "initiation",
    "invariant_broken",
    "literal",
    "obligation",
    "reachable",
    "relation",
    "safety",
    "shortest_bmc",
    "step_table",
    "terms_of",
    "trace_of",
    "unchanged",
    "unchanged_except",
    "witness",
]

S = TypeVar("S")
A = TypeVar("A")

#: One named clause of an invariant: ``("M1: M[4] is 0 or a real SWA slot", term)``.
Clause = tuple[str, z3.BoolRef]
#: A transition relation ``relation(pre, action, post)``: its guard and every post-state field.
Relation = Callable[[S, A, S], z3.BoolRef]

OP = "op"  # the kit's op variables are named op@<tag>; an action must not define its own "op@..." variables


class TransitionSystemError(Exception):
    """A transition system used wrongly: an unknown op, an empty search, a state that is no dataclass."""


# ---- terms and frames --------------------------------------------------------------------------------------


def literal(value: SupportsInt) -> z3.ExprRef:
    """A concrete value as a Z3 literal: a ``bool`` as a Boolean, anything else as an integer (``int(value)``)."""
    return z3.BoolVal(value) if isinstance(value, bool) else z3.IntVal(int(value))


def terms_of(value: object) -> list[z3.ExprRef]:
    """Every Z3 term inside ``value``: a term, or a dataclass / tuple / list of them (nested), in field order."""
    if isinstance(value, z3.ExprRef):
        return [value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [t for f in dataclasses.fields(value) for t in terms_of(getattr(value, f.name))]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in terms_of(item)]
    return []


def _fields(value: object) -> list[str]:
    if not (dataclasses.is_dataclass(value) and not isinstance(value, type)):
        raise TransitionSystemError(f"frame conditions need a dataclass state, got {type(value).__name__}")
    return [f.name for f in dataclasses.fields(value)]


def unchanged(pre: object, post: object, *names: str) -> list[z3.BoolRef]:
    """Frame conditions: the named fields of ``post`` equal those of ``pre`` (identical terms skipped)."""
    known = _fields(pre)
    unknown = [name for name in names if name not in known]
    if unknown:
        raise TransitionSystemError(f"{type(pre).__name__} has no fields {unknown}; it has {known}")
    out: list[z3.BoolRef] = []
    for name in names:
        for a, b in zip(terms_of(getattr(pre, name)), terms_of(getattr(post, name)), strict=True):
            if not a.eq(b):
                out.append(a == b)
    return out


def unchanged_except(pre: object, post: object, *written: str) -> list[z3.BoolRef]:
    """Frame conditions for every field but the ``written`` ones."""
    names = _fields(pre)
    unknown = [name for name in written if name not in names]
    if unknown:
        raise TransitionSystemError(f"{type(pre).__name__} has no fields {unknown}; it has {names}")
    return unchanged(pre, post, *[name for name in names if name not in written])


def _is_variable(term: z3.ExprRef) -> bool:
    return bool(z3.is_const(term) and term.decl().kind() == z3.Z3_OP_UNINTERPRETED)


def _plain_name(term: z3.ExprRef) -> str:
    """A variable's name without its ``@tag``: ``M_4@3`` -> ``M_4``."""
    return str(term.decl().name()).split("@", 1)[0]


# ---- the system --------------------------------------------------------------------------------------------


def _no_clauses(state: Any) -> Sequence[Clause]:
    return ()


def _no_cells(model: z3.ModelRef, state: Any) -> tuple[str, ...]:
    return ()


def _no_step_cells(model: z3.ModelRef, step: Step[Any, Any]) -> tuple[str, ...]:
    return ()


def _op_only(model: z3.ModelRef, step: Step[Any, Any]) -> str:
    return f"{step.op_name(model)}()"


@dataclass(frozen=True)
class TransitionSystem(Generic[S, A]):
    """A component's model: state, actions, initial states, one relation per reference op, invariant, rendering.

    * ``state(tag)`` / ``action(tag)`` make fresh copies whose variables carry ``@tag``;
    * ``init(s)`` holds for the initial states (the reference's ``initial_state``);
    * ``transitions[op](pre, action, post)``: ``op`` enabled in ``pre`` with these
      arguments and ``post`` is its result; keys are the reference function names;
    * ``invariant(s)``: named clauses of the inductive invariant (empty: none);
    * ``columns`` / ``cells(model, s)``: a state as table cells (a cell that is ``""``
      in every row of a trace drops its column);
    * ``describe(model, step)``: the call of a step with its arguments and effect;
    * ``step_columns`` / ``step_cells(model, step)``: optional cells about the step
      itself (what it read, say), shown between the call and the state after it;
    * ``combine(step, ops)``: optional; the step relation over several ops at once
      (e.g. one shared frame with ``If`` chains), by default the disjunction of the
      relations; must agree with ``transitions`` op by op.
    """

    component: str
    state: Callable[[str], S]
    action: Callable[[str], A]
    init: Callable[[S], z3.BoolRef]
    transitions: Mapping[str, Callable[[S, A, S], z3.BoolRef]]
    invariant: Callable[[S], Sequence[Clause]] = _no_clauses
    columns: tuple[str, ...] = ()
    cells: Callable[[z3.ModelRef, S], tuple[str, ...]] = _no_cells
    describe: Callable[[z3.ModelRef, Step[S, A]], str] = _op_only
    step_columns: tuple[str, ...] = ()
    step_cells: Callable[[z3.ModelRef, Step[S, A]], tuple[str, ...]] = _no_step_cells
    combine: Callable[[Step[S, A], tuple[str, ...]], z3.BoolRef] | None = None

    def __post_init__(self) -> None:
        if not self.transitions:
            raise TransitionSystemError(f"{self.component}: a transition system needs at least one transition")

    @property
    def ops(self) -> tuple[str, ...]:
        """The op names in encoding order (the kit's op variable holds the index)."""
        return tuple(self.transitions)

    def code(self, op: str) -> int:
        """The encoding of ``op``; :class:`TransitionSystemError` for an op the system lacks."""
        try:
            return self.ops.index(op)
        except ValueError:
            raise TransitionSystemError(f"{self.component} has no transition {op!r}; it has {list(self.ops)}") from None

    def select(self, ops: Iterable[str] | None) -> tuple[str, ...]:
        """``ops`` checked against the system, in encoding order (``None``: all)."""
        if ops is None:
            return self.ops
        wanted = set(ops)
        for op in wanted:
            self.code(op)
        if not wanted:
            raise TransitionSystemError(f"{self.component}: an empty set of ops allows no step")
        return tuple(op for op in self.ops if op in wanted)

    def holds(self, s: S) -> z3.BoolRef:
        """The conjunction of the invariant's clauses."""
        return z3.And([clause for _, clause in self.invariant(s)])

    def variables(self, s: S) -> list[z3.ExprRef]:
        """The state's variables (constants such as a reserved page's fixed fields excluded)."""
        return [t for t in terms_of(s) if _is_variable(t)]

    def with_transitions(self, **replaced: Callable[[S, A, S], z3.BoolRef]) -> TransitionSystem[S, A]:
        """The same system with some relations replaced (a twin's broken op, a drift test's wrong one)."""
        for op in replaced:
            self.code(op)
        return dataclasses.replace(self, transitions={**self.transitions, **replaced}, combine=None)


# ---- steps, searches, unrollings ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Step(Generic[S, A]):
    """Step ``index`` (0-based) of a path: ``pre --op(action)--> post``, the op chosen by the variable ``op``."""

    system: TransitionSystem[S, A]
    index: int
    pre: S
    action: A
    post: S
    op: z3.ArithRef

    @staticmethod
    def fresh(system: TransitionSystem[S, A], pre: str = "pre", action: str = "step", post: str = "post",
              index: int = 0) -> Step[S, A]:
        """A single step between fresh states (induction queries use the default tags)."""
        return Step(system, index, system.state(pre), system.action(action), system.state(post),
                    z3.Int(f"{OP}@{action}"))

    def is_(self, op: str) -> z3.BoolRef:
        """This step performs ``op``."""
        return self.op == self.system.code(op)

    def performs(self, ops: Iterable[str]) -> z3.BoolRef:
        """This step performs one of ``ops``."""
        return z3.Or([self.is_(op) for op in ops])

    def relation(self, ops: Iterable[str] | None = None) -> z3.BoolRef:
        """The step performs one of ``ops`` (default: any) and ``post`` is its result."""
        allowed = self.system.select(ops)
        if self.system.combine is not None and len(allowed) > 1:
            return z3.And(self.performs(allowed), self.system.combine(self, allowed))
        return z3.Or([z3.And(self.is_(op), self.system.transitions[op](self.pre, self.action, self.post))
                      for op in allowed])

    def op_name(self, model: z3.ModelRef) -> str:
        code = as_int(model, self.op)
        ops = self.system.ops
        return ops[code] if 0 <= code < len(ops) else f"<op {code}>"


def _no_facts(step: Step[Any, Any]) -> Sequence[z3.BoolRef]:
    return ()


@dataclass(frozen=True)
class Search(Generic[S, A]):
    """Which runs a query explores: the allowed ops (``None``: all) and extra facts per step.

    Counterexamples need only *some* run, so a twin may narrow its search (fewer ops,
    symmetry breaking, small arguments): every run found is a run of the full system.
    """

    ops: tuple[str, ...] | None = None
    facts: Callable[[Step[S, A]], Sequence[z3.BoolRef]] = _no_facts

    def step_facts(self, step: Step[S, A]) -> list[z3.BoolRef]:
        return [step.relation(self.ops), *self.facts(step)]


EVERYTHING: Search[Any, Any] = Search()


@dataclass(frozen=True)
class Unrolling(Generic[S, A]):
    """``depth`` steps: states ``s_0..s_depth`` (tags ``0..depth``), actions and op variables (tags ``0..depth-1``)."""

    system: TransitionSystem[S, A]
    states: tuple[S, ...]
    actions: tuple[A, ...]
    ops: tuple[z3.ArithRef, ...]

    @staticmethod
    def fresh(system: TransitionSystem[S, A], depth: int) -> Unrolling[S, A]:
        return Unrolling(system, tuple(system.state(str(i)) for i in range(depth + 1)),
                         tuple(system.action(str(i)) for i in range(depth)),
                         tuple(z3.Int(f"{OP}@{i}") for i in range(depth)))

    @staticmethod
    def depth_of(model: z3.ModelRef) -> int:
        """The depth of the unrolling a model came from (its ``op@<i>`` variables)."""
        found = {int(m.group(1)) for d in model.decls() if (m := re.fullmatch(rf"{OP}@(\d+)", d.name()))}
        return max(found) + 1 if found else 0

    @property
    def depth(self) -> int:
        return len(self.actions)

    def step(self, i: int) -> Step[S, A]:
        return Step(self.system, i, self.states[i], self.actions[i], self.states[i + 1], self.ops[i])

    def steps(self) -> list[Step[S, A]]:
        return [self.step(i) for i in range(self.depth)]

    def path(self, search: Search[S, A] = EVERYTHING, *, start: Callable[[S], z3.BoolRef] | None = None
             ) -> list[z3.BoolRef]:
        """``start(s_0)`` (default: ``init``) and every step within ``search``."""
        first = (start or self.system.init)(self.states[0])
        return [first, *[f for step in self.steps() for f in search.step_facts(step)]]

    def run(self, ops: Sequence[str]) -> list[z3.BoolRef]:
        """Step ``i`` performs ``ops[i]`` (one op per step)."""
        if len(ops) != self.depth:
            raise TransitionSystemError(f"{len(ops)} ops for an unrolling of depth {self.depth}")
        return [step.is_(op) for step, op in zip(self.steps(), ops, strict=True)]


# ---- targets and bounded model checking --------------------------------------------------------------------


@dataclass(frozen=True)
class Target(Generic[S, A]):
    """What a BMC query looks for: ``bad(step)`` holds when that step goes wrong; ``explain`` says how, in words."""

    what: str
    bad: Callable[[Step[S, A]], z3.BoolRef]
    explain: Callable[[z3.ModelRef, Step[S, A]], str] | None = None

    def explanation(self, model: z3.ModelRef, step: Step[S, A]) -> str:
        if self.explain is not None:
            return self.explain(model, step)
        return f"step {step.index + 1}: {self.what}"


def first_broken(system: TransitionSystem[S, A], model: z3.ModelRef, s: S) -> str:
    """The name of the first invariant clause ``model`` breaks in ``s``."""
    broken = [name for name, clause in system.invariant(s) if not as_bool(model, clause)]
    return broken[0] if broken else "(no clause broken)"


def invariant_broken(system: TransitionSystem[S, A]) -> Target[S, A]:
    """The step's post-state breaks the invariant (a BMC form of consecution, for readable twins)."""
    return Target("invariant broken", lambda step: z3.Not(system.holds(step.post)),
                  lambda m, step: f"broken after step {step.index + 1}: {first_broken(system, m, step.post)}")


def bmc(system: TransitionSystem[S, A], target: Target[S, A], depth: int, *, search: Search[S, A] = EVERYTHING,
        any_step: bool = False) -> list[z3.BoolRef]:
    """A run of exactly ``depth`` steps from ``init`` whose last step (or, with ``any_step``, some step) goes wrong.

    ``any_step`` covers shorter runs only if every state has an enabled step in ``search``.
    """
    u = Unrolling.fresh(system, depth)
    steps = u.steps()
    bad = z3.Or([target.bad(s) for s in steps]) if any_step else target.bad(steps[-1])
    return [*u.path(search), bad]


def shortest_bmc(system: TransitionSystem[S, A], target: Target[S, A], max_depth: int, *,
                 search: Search[S, A] = EVERYTHING, timeout_ms: int = 20_000) -> list[z3.BoolRef]:
    """Iterative deepening: the facts of the shortest run (<= ``max_depth`` steps) whose last step hits ``target``.

    One incremental solver, in a fresh context (see :func:`kvproof.spec._solver.run`),
    extends the path a step at a time. When no depth is satisfiable the deepest facts
    come back and ``run`` reports them proved (contradicting a twin's expectation); an
    ``unknown`` depth stops the search there and ``run`` reports the unknown.
    """
    u = Unrolling.fresh(system, max_depth)
    ctx = z3.Context()
    solver = z3.Solver(ctx=ctx)
    solver.set(timeout=timeout_ms)
    facts = [system.init(u.states[0])]
    solver.add(facts[0].translate(ctx))
    bad: z3.BoolRef = z3.BoolVal(False)
    for step in u.steps():
        step_facts = search.step_facts(step)
        facts += step_facts
        solver.add(*(f.translate(ctx) for f in step_facts))
        bad = target.bad(step)
        solver.push()
        solver.add(bad.translate(ctx))
        verdict = solver.check()
        solver.pop()
        if verdict != z3.unsat:
            break
    return [*facts, bad]


def find_trace(system: TransitionSystem[S, A], target: Target[S, A], max_depth: int, *,
               search: Search[S, A] = EVERYTHING) -> Trace | None:
    """The shortest run (within ``search``) reaching ``target`` in ``max_depth`` steps, or None."""
    solver = z3.Solver()
    solver.add(*shortest_bmc(system, target, max_depth, search=search))
    if solver.check() != z3.sat:
        return None
    return trace_of(system, solver.model(), target)


def witness(system: TransitionSystem[S, A], ops: Sequence[str], *, search: Search[S, A] = EVERYTHING,
            changes: bool = False) -> Trace | None:
    """A run performing exactly ``ops`` from ``init`` (non-vacuity), or None.

    ``search.facts`` constrain every step (its ``ops`` are ignored: ``ops`` decide);
    with ``changes`` every step must change the state.
    """
    u = Unrolling.fresh(system, len(ops))
    facts: list[z3.BoolRef] = [system.init(u.states[0]), *u.run(ops)]
    for step, op in zip(u.steps(), ops, strict=True):
        facts += [step.relation((op,)), *search.facts(step)]
        if changes:
            pre, post = system.variables(step.pre), system.variables(step.post)
            facts.append(z3.Or([x != y for x, y in zip(pre, post, strict=True)]))
    solver = z3.Solver()
    solver.add(*facts)
    if solver.check() != z3.sat:
        return None
    return trace_of(system, solver.model())


# ---- traces ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceRow:
    """One row of a trace: the call of a step, its own cells and the state after it (``cells``: the system's
    step cells, then its state cells).

    ``values`` holds the state's variables by name without their ``@tag`` (for tests:
    ``row.values["swa_free_2"]``).
    """

    step: int
    op: str
    call: str
    cells: tuple[str, ...]
    values: Mapping[str, int | bool] = field(default_factory=dict)


@dataclass(frozen=True)
class Trace:
    """A concrete run; ``violation`` says what went wrong at its last step."""

    columns: tuple[str, ...]
    rows: tuple[TraceRow, ...]
    violation: str = ""

    def ops(self) -> list[str]:
        return [row.op for row in self.rows]

    def table(self) -> str:
        """The run as an aligned text table; a column whose cells are all ``""`` is left out."""
        kept = [i for i in range(len(self.columns)) if any(row.cells[i] for row in self.rows)]
        header = ("step", "op(arguments)", *(self.columns[i] for i in kept))
        cells = [header] + [(str(r.step), r.call, *(r.cells[i] or "-" for i in kept)) for r in self.rows]
        widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
        lines = [" | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
        lines.insert(1, "-+-".join("-" * w for w in widths))
        return "\n".join(lines + ([self.violation] if self.violation else []))


def _values(system: TransitionSystem[S, A], model: z3.ModelRef, s: S) -> dict[str, int | bool]:
    out: dict[str, int | bool] = {}
    for term in system.variables(s):
        out[_plain_name(term)] = as_bool(model, term) if z3.is_bool(term) else as_int(model, term)
    return out


def _columns(system: TransitionSystem[Any, Any]) -> tuple[str, ...]:
    return (*system.step_columns, *system.columns)


def _start(system: TransitionSystem[S, A], model: z3.ModelRef, s: S, label: str) -> TraceRow:
    """The row of a run's first state (no step led to it)."""
    blank = ("",) * len(system.step_columns)
    return TraceRow(0, label, label, (*blank, *system.cells(model, s)), _values(system, model, s))


def _row(system: TransitionSystem[S, A], model: z3.ModelRef, step: Step[S, A]) -> TraceRow:
    """The row of a step: its call, its own cells, and the state after it."""
    cells = (*system.step_cells(model, step), *system.cells(model, step.post))
    return TraceRow(step.index + 1, step.op_name(model), system.describe(model, step), cells,
                    _values(system, model, step.post))


def trace_of(system: TransitionSystem[S, A], model: z3.ModelRef, target: Target[S, A] | None = None, *,
             start: str = "init") -> Trace:
    """The run in a model of an :class:`Unrolling`'s facts, up to the first step where ``target`` goes wrong."""
    u = Unrolling.fresh(system, Unrolling.depth_of(model))
    rows = [_start(system, model, u.states[0], start)]
    for step in u.steps():
        rows.append(_row(system, model, step))
        if target is not None and as_bool(model, target.bad(step)):
            return Trace(_columns(system), tuple(rows), target.explanation(model, step))
    return Trace(_columns(system), tuple(rows))


def step_table(system: TransitionSystem[S, A], model: z3.ModelRef, step: Step[S, A], verdict: str, *,
               start: str = "(any invariant state)") -> str:
    """A single step from an arbitrary state as a two-row table, with the verdict under it."""
    rows = (_start(system, model, step.pre, start), _row(system, model, step))
    return Trace(_columns(system), rows, verdict).table()


# ---- checks: induction and BMC as solver facts ------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    """Facts whose conjunction is UNSAT exactly when a claim holds, and how a model of them reads.

    The single-step checks name their states ``pre`` / ``post`` (action ``step``), the
    path checks ``0 .. depth`` (see :class:`Step`, :class:`Unrolling`).
    """

    build: Callable[[], Sequence[z3.BoolRef]]
    render: Callable[[z3.ModelRef], str]

    def also(self, facts: Callable[[], Sequence[z3.BoolRef]]) -> Check:
        """The same check with more facts. For a twin: facts that pin what its counterexample does not need (any
        counterexample refutes a twin, so narrowing never changes its verdict). For a proof: only a lemma another
        obligation proves (compositional, say so in the statement), never an assumption."""
        build = self.build
        return Check(lambda: [*build(), *facts()], self.render)


def initiation(system: TransitionSystem[S, A]) -> Check:
    """Every initial state satisfies the invariant."""

    def build() -> list[z3.BoolRef]:
        s = system.state("0")
        return [system.init(s), z3.Not(system.holds(s))]

    def render(model: z3.ModelRef) -> str:
        s = system.state("0")
        row = _start(system, model, s, "init")
        return Trace(_columns(system), (row,), f"broken: {first_broken(system, model, s)}").table()

    return Check(build, render)


def consecution(system: TransitionSystem[S, A], ops: Iterable[str] | None = None) -> Check:
    """Every step (among ``ops``) from a state satisfying the invariant leads to one satisfying it."""
    allowed = system.select(ops)

    def build() -> list[z3.BoolRef]:
        step = Step.fresh(system)
        return [system.holds(step.pre), step.relation(allowed), z3.Not(system.holds(step.post))]

    def render(model: z3.ModelRef) -> str:
        step = Step.fresh(system)
        return step_table(system, model, step, f"broken after step 1: {first_broken(system, model, step.post)}")

    return Check(build, render)


def safety(system: TransitionSystem[S, A], safe: Callable[[Step[S, A]], z3.BoolRef],
           explain: Callable[[z3.ModelRef, Step[S, A]], str], ops: Iterable[str] | None = None, *,
           start: str = "(any invariant state)") -> Check:
    """No step (among ``ops``) from a state satisfying the invariant is unsafe (``start`` labels that state)."""
    allowed = system.select(ops)

    def build() -> list[z3.BoolRef]:
        step = Step.fresh(system)
        return [system.holds(step.pre), step.relation(allowed), z3.Not(safe(step))]

    def render(model: z3.ModelRef) -> str:
        step = Step.fresh(system)
        return step_table(system, model, step, explain(model, step), start=start)

    return Check(build, render)


def bounded(system: TransitionSystem[S, A], target: Target[S, A], depth: int, *,
            search: Search[S, A] = EVERYTHING) -> Check:
    """No run of ``depth`` steps from ``init`` (within ``search``) goes wrong at any step (BMC)."""
    return Check(lambda: bmc(system, target, depth, search=search, any_step=True),
                 lambda model: trace_of(system, model, target).table())


def reachable(system: TransitionSystem[S, A], target: Target[S, A], depth: int, *,
              search: Search[S, A] = EVERYTHING, any_step: bool = False, shortest: bool = False) -> Check:
    """``target`` is unreachable in ``depth`` steps from ``init``; a twin expects a run that reaches it.

    By default one query: a run of exactly ``depth`` steps whose last step goes wrong
    (choose ``depth`` as the length of the run the twin is about). ``any_step``: some
    step of the run goes wrong (the trace is cut there; slower). ``shortest``: deepen
    one step at a time (:func:`shortest_bmc`), which first proves every shorter depth
    unsatisfiable and can cost far more.
    """
    if shortest:
        return Check(lambda: shortest_bmc(system, target, depth, search=search),
                     lambda model: trace_of(system, model, target).table())
    return Check(lambda: bmc(system, target, depth, search=search, any_step=any_step),
                 lambda model: trace_of(system, model, target).table())


def obligation(system: TransitionSystem[Any, Any], suffix: str, statement: str, check: Check, *, family: str,
               twin_of: str | None = None) -> Obligation:
    """``<component>.<suffix>``; a twin (``twin_of`` = its sound obligation's suffix) expects a counterexample."""
    component = system.component
    return Obligation(
        name=f"{component}.{suffix}", component=component, family=family, statement=statement,
        expect="proved" if twin_of is None else "counterexample", build=check.build, render=check.render,
        twin_of=None if twin_of is None else f"{component}.{twin_of}",
    )


# ---- drift: does a transition accept a concrete pair? ------------------------------------------------------


@dataclass(frozen=True)
class Acceptance:
    """The verdict of :func:`accepts`: ``accepted``, or the facts the transition cannot satisfy together."""

    op: str
    status: Literal["accepted", "rejected", "unknown"]
    conflict: tuple[str, ...] = ()

    @property
    def accepted(self) -> bool:
        return self.status == "accepted"

    def __str__(self) -> str:
        if self.accepted:
            return f"{self.op}: accepted"
        if self.status == "unknown":
            return f"{self.op}: solver returned unknown"
        return f"{self.op} rejects the pair; conflicting facts: " + "; ".join(self.conflict)


Pins = Sequence[tuple[z3.ExprRef, z3.ExprRef]]
_RELATIONS: dict[tuple[int, str], tuple[Any, Any, Any, Any, z3.BoolRef]] = {}


def relation(system: TransitionSystem[S, A], op: str) -> tuple[S, A, S, z3.BoolRef]:
    """``transitions[op]`` over fresh ``pre`` / ``act`` / ``post`` copies, built once per system and op."""
    key = (id(system), op)
    if key not in _RELATIONS:
        system.code(op)
        s, a, t = system.state("pre"), system.action("act"), system.state("post")
        _RELATIONS[key] = (system, s, a, t, system.transitions[op](s, a, t))  # the system keeps its id taken
    _, s, a, t, rel = _RELATIONS[key]
    return s, a, t, rel


def has_successor(system: TransitionSystem[S, A], op: str, pre: Callable[[S], Pins],
                  action: Callable[[A], Pins] | None = None) -> bool:
    """Some post-state satisfies ``transitions[op]`` from the pinned pre-state (and action): the model lets the
    call happen. A drift test expects none for a call the reference rejects."""
    s, a, _, rel = relation(system, op)
    solver = z3.Solver()
    solver.add(z3.substitute(rel, *pre(s), *(action(a) if action is not None else ())))
    return bool(solver.check() == z3.sat)


def combine_agrees(system: TransitionSystem[S, A], op: str) -> bool:
    """With ``op`` chosen, the multi-op step (``combine``, when given) is exactly ``transitions[op]``: a model's
    cheaper combined step must not change any transition (BMC and induction use it; drift tests and per-op
    obligations use the transition)."""
    step = Step.fresh(system)
    single = system.transitions[op](step.pre, step.action, step.post)
    solver = z3.Solver()
    solver.add(step.is_(op), step.relation(system.ops) != single)
    return bool(solver.check() == z3.unsat)


def evaluate(system: TransitionSystem[S, A], op: str, pre: Callable[[S], Pins], post: Callable[[S], Pins],
             action: Callable[[A], Pins] | None = None) -> bool | None:
    """``transitions[op]`` with the pinned variables replaced by their values, simplified: ``True``, ``False``,
    or ``None`` when free variables (ghost fields) leave it undecided. No solver: the drift tests' fast path."""
    s, a, t, rel = relation(system, op)
    pins = [*pre(s), *post(t), *(action(a) if action is not None else ())]
    verdict = z3.simplify(z3.substitute(rel, *pins))
    return True if z3.is_true(verdict) else False if z3.is_false(verdict) else None


def accepts_pinned(system: TransitionSystem[S, A], op: str, pre: Callable[[S], Pins], post: Callable[[S], Pins],
                   action: Callable[[A], Pins] | None = None) -> Acceptance:
    """:func:`evaluate` first; unless it says accepted, :func:`accepts` with the pins as equalities, whose verdict
    names the conflicting facts."""
    if evaluate(system, op, pre, post, action):
        return Acceptance(op, "accepted")

    def equal(pins: Callable[[Any], Pins]) -> Callable[[Any], list[z3.BoolRef]]:
        return lambda x: [u == v for u, v in pins(x)]

    return accepts(system, op, equal(pre), equal(post), equal(action) if action is not None else None)


def accepts(system: TransitionSystem[S, A], op: str, pre: Callable[[S], Iterable[z3.BoolRef]],
            post: Callable[[S], Iterable[z3.BoolRef]], action: Callable[[A], Iterable[z3.BoolRef]] | None = None,
            *, timeout_ms: int = 10_000) -> Acceptance:
    """Whether ``transitions[op]`` relates the encoded pre-state to the encoded post-state.

    ``pre`` / ``post`` / ``action`` return facts pinning a fresh state (or action) to
    concrete values; what they leave out (ghost fields the reference does not keep,
    arguments the model abstracts) stays free. Solved in a fresh context; a rejection
    lists the unsat core (the transition and the facts it contradicts).
    """
    system.code(op)
    s, a, t = system.state("pre"), system.action("act"), system.state("post")
    labelled = [("transition", system.transitions[op](s, a, t))]
    labelled += [(f"pre: {f}", f) for f in pre(s)]
    labelled += [(f"post: {f}", f) for f in post(t)]
    labelled += [(f"action: {f}", f) for f in (action(a) if action is not None else ())]
    ctx = z3.Context()
    solver = z3.Solver(ctx=ctx)
    solver.set(timeout=timeout_ms)
    names = {}
    for i, (label, fact) in enumerate(labelled):
        tracker = z3.Bool(f"fact#{i}", ctx)
        names[f"fact#{i}"] = label
        solver.assert_and_track(fact.translate(ctx), tracker)
    verdict = solver.check()
    if verdict == z3.sat:
        return Acceptance(op, "accepted")
    if verdict == z3.unknown:
        return Acceptance(op, "unknown")
    return Acceptance(op, "rejected", tuple(sorted(names[str(c)] for c in solver.unsat_core())))
