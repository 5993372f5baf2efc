"""Machine-readable reports of ``prove``, ``mutants`` and ``check`` (JSON and JUnit XML).

``conform`` writes :mod:`kvproof.conformance.report`'s ``kvproof-report/1``; the other
verbs write the same shape: ``format``, ``created``, ``suite``, ``status`` (``complete``,
or ``running`` while a long run is under way), ``complete`` (bool), ``summary`` and
``results``; ``check`` nests the three parts (``prove``, ``conform``, ``mutants``). JUnit
XML has one ``<testsuite>`` per part; a failure's ``message`` is its diagnosis.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvproof.conformance.check import MutantVerdict
from kvproof.conformance.report import Case, JUnitSuite, diagnosis, header
from kvproof.spec import Result

__all__ = ["mutants_json", "mutants_junit", "prove_json", "prove_junit"]

PROVE_FORMAT = "kvproof-prove-report/1"
MUTANTS_FORMAT = "kvproof-mutants-report/1"
CHECK_FORMAT = "kvproof-check-report/1"


def _status(complete: bool) -> dict[str, Any]:
    return {"status": "complete" if complete else "running", "complete": complete}


def prove_json(results: list[Result], *, complete: bool = True, wall_seconds: float | None = None,
               workers: int | None = None) -> dict[str, Any]:
    """``summary`` also has ``solver_seconds`` (the obligations' seconds, summed), ``wall_seconds`` (the run's
    wall-clock time so far) and ``workers`` (its worker processes; 1: in kvproof's own process), the last two
    ``null`` when the caller did not measure them."""
    rows = [{"obligation": r.obligation.name, "component": r.obligation.component, "expect": r.obligation.expect,
             "status": r.status, "ok": r.ok, "seconds": round(r.seconds, 3), "statement": r.obligation.statement,
             "detail": r.detail or None} for r in results]
    summary = {"obligations": len(results), "failed": sum(not r.ok for r in results),
               "solver_seconds": round(sum(r.seconds for r in results), 3),
               "wall_seconds": None if wall_seconds is None else round(wall_seconds, 3), "workers": workers}
    return {"format": PROVE_FORMAT, **header(), **_status(complete), "summary": summary, "results": rows}


def prove_junit(results: list[Result]) -> JUnitSuite:
    cases = []
    for r in results:
        ob = r.obligation
        if r.ok:
            cases.append(Case(f"kvproof.prove.{ob.component}", ob.name, r.seconds, "passed"))
        else:
            message = f"expected {ob.expect}, got {r.status}: {ob.statement}"
            cases.append(Case(f"kvproof.prove.{ob.component}", ob.name, r.seconds, "failed", message,
                              f"{message}\n{r.detail or ''}".rstrip()))
    return JUnitSuite("kvproof.prove", cases)


def mutants_json(verdicts: list[MutantVerdict], *, complete: bool = True,
                 skipped: Sequence[tuple[str, str]] = ()) -> dict[str, Any]:
    """``skipped``: ``(component, reason)`` of the components without mutants (declared absent in the registry)."""
    rows = [{"component": v.component, "mutant": v.name, "killed": v.killed, "config": v.config,
             "seconds": round(v.seconds, 3), "evidence": v.evidence} for v in verdicts]
    return {"format": MUTANTS_FORMAT, **header(), **_status(complete),
            "summary": {"mutants": len(verdicts), "killed": sum(v.killed for v in verdicts),
                        "skipped_components": len(skipped)},
            "results": rows, "skipped": [{"component": c, "reason": reason} for c, reason in skipped]}


def mutants_junit(verdicts: list[MutantVerdict], skipped: Sequence[tuple[str, str]] = ()) -> JUnitSuite:
    """A killed mutant is a passing case (its evidence in the text), a survivor a failure; a component without
    mutants a skipped case."""
    cases = [Case(f"kvproof.mutants.{v.component}", v.name, v.seconds, "passed" if v.killed else "failed",
                  "" if v.killed else "survived every config: the suite does not catch this bug",
                  diagnosis(v.evidence)) for v in verdicts]
    cases += [Case(f"kvproof.mutants.{c}", "(no mutants)", 0.0, "skipped", reason) for c, reason in skipped]
    return JUnitSuite("kvproof.mutants", cases)
