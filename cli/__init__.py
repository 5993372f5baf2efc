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

PROFILE = click.option("--profile", default="ci", show_default=True, type=click.Choice(["ci", "nightly", "dev", "smoke"]),
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
@click.option("--impl", "impl_specs", multiple=True, metavar="MODULE:FACTORY", envvar="KVPROOF_IMPL",
              help="Implementation factory (config -> implementation); repeatable, each serving the components "
                   "it declares; also $KVPROOF_IMPL (space-separated). Default: kvproof's torch runtime.")
@PROFILE
@CONFIG
@COMPONENT
@POLICY
@click.option("--seed", type=int, default=None, help="Seed of a non-derandomized profile (default: chosen, reported).")
@click.option("--skip-file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Lines 'component/config  # reason' (globs allowed): not run, reported as skipped.")
@click.option("--xfail-file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Lines 'component/config  # reason': expected to fail; a pass fails the run (stale entry).")
@click.option("--json-report", type=click.Path(dir_okay=False), default=None, help="Write a JSON report here.")
@click.option("--junit-xml", type=click.Path(dir_okay=False), default=None, help="Write JUnit XML here.")
@click.option("--op-timeout", type=float, default=60.0, show_default=True,
              help="Seconds one implementation call may take before it counts as hung.")
def conform(impl_specs: tuple[str, ...], profile: str, configs: tuple[str, ...], components: tuple[str, ...],
            policy: str, seed: int | None, skip_file: str | None, xfail_file: str | None, json_report: str | None,
            junit_xml: str | None, op_timeout: float) -> None:
    """Run the lockstep conformance suites (swa_allocator, loc_cache, decode_prealloc, hisparse_host)."""
    from kvproof.cli.conform import conform_outcomes, conform_table
    from kvproof.conformance.check import declared_components
    from kvproof.cli.impl import load_factory
    from kvproof.conformance.report import load_selection, write_json, write_junit

    console = _console()
    impls = []
    for spec in impl_specs:
        try:
            impls.append((spec, load_factory(spec)))
        except ValueError as err:
            raise click.BadParameter(str(err), param_hint="--impl") from err
    if impls and not components:  # the components the given implementations declare (all if one declares none)
        declared = [declared_components(f) for _, f in impls]
        wanted = set(COMPONENTS) if None in declared else {c for d in declared for c in d or ()}
        components = tuple(c for c in COMPONENTS if c in wanted)
    try:
        selection = load_selection(skip_file, xfail_file)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--skip-file/--xfail-file") from err
    try:
        outcomes, info = conform_outcomes(None, None, profile, configs,
                                          on_report=lambda r: _report_progress(console, r),
                                          components=components or COMPONENTS, policy=policy, selection=selection,
                                          seed=seed, op_timeout=op_timeout, impls=impls)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--config/--impl") from err
    reports = [o.report for o in outcomes if o.report is not None]
    console.print(conform_table(reports))
    _print_reports(console, reports)
    for o in outcomes:
        if o.status in ("skipped", "xfailed", "xpassed"):
            style = "red" if o.status == "xpassed" else "yellow"
            console.print(f"[{style}]{o.component} {o.config}: {o.status} ({o.reason})[/]")
    for warning in info.warnings:
        console.print(f"[yellow]warning: {warning}[/]")
    console.print(f"implementation {info.impl} ({info.impl_version}); seed {info.seed}; "
                  + ", ".join(f"{n} {k}" for k, n in _counts(outcomes).items()), markup=False, highlight=False)
    if json_report:
        write_json(json_report, outcomes, info)
    if junit_xml:
        write_junit(junit_xml, outcomes, info)
    sys.exit(0 if all(o.ok for o in outcomes) else 1)


def _counts(outcomes) -> dict[str, int]:  # type: ignore[no-untyped-def]
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o.status] = counts.get(o.status, 0) + 1
    return counts


@main.command()
@PROFILE
def check(profile: str) -> None:
    """prove + conform of the built-in runtime + mutants; exit 0 only if everything passes."""
    from kvproof.cli.conform import conform as run_conform, conform_table, mutants_table, run_mutants
    from kvproof.cli.prove import print_failures, prove as run_prove, prove_table

    console = _console()
    results = run_prove()
    console.print(prove_table(results))
    print_failures(console, results, show_counterexamples=False)
    reports = run_conform(None, None, profile, on_report=lambda r: _report_progress(console, r),
                          components=COMPONENTS)
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
@click.argument("vector_file", metavar="VECTOR")
@click.option("--impl", "impl_spec", default=None, metavar="MODULE:FACTORY",
              help="Implementation to replay on. Default: the component's torch runtime.")
def replay(vector_file: str, impl_spec: str | None) -> None:
    """Replay a failure vector (a .json saved under .kvproof/failures/ or a report) without Hypothesis.

    Exit 0 if every step and invariant passes on the implementation, 1 if it fails, 2 if
    the vector cannot be replayed (malformed, or a step's rule does not apply).
    """
    from kvproof.cli.impl import load_factory
    from kvproof.conformance.check import get_suite, replay_vector
    from kvproof.conformance.vector import VectorError, load_vector

    console = _console()
    try:
        vector = load_vector(vector_file)
        spec = impl_spec or get_suite(str(vector["component"])).default_impl
        factory = load_factory(spec)
        result = replay_vector(vector, factory, impl_name=spec)
    except (VectorError, ValueError) as err:
        console.print(f"[red]cannot replay {vector_file}: {err}[/]")
        sys.exit(2)
    where = f"{result.component} {result.config}, {len(vector['steps'])} recorded step(s)"
    if result.passed:
        console.print(f"{spec}: [green]pass[/] ({where})")
        sys.exit(0)
    console.print(f"{spec}: [red]FAIL[/] after {result.steps} step(s) ({where})")
    console.print(result.failure, markup=False, highlight=False, soft_wrap=True)
    sys.exit(1)


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
    groups: dict[tuple[str, ...], list[str]] = {}  # capabilities may differ per config (e.g. per page size)
    for r in reports:
        if r.not_applicable:
            groups.setdefault(tuple(r.not_applicable), []).append(f"{r.component} {r.config.label()}")
    for rules, where in groups.items():
        console.print(f"not applicable (capabilities not declared) on {', '.join(where)}: {len(rules)} rule(s): "
                      f"{', '.join(rules)}")
    for r in reports:
        if r.never_run:
            console.print(f"[yellow]{r.component} {r.config.label()}: rules never executed: {', '.join(r.never_run)}[/]")
        if not r.passed:
            console.print(f"\n[bold red]{r.component} {r.config.label()} failed[/]", highlight=False)
            console.print(r.failure, markup=False, highlight=False, soft_wrap=True)
            if r.failure_file:
                console.print(f"(saved to {r.failure_file})")
                vector = r.failure_file.rsplit(".", 1)[0] + ".json"
                console.print(f"replay without Hypothesis: kvproof replay {vector} --impl {r.impl_name}",
                              markup=False, highlight=False, soft_wrap=True)
