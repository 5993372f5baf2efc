"""Presentation of conformance runs and mutant kills: tables and the lines below them."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rich.console import Console
from rich.table import Table

from kvproof.conformance.check import CheckReport, MutantVerdict, kill_mutants, mutants_of
from kvproof.conformance.report import Outcome
from kvproof.reference.registry import Component, parse_components

__all__ = ["conform_table", "counts", "mutants_table", "print_reports", "run_mutants"]


def conform_table(reports: list[CheckReport]) -> Table:
    table = Table(title="kvproof conform")
    for col in ("component", "config", "verdict", "examples", "steps", "ok", "OutOfMemory", "InvalidOperation", "n/a",
                "seconds"):
        table.add_column(col, justify="left" if col in ("component", "config", "verdict") else "right")
    for r in reports:
        verdict = "[green]pass[/]" if r.passed else "[red]FAIL[/]"
        table.add_row(r.component, r.config.label(), verdict, str(r.examples), str(r.steps),
                      str(r.outcomes.get("ok", 0)), str(r.outcomes.get("OutOfMemory", 0)),
                      str(r.outcomes.get("InvalidOperation", 0)), str(len(r.not_applicable)), f"{r.seconds:.1f}")
    return table


def counts(outcomes: list[Outcome]) -> dict[str, int]:
    out: dict[str, int] = {}
    for o in outcomes:
        out[o.status] = out.get(o.status, 0) + 1
    return out


def print_reports(console: Console, reports: list[CheckReport]) -> None:
    """Not-applicable rules (grouped), never-executed rules, and every failure with its replay command."""
    groups: dict[tuple[str, ...], list[str]] = {}  # capabilities may differ per config (e.g. per page size)
    for r in reports:
        if r.not_applicable:
            groups.setdefault(tuple(r.not_applicable), []).append(f"{r.component} {r.config.label()}")
    for rules, where in groups.items():
        console.print(f"not applicable (capabilities not declared) on {', '.join(where)}: {len(rules)} rule(s): "
                      f"{', '.join(rules)}")
    for r in reports:
        if r.never_run:
            never = ", ".join(r.never_run)
            console.print(f"[yellow]{r.component} {r.config.label()}: rules never executed: {never}[/]")
        if not r.passed:
            console.print(f"\n[bold red]{r.component} {r.config.label()} failed[/]", highlight=False)
            console.print(r.failure, markup=False, highlight=False, soft_wrap=True)
            if r.failure_file:
                console.print(f"(saved to {r.failure_file})")
                vector = r.failure_file.rsplit(".", 1)[0] + ".json"
                console.print(f"replay without Hypothesis: kvproof replay {vector} --impl {r.impl_name}",
                              markup=False, highlight=False, soft_wrap=True)


def run_mutants(profile: str, components: Iterable[Component | str] = (), **isolation: Any) -> list[MutantVerdict]:
    """Every selected component's runtime mutants (default: all components) against that component's suite;
    ``isolation``: ``isolation`` / ``memory_limit_mb`` of ``kill_mutants``."""
    verdicts = []
    for component in parse_components(components) or tuple(Component):
        verdicts += kill_mutants(mutants_of(component), profile=profile, component=component, **isolation)
    return verdicts


def mutants_table(verdicts: list[MutantVerdict]) -> Table:
    table = Table(title="kvproof mutants (runtime variants that must be killed)")
    for col in ("component", "mutant", "verdict", "caught on", "seconds", "what diverged"):
        table.add_column(col, justify="right" if col == "seconds" else "left", overflow="fold")
    for v in verdicts:
        mark = "[green]killed[/]" if v.killed else "[red]SURVIVED[/]"
        table.add_row(v.component, v.name, mark, v.config or "-", f"{v.seconds:.1f}", v.evidence[:100])
    return table
