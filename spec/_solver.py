"""Obligation machinery: one claim, one fresh solver, one verdict.

Every component module (``kvproof.spec.<component>``, and the family modules it
gathers) states its claims about sglang_semantics.md (§1-§4, §7, §9) as
:class:`Obligation` values, named ``<component>.<op or invariant>.<claim>``. An obligation's ``build`` returns the
hypotheses together with the *negated* goal, so

* ``unsat`` means the claim is **proved** (no counterexample exists);
* ``sat`` means there is a **counterexample**, rendered by ``render`` as concrete
  numbers or a step table, never as a raw model dump;
* ``unknown`` (timeout, incompleteness of non-linear integer arithmetic) is
  reported with the solver's reason and is **never** a success.

Broken twins (``expect="counterexample"``) encode a plausible wrong version of a
sound obligation; they must produce a counterexample, which shows the sound
obligation is not vacuous.

Modelling conventions (verification_anchors.md §3.1): integers are ``z3.Int``,
never bit-vectors; Int ``/`` and ``%`` are Euclidean, so every obligation states
``n >= 0`` / ``P >= 1`` hypotheses; the ``div0``/``mod0`` completions Z3 adds to
models are skipped when reading values.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

import z3

__all__ = [
    "TEST_BUDGET",
    "TEST_RLIMIT",
    "Expect",
    "Obligation",
    "Result",
    "Status",
    "as_bool",
    "as_int",
    "closed_value",
    "fmt_bools",
    "model_values",
    "run",
]

Expect = Literal["proved", "counterexample"]
Status = Literal["proved", "counterexample", "unknown"]

# Z3 completes integer division and modulo by zero with these uninterpreted functions.
_ARTEFACTS = frozenset({"div0", "mod0", "/0", "%0"})


@dataclass(frozen=True)
class Obligation:
    """One claim about a component, checkable by a single solver call.

    ``build`` returns facts whose conjunction is UNSAT exactly when the claim
    holds (hypotheses plus the negated goal). ``render`` turns a model of those
    facts into a readable counterexample.
    """

    name: str
    component: str
    family: str
    statement: str
    expect: Expect
    build: Callable[[], Sequence[z3.BoolRef]]
    render: Callable[[z3.ModelRef], str]
    twin_of: str | None = None

    @property
    def is_twin(self) -> bool:
        """A broken twin: a deliberately wrong variant that must be refuted."""
        return self.twin_of is not None

    @classmethod
    def of_component(cls, component: str, suffix: str, statement: str, build: Callable[[], Sequence[z3.BoolRef]],
                     render: Callable[[z3.ModelRef], str], *, expect: Expect = "proved",
                     twin_of: str | None = None) -> Obligation:
        """An obligation of a component that is its own family: named ``component.suffix`` (twins
        name their sound obligation by suffix too)."""
        return cls(name=f"{component}.{suffix}", component=component, family=component, statement=statement,
                   expect=expect, build=build, render=render,
                   twin_of=None if twin_of is None else f"{component}.{twin_of}")


@dataclass(frozen=True)
class Result:
    """The verdict of one :func:`run`."""

    obligation: Obligation
    status: Status
    seconds: float
    detail: str

    @property
    def ok(self) -> bool:
        """The verdict matches the expectation; ``unknown`` is never ok."""
        return self.status != "unknown" and self.status == self.obligation.expect


#: The solver work the test suite allows an obligation, in Z3's resource units (``rlimit``): the same work on every
#: machine, however slow or loaded, so that a verdict in CI cannot depend on the machine (a wall-clock bound made the
#: seed-robustness test time out on a loaded 2-core machine, 2026-11-28, where the same queries take 2-3 s alone).
#: About 6x the most any obligation needs under the default seed and seeds 1 and 7 (measured 2026-11-28 with
#: z3-solver 5.4.0.0: 77M, ``block_pool.allocate_slots.keeps_lists`` under seed 1, 6 s on a 2.6 GHz core).
TEST_RLIMIT = 500_000_000
#: What the test suite passes to :func:`run` (``run(ob, **TEST_BUDGET)``): that work, and the clock only as a backstop
#: against a hang.
TEST_BUDGET: Mapping[str, int] = MappingProxyType({"rlimit": TEST_RLIMIT, "timeout_ms": 600_000})


def run(obligation: Obligation, *, timeout_ms: int = 20_000, seed: int | None = None,
        rlimit: int | None = None) -> Result:
    """Check ``obligation`` with a fresh solver bounded by ``timeout_ms``, and by ``rlimit`` units of solver work if
    given (Z3's deterministic resource limit: a budget no machine's speed changes, :data:`TEST_RLIMIT`).

    The facts are solved in a fresh Z3 context: Z3's heuristics depend on the history
    of the context they run in (term ids, hash-consing), so a query that takes
    milliseconds in a new process can time out after thousands of unrelated terms.
    Translating into a new context makes every verdict independent of what ran
    before. ``seed`` sets the solver's random seed (the robustness test varies it).
    The time covers building the facts, solving and rendering.
    """
    start = time.perf_counter()
    ctx = z3.Context()
    solver = z3.Solver(ctx=ctx)
    solver.set(timeout=timeout_ms)
    if rlimit is not None:
        solver.set(rlimit=rlimit)
    if seed is not None:
        solver.set(random_seed=seed)
    solver.add(*(fact.translate(ctx) for fact in obligation.build()))
    verdict = solver.check()
    if verdict == z3.unsat:
        status: Status = "proved"
        detail = ""
    elif verdict == z3.sat:
        status = "counterexample"
        detail = obligation.render(solver.model().translate(z3.main_ctx()))
    else:
        status = "unknown"
        detail = f"solver returned unknown: {solver.reason_unknown()}"
    return Result(obligation, status, time.perf_counter() - start, detail)


def closed_value(term: z3.ExprRef) -> int | bool:
    """A closed (variable-free) term as a Python value; the drift tests evaluate builders with it."""
    simple = z3.simplify(term)
    if z3.is_bool(simple):
        if not (z3.is_true(simple) or z3.is_false(simple)):
            raise ValueError(f"{term} does not simplify to a Boolean literal: {simple}")
        return bool(z3.is_true(simple))
    if not isinstance(simple, z3.IntNumRef):
        raise ValueError(f"{term} does not simplify to an integer literal: {simple}")
    return int(simple.as_long())


def as_int(model: z3.ModelRef, term: z3.ArithRef | int) -> int:
    """Value of an integer term in ``model`` (unconstrained symbols default to 0)."""
    if isinstance(term, int):
        return term
    value = model.eval(term, model_completion=True)
    if not isinstance(value, z3.IntNumRef):
        raise ValueError(f"{term} does not evaluate to an integer literal: {value}")
    return int(value.as_long())


def as_bool(model: z3.ModelRef, term: z3.BoolRef | bool) -> bool:
    """Value of a Boolean term in ``model`` (unconstrained symbols default to False)."""
    if isinstance(term, bool):
        return term
    return bool(z3.is_true(model.eval(term, model_completion=True)))


def model_values(model: z3.ModelRef) -> dict[str, int | bool]:
    """The model's constants as Python values, skipping ``div0``/``mod0`` artefacts."""
    values: dict[str, int | bool] = {}
    for decl in model.decls():
        if decl.arity() != 0 or decl.name() in _ARTEFACTS:
            continue
        value = model[decl]
        if isinstance(value, z3.IntNumRef):
            values[decl.name()] = value.as_long()
        elif z3.is_bool(value):
            values[decl.name()] = z3.is_true(value)
    return dict(sorted(values.items()))


def fmt_bools(bits: Sequence[bool]) -> str:
    """``[T,F,T]``: a Boolean mask as the scenarios in sglang_semantics.md §9 write it."""
    return "[" + ",".join("T" if bit else "F" for bit in bits) + "]"
