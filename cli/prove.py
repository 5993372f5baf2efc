"""``kvproof prove``: discharge every Z3 obligation and print one row per obligation."""

from __future__ import annotations

from collections.abc import Iterable

from rich.console import Console
from rich.table import Table

from kvproof import spec
from kvproof.reference.registry import Component, parse_components
from kvproof.spec import Result

__all__ = ["print_failures", "prove", "prove_table"]


def prove(components: Iterable[Component | str] = (), name_filter: str | None = None,
          timeout_ms: int = 20_000) -> list[Result]:
    """Every obligation of the chosen components (default: every component of the registry), in registry order."""
    chosen = parse_components(components) or tuple(Component)
    return [spec.run(ob, timeout_ms=timeout_ms) for c in chosen for ob in spec.obligations(c.value, name_filter)]


def prove_table(results: list[Result]) -> Table:
    table = Table(title="kvproof prove", show_lines=False)
    for col in ("obligation", "component", "expect", "result", "seconds"):
        table.add_column(col, justify="right" if col == "seconds" else "left", no_wrap=col != "obligation",
                         overflow="fold")  # a long obligation name wraps, never loses its end
    for r in results:
        ob = r.obligation
        mark = "[green]ok[/]" if r.ok else "[red]FAIL[/]"
        table.add_row(ob.name, ob.component, ob.expect, f"{r.status} {mark}", f"{r.seconds:.3f}")
    return table


def print_failures(console: Console, results: list[Result], *, show_counterexamples: bool) -> None:
    for r in results:
        if not r.ok or (show_counterexamples and r.status == "counterexample"):
            head = "FAILED" if not r.ok else "counterexample (expected)"
            console.print(f"\n[bold]{r.obligation.name}[/] {head}: {r.obligation.statement}")
            if r.detail:
                console.print(r.detail, markup=False, highlight=False, soft_wrap=True)
