"""``kvproof`` command line: ``prove``, ``conform``, ``check`` and ``bench``.

* ``kvproof prove``   -- every Z3 obligation and broken twin; non-zero exit on any failure or ``unknown``.
* ``kvproof conform`` -- the lockstep suite against kvproof's torch runtime or ``--impl module:factory``.
* ``kvproof check``   -- ``prove`` + ``conform`` of the built-in runtime + ``mutants``, one summary;
  exit 0 only if all pass.
* ``kvproof mutants`` -- the suite against every deliberately broken runtime; each must be killed.
* ``kvproof bench``   -- throughput and harness-overhead ratios, measured in one run.
"""

from __future__ import annotations

import sys
import warnings

import click
from rich.console import Console
from rich.table import Table

from kvproof.reference import COMPONENTS

__all__ = ["main"]

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")  # torch without numpy: harmless


def _console() -> Console:
    """A console that does not squeeze tables into 80 columns when writing to a log."""
    console = Console()
    return console if console.is_terminal else Console(width=150)

PROFILE = click.option("--profile", default="ci", show_default=True, type=click.Choice(["ci", "nightly", "dev"]),
                       help="Hypothesis profile (kvproof.conformance.profiles).")
CONFIG = click.option("--config", "configs", multiple=True, metavar="LABEL",
                      help="Run only this pool config (e.g. P4-W6-F48-S24); repeatable. Default: all.")


@click.group()
@click.version_option(package_name="kvproof")
def main() -> None:
    """Prove and fuzz the KV-cache memory pools of LLM serving engines."""


@main.command()
@click.option("--component", default=None, help="Only obligations of this component (e.g. swa_allocator).")
@click.option("-k", "name_filter", default=None, help="Only obligations whose name contains this text.")
@click.option("--timeout-ms", default=20_000, show_default=True, help="Solver timeout per obligation.")
@click.option("--show-counterexamples", is_flag=True, help="Print the counterexample of every broken twin.")
def prove(component: str | None, name_filter: str | None, timeout_ms: int, show_counterexamples: bool) -> None:
    """Discharge every Z3 obligation; broken twins must yield counterexamples."""
    from kvproof.cli.prove import print_failures, prove as run_prove, prove_table

    console = _console()
    results = run_prove(component, name_filter, timeout_ms)
    console.print(prove_table(results))
    print_failures(console, results, show_counterexamples=show_counterexamples)
    bad = [r for r in results if not r.ok]
    total = sum(r.seconds for r in results)
    console.print(f"{len(results)} obligations, {len(bad)} failed, {total:.2f} s solver time")
    sys.exit(1 if bad or not results else 0)


COMPONENT = click.option("--component", "components", multiple=True, type=click.Choice(COMPONENTS),
                         help="Run only this component's suite; repeatable. Default: all.")
POLICY = click.option("--policy", default="corrected", show_default=True, type=click.Choice(["corrected", "upstream"]),
                      help="decode_prealloc: the scheduler's admission policy (upstream crashes: S2).")


@main.command()
@click.option("--impl", "impl_spec", default=None, metavar="MODULE:FACTORY",
              help="Implementation factory (PoolConfig -> allocator). Default: kvproof's torch runtime.")
@PROFILE
@CONFIG
@COMPONENT
@POLICY
def conform(impl_spec: str | None, profile: str, configs: tuple[str, ...], components: tuple[str, ...],
            policy: str) -> None:
    """Run the lockstep conformance suites (swa_allocator, loc_cache, decode_prealloc)."""
    from kvproof.cli.conform import conform as run_conform, conform_table
    from kvproof.cli.impl import DEFAULT_IMPL, load_factory

    console = _console()
    spec = impl_spec or DEFAULT_IMPL
    try:
        factory = load_factory(spec)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--impl") from err
    reports = run_conform(factory, spec, profile, configs, on_report=lambda r: _report_progress(console, r),
                          components=components or COMPONENTS, policy=policy)
    console.print(conform_table(reports))
    _print_reports(console, reports)
    sys.exit(0 if all(r.passed for r in reports) else 1)


@main.command()
@PROFILE
def check(profile: str) -> None:
    """prove + conform of the built-in runtime + mutants; exit 0 only if everything passes."""
    from kvproof.cli.conform import conform as run_conform, conform_table, mutants_table, run_mutants
    from kvproof.cli.impl import DEFAULT_IMPL, load_factory
    from kvproof.cli.prove import print_failures, prove as run_prove, prove_table

    console = _console()
    results = run_prove()
    console.print(prove_table(results))
    print_failures(console, results, show_counterexamples=False)
    reports = run_conform(load_factory(DEFAULT_IMPL), DEFAULT_IMPL, profile,
                          on_report=lambda r: _report_progress(console, r), components=COMPONENTS)
    console.print(conform_table(reports))
    _print_reports(console, reports)
    verdicts = run_mutants(profile)
    console.print(mutants_table(verdicts))
    summary = Table(title="kvproof check")
    for col in ("part", "items", "passed", "verdict"):
        summary.add_column(col)
    proved = sum(r.ok for r in results)
    conformed = sum(r.passed for r in reports)
    killed = sum(v.killed for v in verdicts)
    rows = [("prove (obligations + broken twins)", len(results), proved),
            ("conform (components x pool configs)", len(reports), conformed),
            ("mutants killed (test the tester)", len(verdicts), killed)]
    for part, n, ok in rows:
        summary.add_row(part, str(n), str(ok), "[green]pass[/]" if ok == n and n else "[red]FAIL[/]")
    console.print(summary)
    sys.exit(0 if all(ok == n and n for _, n, ok in rows) else 1)


@main.command()
@PROFILE
def mutants(profile: str) -> None:
    """Test the tester: the lockstep suite must kill every deliberately broken runtime."""
    from kvproof.cli.conform import mutants_table, run_mutants

    console = _console()
    verdicts = run_mutants(profile)
    console.print(mutants_table(verdicts))
    sys.exit(0 if all(v.killed for v in verdicts) else 1)


@main.command()
@click.option("--quick", is_flag=True, help="Fewer repetitions (smoke run).")
def bench(quick: bool) -> None:
    """Lockstep steps/s, runtime alloc_extend+free pairs/s at P=1 and P=4, harness overhead ratio."""
    from kvproof.cli.bench import run_bench

    run_bench(_console(), quick=quick)


def _report_progress(console: Console, report) -> None:  # type: ignore[no-untyped-def]
    verdict = "pass" if report.passed else "FAIL"
    console.print(f"  {report.component} {report.config.label()}: {verdict} "
                  f"({report.examples} examples, {report.steps} steps, {report.seconds:.1f} s)")


def _print_reports(console: Console, reports) -> None:  # type: ignore[no-untyped-def]
    first = reports[0] if reports else None
    if first and first.not_applicable:
        console.print(f"not applicable (capabilities not declared): {len(first.not_applicable)} rule(s): "
                      f"{', '.join(first.not_applicable)}")
    for r in reports:
        if r.never_run:
            console.print(f"[yellow]{r.component} {r.config.label()}: rules never executed: {', '.join(r.never_run)}[/]")
        if not r.passed:
            console.print(f"\n[bold red]{r.component} {r.config.label()} failed[/]", highlight=False)
            console.print(r.failure, markup=False, highlight=False, soft_wrap=True)
            if r.failure_file:
                console.print(f"(saved to {r.failure_file})")
