"""``kvproof prove``: discharge every Z3 obligation and print one row per obligation."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from rich.console import Console
from rich.table import Table

from kvproof import spec
from kvproof.conformance.errors import UsageError
from kvproof.reference.registry import Component, parse_components
from kvproof.spec import Result

__all__ = ["print_failures", "print_results", "prove", "prove_table"]


def prove(components: Iterable[Component | str] = (), name_filter: str | None = None,
          timeout_ms: int = 20_000, progress: Callable[[str], None] | None = None,
          done: Callable[[list[Result]], None] | None = None) -> list[Result]:
    """Every obligation of the chosen components (default: every component of the registry), in registry order.

    ``progress`` hears "obligation i/n: name" before each one, ``done`` the results so far after
    each (incremental reports). :class:`UsageError` when the
    selection matches no obligation (naming the filter and the components).
    """
    chosen = parse_components(components) or tuple(Component)
    selected = [ob for c in chosen for ob in spec.obligations(c.value, name_filter)]
    if not selected:
        where = ", ".join(c.value for c in chosen)
        raise UsageError(f"-k {name_filter!r} matches no obligation of {where}" if name_filter
                         else f"no obligation is registered for {where}")
    results = []
    for i, ob in enumerate(selected, 1):
        if progress is not None:
            progress(f"prove: obligation {i}/{len(selected)}: {ob.name}")
        results.append(spec.run(ob, timeout_ms=timeout_ms))
        if done is not None:
            done(results)
    return results


def prove_table(results: list[Result]) -> Table:
    table = Table(title="kvproof prove", show_lines=False)
    for col in ("obligation", "component", "expect", "result", "seconds"):
        table.add_column(col, justify="right" if col == "seconds" else "left", no_wrap=True,
                         min_width=max((len(r.obligation.name) for r in results), default=0)
                         if col == "obligation" else None)  # full names (print_results picks a narrow layout)
    for r in results:
        ob = r.obligation
        mark = "[green]ok[/]" if r.ok else "[red]FAIL[/]"
        table.add_row(ob.name, ob.component, ob.expect, f"{r.status} {mark}", f"{r.seconds:.3f}")
    return table


def print_results(console: Console, results: list[Result]) -> None:
    """The table when the longest obligation name fits on one row at the console's width; else one line per
    obligation with the name last and never wrapped or cut (``grep``-able whatever the width)."""
    longest = max((len(r.obligation.name) for r in results), default=0)
    if console.width >= longest + 64:
        console.print(prove_table(results))
        return
    console.print("kvproof prove  (verdict, result, seconds, obligation)", style="italic", highlight=False)
    for r in results:
        ob = r.obligation
        mark = "[green]ok  [/]" if r.ok else "[red]FAIL[/]"
        result = r.status if r.ok else f"{r.status} (expected {ob.expect})"
        console.print(f"{mark} {result:<15} {r.seconds:7.3f}  {ob.name}", soft_wrap=True, highlight=False)


def print_failures(console: Console, results: list[Result], *, show_counterexamples: bool) -> None:
    for r in results:
        if not r.ok or (show_counterexamples and r.status == "counterexample"):
            head = "FAILED" if not r.ok else "counterexample (expected)"
            console.print(f"\n[bold]{r.obligation.name}[/] {head}: {r.obligation.statement}")
            if r.detail:
                console.print(r.detail, markup=False, highlight=False, soft_wrap=True)
