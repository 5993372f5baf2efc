"""Presentation of conformance runs and mutant kills: tables and the lines below them."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from kvproof.cli.progress import Progress
from kvproof.conformance.check import CheckReport, MutantVerdict, kill_mutants, mutants_of, structure_unreached
from kvproof.conformance.plan import PlannedTest, RunEvents
from kvproof.conformance.report import Outcome, RunInfo, write_json, write_junit
from kvproof.reference.registry import Component, Layer, info, parse_components

__all__ = ["CLIEvents", "conform_table", "counts", "mutants_absent", "mutants_table", "print_not_applicable",
           "print_reports", "print_structure", "run_mutants"]


def conform_table(reports: list[CheckReport], width: int = 150) -> Table:
    """One row per report; identifiers keep their full width, never cut with "…" (below 120 columns the
    table is compact: no borders, two-line headers)."""
    compact = width < 120
    table = (Table(title="kvproof conform", box=box.SIMPLE_HEAD, padding=(0, 0), show_edge=False)
             if compact else Table(title="kvproof conform"))
    longest = {"component": max((len(r.component) for r in reports), default=0),
               "config": max((len(r.config.label()) for r in reports), default=0)}
    for col in ("component", "config", "verdict", "examples", "steps", "calls", "ok", "OutOfMemory",
                "InvalidOperation", "n/a", "structure", "seconds"):
        text = col in ("component", "config", "verdict")
        header = {"OutOfMemory": "OutOf\nMemory", "InvalidOperation": "Invalid\nOperation"}.get(col, col)
        table.add_column(header if compact else col, justify="left" if text else "right", overflow="fold",
                         min_width=longest.get(col))
    for r in reports:
        verdict = ("[yellow]skipped[/] (nothing checked)" if r.checked_nothing else "[green]pass[/]" if r.passed
                   else f"[red]FAIL[/] ({r.finding or '-'})")
        table.add_row(r.component, r.config.label(), verdict, str(r.examples), str(r.steps), str(sum(r.calls.values())),
                      str(r.outcomes.get("ok", 0)), str(r.outcomes.get("OutOfMemory", 0)),
                      str(r.outcomes.get("InvalidOperation", 0)), str(len(r.not_applicable)), _structure(r),
                      f"{r.seconds:.1f}")
    return table


def _structure(report: CheckReport) -> str:
    """Structural dimensions at their maximum / declared (``-`` when the suite declares none)."""
    if not report.structure_targets:
        return "-"
    return f"{len(report.structure_targets) - len(report.structure_missed())}/{len(report.structure_targets)}"


def counts(outcomes: list[Outcome]) -> dict[str, int]:
    out: dict[str, int] = {}
    for o in outcomes:
        out[o.status] = out.get(o.status, 0) + 1
    return out


def print_not_applicable(console: Console, runs: Iterable[tuple[str, Sequence[str]]]) -> None:
    """The rules each run (``(name, not applicable)``: a config's run, a campaign's slice) could not run, its
    capabilities not declared; one line per set of rules, naming the runs that share it (capabilities may differ
    per config, e.g. per page size)."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for name, rules in runs:
        if rules:
            groups.setdefault(tuple(rules), []).append(name)
    for rules, names in groups.items():
        console.print(f"not applicable (capabilities not declared) on {', '.join(names)}: {len(rules)} rule(s): "
                      f"{', '.join(rules)}", markup=False, highlight=False)


def print_reports(console: Console, reports: list[CheckReport]) -> None:
    """Not-applicable rules (grouped), never-executed rules, structural coverage, and every failure with its replay
    command."""
    print_not_applicable(console, ((f"{r.component} {r.config.label()}", r.not_applicable) for r in reports))
    for r in reports:
        if r.never_run:
            never = ", ".join(r.never_run)
            console.print(f"[yellow]{r.component} {r.config.label()}: rules never executed: {never}[/]")
        missed = r.structure_missed()
        if missed:
            below = ", ".join(f"{k} {got}/{most}" for k, (got, most) in sorted(missed.items()))
            console.print(f"{r.component} {r.config.label()}: structure below its maximum on this config: {below}",
                          highlight=False, markup=False)
        looked_past = ", ".join(f"{f} x{n}" for f, n in r.accepted.items())
        if looked_past:
            console.print(f"{r.component} {r.config.label()}: known findings looked past (--accept): {looked_past}",
                          highlight=False, markup=False)
        if not r.passed:
            console.print(f"\n[bold red]{r.component} {r.config.label()} failed[/] (finding: {r.finding or '-'})",
                          highlight=False)
            console.print(r.failure, markup=False, highlight=False, soft_wrap=True)
            if r.failure_file:
                console.print(f"(saved to {r.failure_file})", markup=False, highlight=False, soft_wrap=True)
                vector = r.failure_file.rsplit(".", 1)[0] + ".json"
                console.print(f"replay without Hypothesis: kvproof replay {vector} --impl {r.impl_name}",
                              markup=False, highlight=False, soft_wrap=True)
    print_structure(console, reports)


