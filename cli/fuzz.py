"""``kvproof fuzz``'s presentation: a live view of a campaign, its summary, its Ctrl-C (:mod:`kvproof.conformance.fuzz`
does the work).

On a terminal the view is a table redrawn a few times a second (rich ``Live``); written to a pipe or a file it is
a plain line on stderr every ``KVPROOF_PROGRESS_SECONDS`` (default 5), so a log of stdout holds only the summary.
The first Ctrl-C stops the campaign (the runs under way are interrupted; everything found is on disk); a second
one kills the workers.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from kvproof.cli import EXIT_INTERRUPTED
from kvproof.cli.conform import print_not_applicable
from kvproof.conformance.fuzz import Campaign, CampaignEvents, Failure, SliceTally

__all__ = ["FuzzView", "ctrl_c", "summarize", "summary_table"]


def _rate(steps: int, seconds: float) -> str:
    return f"{steps / seconds:,.0f}" if seconds > 0 else "-"


def _row(component: str, tallies: list[SliceTally], elapsed: float) -> list[str]:
    steps = sum(t.total_steps for t in tallies)
    covered = set().union(*(t.rules_covered() for t in tallies))
    rules = set().union(*(t.applicable_rules() for t in tallies))  # not those the capabilities rule out
    never = sorted(rules - covered)
    failures = sum(len(t.failures) for t in tallies)
    replayed = sum(t.replayed for t in tallies)
    still = sum(t.still_failing for t in tallies)
    dims = {(t.slice, k): (t.reached().get(k, 0), v) for t in tallies if not t.nothing_checked  # nothing to reach
            for k, v in t.targets.items()}
    at_max = sum(reached >= most for reached, most in dims.values())
    return [component, str(len(tallies)), f"{sum(t.runs for t in tallies):,}",
            f"{sum(t.total_examples for t in tallies):,}", f"{steps:,}", _rate(steps, elapsed),
            f"{len(covered & rules)}/{len(rules)}", ", ".join(never) or "-",
            f"{at_max}/{len(dims)}" if dims else "-", f"{still}/{replayed}" if replayed else "-", str(failures)]


_COLUMNS = ("component", "slices", "runs", "examples", "steps", "steps/s", "rules covered", "never covered",
            "structure at max", "replayed: still fail", "failures")


def summary_table(campaign: Campaign, title: str) -> Table:
    """One row per component (module docstring of kvproof.conformance.fuzz), and a total."""
    table = Table(title=title)
    for col in _COLUMNS:
        table.add_column(col, justify="left" if col in ("component", "never covered") else "right",
                         overflow="fold")
    tallies = campaign.by_component()
    for component in sorted(tallies):
        table.add_row(*_row(component, tallies[component], campaign.elapsed))
    everything = [t for ts in tallies.values() for t in ts]
    if len(tallies) > 1:
        table.add_row(*_row("total", everything, campaign.elapsed), style="bold")
    return table


def summarize(console: Console, campaign: Campaign, status: str,
              accepted: tuple[tuple[Any, str], ...] = ()) -> int:
    """The summary of a campaign that ended with ``status``: the table, each failure (its finding and its replay
    command), the rules the implementation cannot run (capabilities not declared: counted neither covered nor never
    covered), the known findings it looked past (``accepted``: (component, finding) pairs of the plan; one that never
    occurred in a complete campaign is a failure, strict), the structural dimensions below their maximum, the
    fingerprint; the exit code (0 nothing found, 1 a failure found or still failing, 2 a harness error, 130 stopped by
    Ctrl-C)."""
    plain: dict[str, Any] = {"markup": False, "highlight": False}
    console.print(summary_table(campaign, f"kvproof fuzz: {status} after {campaign.elapsed:,.0f} s"))
    for failure in campaign.failures:
        how = "still fails (a failure kept from an earlier run)" if failure.replayed else "found"
        console.print(f"[red]{failure.slice}: {how}: {failure.diagnosis}[/]", highlight=False)
        where = (f"; saved to {failure.file}; replay: kvproof replay {failure.file.removesuffix('.txt')}.json"
                 if failure.file else "")
        console.print(f"  known finding: {failure.finding}{where}", **plain)
    print_not_applicable(console, ((name, t.not_applicable) for name, t in sorted(campaign.tallies.items())))
    for name, tally in sorted(campaign.tallies.items()):
        if tally.nothing_checked:
            console.print(f"{name}: not fuzzed further: {tally.nothing_checked}", style="yellow", **plain)
    unseen = []
    for component, finding in accepted:
        mine = [t for t in campaign.tallies.values() if t.component == component.value]
        seen = sum(t.accepted.get(finding, 0) for t in mine)
        console.print(f"{component.value}: known finding {finding} looked past {seen} time(s) (--accept)", **plain)
        if not seen and not (mine and all(t.nothing_checked for t in mine)):  # those checked nothing: skipped
            unseen.append(f"{component.value}: --accept {finding}, and it never occurred (drop --accept {finding}: "
                          "the implementation changed, or the campaign cannot reach it)")
    for name, tally in sorted(campaign.tallies.items()):
        reached = tally.reached()
        below = [f"{k} {reached.get(k, 0)}/{most}" for k, most in sorted(tally.targets.items())
                 if reached.get(k, 0) < most]
        if tally.runs and below and not tally.nothing_checked:
            console.print(f"{name}: structure below its maximum: " + ", ".join(below), **plain)
    console.print(f"campaign {campaign.spec.campaign_id}: fingerprint {campaign.fingerprint()} (the same seed and "
                  "runs give the same fingerprint)", **plain)
    replayed = sum(t.replayed for t in campaign.tallies.values())
    if replayed:
        still = sum(t.still_failing for t in campaign.tallies.values())
        console.print(f"replayed {replayed} saved failure(s) first: {still} still fail, {replayed - still} pass now")
    for error in campaign.errors:
        console.print(f"[red]harness error: {error}[/]", highlight=False)
    if status in ("interrupted", "killed"):
        return EXIT_INTERRUPTED
    for line in unseen:  # strict, once the campaign ran its whole budget
        console.print(f"[red]{line}[/]", highlight=False)
    return 2 if campaign.errors else 1 if campaign.failures or unseen else 0


class FuzzView(CampaignEvents):
    """The CLI's ear on a campaign."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.err = Console(stderr=True, width=console.width, highlight=False)
        self.live: Live | None = None
        try:
            self.interval = float(os.environ.get("KVPROOF_PROGRESS_SECONDS", "5"))
        except ValueError:
            self.interval = 5.0
        self._last = 0.0

    def _title(self, campaign: Campaign) -> str:
        budget = campaign.spec.budget
        left = (f"{max(0.0, (budget.seconds or 0) - campaign.elapsed):,.0f} s left" if budget.seconds is not None
                else f"{campaign.total_steps:,}/{budget.steps:,} steps")
        return (f"kvproof fuzz ({campaign.spec.engine}, {len(campaign._procs)} worker(s), seed {campaign.spec.seed}): "
                f"{campaign.status}, {campaign.elapsed:,.0f} s, {left}")

    def started(self, campaign: Campaign) -> None:
        if self.console.is_terminal:
            self.live = Live(self._view(campaign), console=self.console, refresh_per_second=4, transient=True)
            self.live.start()

    def _view(self, campaign: Campaign) -> Any:
        parts: list[Any] = [summary_table(campaign, self._title(campaign))]
        for failure in campaign.failures[-5:]:
            parts.append(Text(f"  {failure.slice}: {failure.diagnosis} [{failure.finding}]", style="red"))
        return Group(*parts)

    def updated(self, campaign: Campaign) -> None:
        if self.live is not None:
            self.live.update(self._view(campaign))
            return
        now = time.monotonic()
        if now - self._last >= self.interval:
            self._last = now
            steps = campaign.total_steps
            self.err.print(f"... {self._title(campaign)}; {steps:,} steps ({_rate(steps, campaign.elapsed)}/s), "
                           f"{len(campaign.failures)} failure(s)", markup=False, soft_wrap=True)

    def failure(self, campaign: Campaign, failure: Failure) -> None:
        if self.live is None:
            what = "still fails (replayed)" if failure.replayed else "found"
            self.err.print(f"... {failure.slice}: {what}: {failure.diagnosis} [{failure.finding}]"
                           + (f" ({failure.file})" if failure.file else ""), markup=False, soft_wrap=True)

    def stop(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None


@contextmanager
def ctrl_c(campaign: Campaign, view: FuzzView) -> Iterator[None]:
    """While the campaign runs and its summary prints: the first Ctrl-C stops it, the second kills its workers."""
    presses: list[float] = []

    def on_sigint(signum: int, frame: Any) -> None:
        presses.append(time.monotonic())
        if len(presses) == 1:
            view.err.print("[yellow]stopping: the runs under way are interrupted (Ctrl-C again kills the "
                           "workers)[/]")
            campaign.interrupt()
        else:
            view.err.print("[red]killing the workers[/]")
            campaign.kill()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