def print_structure(console: Console, reports: list[CheckReport]) -> None:
    """Per component, over its configs: every structural dimension reached its maximum on some config, or which
    did not (:func:`kvproof.conformance.check.structure_unreached`)."""
    by_component: dict[str, list[CheckReport]] = {}
    for r in reports:
        if r.structure_targets:
            by_component.setdefault(r.component, []).append(r)
    for component, runs in by_component.items():
        unreached = structure_unreached(runs)
        dims = len({d for r in runs for d in r.structure_targets})
        if unreached:
            below = ", ".join(f"{k} {got}/{most}" for k, (got, most) in unreached.items())
            console.print(f"[yellow]{component}: structure: {dims - len(unreached)}/{dims} dimensions at their maximum "
                          f"on some config; below: {below}[/]", highlight=False)
        else:
            console.print(f"{component}: structure: all {dims} dimensions at their maximum on some config "
                          f"({len(runs)} config(s))", highlight=False, markup=False)


def run_mutants(profile: str, components: Iterable[Component | str] = (),
                progress: Callable[[str], None] | None = None,
                done: Callable[[list[MutantVerdict]], None] | None = None, **isolation: Any) -> list[MutantVerdict]:
    """Every selected component's runtime mutants (default: all components) against that component's suite.

    ``progress`` hears the mutant under way, ``done`` the verdicts so far after each mutant;
    ``isolation``: ``isolation`` / ``memory_limit_mb`` of ``kill_mutants``.
    """
    verdicts: list[MutantVerdict] = []
    for component in parse_components(components) or tuple(Component):
        mutants = mutants_of(component)
        for i, (name, factory) in enumerate(mutants.items(), 1):
            if progress is not None:
                progress(f"mutants: {component.value} {i}/{len(mutants)}: {name} ({len(verdicts)} done)")
            verdicts += kill_mutants({name: factory}, profile=profile, component=component, **isolation)
            if done is not None:
                done(verdicts)
    return verdicts


def mutants_absent(components: Iterable[Component | str] = ()) -> list[tuple[str, str]]:
    """The selected components (default: all) whose mutants the registry declares absent, with the reason: reported
    as skipped, never a survivor."""
    chosen = parse_components(components) or tuple(Component)
    return [(c.value, info(c).absent[Layer.MUTANTS]) for c in chosen if not info(c).has(Layer.MUTANTS)]


def mutants_table(verdicts: list[MutantVerdict], width: int = 150) -> Table:
    """One row per mutant; names whole (below 120 columns compact: no borders), the evidence folds."""
    title = "kvproof mutants (runtime variants that must be killed)"
    table = (Table(title=title, box=box.SIMPLE_HEAD, padding=(0, 1), show_edge=False, pad_edge=False)
             if width < 120 else Table(title=title))
    longest = {"component": max((len(v.component) for v in verdicts), default=0),
               "mutant": max((len(v.name) for v in verdicts), default=0),
               "caught on": max((len(v.config or "-") for v in verdicts), default=0)}
    for col in ("component", "mutant", "verdict", "caught on", "seconds", "what diverged"):
        table.add_column(col, justify="right" if col == "seconds" else "left", overflow="fold",
                         no_wrap=col == "seconds", min_width=longest.get(col))  # identifiers whole
    for v in verdicts:
        mark = "[green]killed[/]" if v.killed else "[red]SURVIVED[/]"
        table.add_row(v.component, v.name, mark, v.config or "-", f"{v.seconds:.1f}", v.evidence[:100])
    return table


class CLIEvents(RunEvents):
    """The CLI's ear on a run (kvproof.conformance.plan.RunEvents): seed at the start, progress, reports."""

    def __init__(self, console: Console, json_report: str | None, junit_xml: str | None,
                 extra: Callable[[list[Outcome], RunInfo], None] | None = None) -> None:
        self.console, self.json_report, self.junit_xml, self.extra = console, json_report, junit_xml, extra
        self.progress = Progress(console)
        self.test = ""

    def started(self, info: RunInfo) -> None:
        self.progress.stop()
        seed = (f"seed {info.seed} (replay this run: --seed {info.seed})" if info.seed is not None
                else "seed derandomized (derived from each test's name)")
        self.console.print(f"kvproof conform: {len(info.pending)} test(s), implementation {info.impl}, "
                           f"profile {info.profile}, {seed}", markup=False, highlight=False, soft_wrap=True)
        self.progressed([], info)

    def test_started(self, test: PlannedTest) -> None:
        self.test = test.test_id
        self.progress.update(f"conform {self.test}: starting")

    def example(self, test: PlannedTest, examples: int, shrinking: bool) -> None:
        what = "failure found, shrinking…" if shrinking else "generating"
        self.progress.update(f"conform {test.test_id}: example {examples}, {what}")

    def progressed(self, outcomes: list[Outcome], info: RunInfo) -> None:
        if outcomes and info.status == "running" and info.running is None:  # a test just finished
            self.progress.stop()
            _report_progress(self.console, outcomes[-1])
        if self.json_report:
            write_json(self.json_report, outcomes, info)
        if self.junit_xml:
            write_junit(self.junit_xml, outcomes, info)
        if self.extra is not None:
            self.extra(outcomes, info)


def _report_progress(console: Console, outcome: Outcome) -> None:
    """One line per finished test (an outcome of kvproof.conformance.report)."""
    report = outcome.report
    if report is None:  # skipped: listed below the table
        return
    verdict = "skipped (nothing checked)" if report.checked_nothing else "pass" if report.passed else "FAIL"
    console.print(f"  {report.component} {report.config.label()}: {verdict} "
                  f"({report.examples} examples, {report.steps} steps, {report.seconds:.1f} s)",
                  markup=False, highlight=False)
