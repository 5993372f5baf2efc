"""``kvproof`` command line: ``prove``, ``conform``, ``fuzz``, ``check``, ``mutants``, ``replay`` and ``bench``.

* ``kvproof prove``   -- every Z3 obligation and broken twin; non-zero exit on any failure or ``unknown``.
* ``kvproof conform`` -- the lockstep suites against kvproof's torch runtime or ``--impl module:factory``.
* ``kvproof fuzz``    -- a campaign: the suites under a time or step budget on K workers, nothing found lost.
* ``kvproof check``   -- ``prove`` + ``conform`` of the built-in runtime + ``mutants``, one summary;
  exit 0 only if all pass.
* ``kvproof mutants`` -- the suites against every deliberately broken runtime; each must be killed.
* ``kvproof replay``  -- a saved failure vector, without Hypothesis.
* ``kvproof bench``   -- throughput and harness-overhead ratios, measured in one run.

Every verb takes ``--component`` with the registry's choices (``kvproof.reference.registry``),
and ``conform`` the options the suites declare (``--policy``). The verbs are presentation
over the run planner (:mod:`kvproof.conformance.plan`) and the spec package. Exit codes:
0 pass, 1 a verdict (a divergence, a failed obligation, a surviving mutant), 2 bad input
or a harness error, with a message naming what was wrong (the option, the value), 130 a run
stopped by Ctrl-C (its reports are finalised with ``status: interrupted`` first, and a
failure found before the interrupt is on disk under ``.kvproof/failures/``).

``prove``, ``conform``, ``check`` and ``mutants`` take ``--json-report`` and ``--junit-xml``;
the files are rewritten as the run goes (``status: running``) and finalised at the end.
Long phases show live progress (``kvproof.cli.progress``); output honours ``COLUMNS``.

Exit codes are kvproof's alone:
``conform``, ``check``, ``mutants`` and ``replay`` run each config in a child process
(:mod:`kvproof.conformance.isolation`), so an implementation that exits (``sys.exit(0)``,
``os._exit(7)``), segfaults, hangs (its factory included, ``BaseException`` swallowed or not)
or outgrows ``--memory-limit`` gets a verdict (exit 1) and the run goes on to the next
config. ``--in-process`` runs in kvproof's own process: faster, not protected against those.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any, NoReturn

import click
from rich.console import Console
from rich.table import Table

from kvproof.conformance.modes import CAMPAIGN_SHRINKER, DEFAULT_ENGINE, DEFAULT_SHRINKER, ENGINES, SHRINKERS
from kvproof.reference.errors import ConfigError
from kvproof.reference.registry import Component, options

__all__ = ["main"]

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")  # torch without numpy: harmless

COMPONENT_CHOICES = click.Choice([c.value for c in Component])


#: Ctrl-C: the run was stopped; its reports say ``interrupted`` (128 + SIGINT, the shell's convention)
EXIT_INTERRUPTED = 130


def _console() -> Console:
    """A console that honours ``COLUMNS``; written to a log without it, 150 columns rather than 80."""
    console = Console()
    if console.is_terminal or os.environ.get("COLUMNS", "").strip().isdigit():
        return console
    return Console(width=150)


def _usage_errors() -> tuple[type[Exception], ...]:
    from kvproof.conformance.errors import HarnessError

    return (HarnessError, ConfigError)


def _bad_input(console: Console, err: Exception) -> NoReturn:
    console.print(f"[red]error: {err}[/]", highlight=False)
    sys.exit(2)


def _positive_seconds(ctx: click.Context, param: click.Parameter, value: float) -> float:
    if not (math.isfinite(value) and value > 0):
        raise click.BadParameter(f"{value:g} is not a number of seconds > 0 (a call may take at most this long)",
                                 ctx, param)
    return value


JSON_REPORT = click.option("--json-report", type=click.Path(dir_okay=False), default=None,
                           help="Write a JSON report here (rewritten as the run goes; 'status' says if final).")
JUNIT_XML = click.option("--junit-xml", type=click.Path(dir_okay=False), default=None,
                         help="Write JUnit XML here (rewritten as the run goes).")
PROFILE = click.option("--profile", default="ci", show_default=True,
                       type=click.Choice(["ci", "nightly", "dev", "smoke"]),
                       help="Hypothesis profile (kvproof.conformance.profiles).")
CONFIG = click.option("--config", "configs", multiple=True, metavar="LABEL",
                      help="Run only this config (e.g. P4-W6-F48-S24); repeatable. Default: all.")
COMPONENTS = click.option("--component", "components", multiple=True, type=COMPONENT_CHOICES,
                          help="Only this component; repeatable. Default: all (conform: those the --impl declare).")
#: kvproof.conformance.isolation.DEFAULT_MEMORY_LIMIT_MB, not imported: ``kvproof --help`` does not import the harness
MEMORY_LIMIT_MB = 8192


def with_isolation(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--in-process`` and ``--memory-limit``, collected into ``isolation`` (keyword arguments of the runs)."""
    command = click.option("--memory-limit", "memory_limit", type=click.IntRange(min=0),
                           default=MEMORY_LIMIT_MB, show_default=True, metavar="MIB",
                           help="MiB the implementation's process may grow by before it is killed (a verdict); "
                                "0: no limit. Process isolation only.")(command)
    command = click.option("--in-process", "in_process", is_flag=True,
                           help="Run implementations in kvproof's own process (faster; not protected against an "
                                "implementation that exits, segfaults, hangs swallowing BaseException or exhausts "
                                "memory). Default: one child process per config.")(command)

    @functools.wraps(command)
    def collected(**kwargs: Any) -> Any:
        in_process, limit = kwargs.pop("in_process"), kwargs.pop("memory_limit")
        kwargs["isolation"] = {"isolation": "in-process" if in_process else "process", "memory_limit_mb": limit}
        return command(**kwargs)

    return collected


HARM = click.option(
    "--harm", is_flag=True,
    help="After a failure, go on past the divergence on the implementation alone under a ghost ownership model "
         "(which request holds which page, from what each call handed out) until it turns into a consequence: a "
         "cross-request KV read, a page with two owners, a page freed while owned, a duplicate in a free list, the "
         "reserved page handed out, a legal call that raises, or capacity lost. Printed under the shrunk trace.")


def shrink_option(default: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--shrink``, defaulting to ``default`` (a conformance run: Hypothesis'; a campaign: the vector shrinker)."""
    return click.option(
        "--shrink", "shrink_with", type=click.Choice(list(SHRINKERS)), default=default, show_default=True,
        help="Who shrinks a failure found by Hypothesis: its shrinker, or kvproof's vector shrinker (Hypothesis "
             "finds, then candidate vectors are replayed: seconds where Hypothesis can take minutes on a long "
             "stateful example; the breadth mode always uses it).")


ACCEPT = click.option(
    "--accept", multiple=True, metavar="FINDING",
    help="Look past this known finding of the implementation (an id it declares, e.g. F1, whose documented "
         "behaviour the suite can follow): the run goes on after each occurrence, counts them, and fails if it never "
         "occurs. Repeatable, or comma-separated. Default: none (nothing is hidden).")


def _ids(values: tuple[str, ...]) -> tuple[str, ...]:
    """``--accept F1 --accept F4,F5`` -> (F1, F4, F5)."""
    return tuple(dict.fromkeys(v.strip() for value in values for v in value.split(",") if v.strip()))


def with_suite_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Add one click option per declared suite option (``--policy`` ...), collected into ``suite_options``."""
    declared = options()
    for option in reversed(declared):
        command = click.option(f"--{option.name}", option.name, default=option.default, show_default=True,
                               type=click.Choice(list(option.choices)), help=option.help)(command)
    names = [o.name for o in declared]

    @functools.wraps(command)  # carries click's collected parameters along
    def collected(**kwargs: Any) -> Any:
        kwargs["suite_options"] = {name: kwargs.pop(name) for name in names}
        return command(**kwargs)

    return collected


@click.group()
@click.version_option(package_name="kvproof")
def main() -> None:
    """Prove and fuzz the KV-cache memory pools of LLM serving engines."""


@main.command()
@COMPONENTS
@click.option("-k", "name_filter", default=None, help="Only obligations whose name contains this text (or glob).")
@click.option("--timeout-ms", default=20_000, show_default=True, type=click.IntRange(min=1),
              help="Solver timeout per obligation.")
@click.option("--show-counterexamples", is_flag=True, help="Print the counterexample of every broken twin.")
@click.option("--jobs", type=click.IntRange(min=1), default=None, metavar="K",
              help="Worker processes proving obligations in parallel (default: one per core, os.cpu_count()); "
                   "1: one after another in kvproof's own process.")
@JSON_REPORT
@JUNIT_XML
def prove(components: tuple[str, ...], name_filter: str | None, timeout_ms: int, show_counterexamples: bool,
          jobs: int | None, json_report: str | None, junit_xml: str | None) -> None:
    """Discharge every Z3 obligation; broken twins must yield counterexamples."""
    from kvproof.cli.progress import Progress
    from kvproof.cli.prove import effective_workers, print_failures, print_results, select, wall_line
    from kvproof.cli.prove import prove as run_prove
    from kvproof.cli.reports import prove_json, prove_junit
    from kvproof.conformance.report import write_document, write_junit_suites

    console = _console()
    last = [0.0]
    jobs = jobs if jobs is not None else os.cpu_count() or 1
    workers = [jobs]  # how many the run uses (no more than the obligations it selects)
    start = time.monotonic()

    def write(results: list[Any], status: str) -> None:
        if json_report:
            write_document(json_report, {**prove_json(results, complete=status == "complete",
                                                      wall_seconds=time.monotonic() - start, workers=workers[0]),
                                         "status": status})
        if junit_xml:
            write_junit_suites(junit_xml, [prove_junit(results)])

    results: list[Any] = []

    def so_far(done: list[Any]) -> None:  # the reports are rewritten at most once a second while the run goes on
        results[:] = done
        if time.monotonic() - last[0] >= 1.0:
            last[0] = time.monotonic()
            write(results, "running")

    try:
        workers[0] = effective_workers(jobs, len(select(components, name_filter)))
        with Progress(console) as progress:
            results = run_prove(components, name_filter, timeout_ms, progress=progress.update, done=so_far, jobs=jobs)
    except _usage_errors() as err:
        _bad_input(console, err)
    except KeyboardInterrupt:
        write(results, "interrupted")
        _interrupted(console, f"prove ({len(results)} obligation(s) done)")
    wall = time.monotonic() - start
    write(results, "complete")
    print_results(console, results)
    print_failures(console, results, show_counterexamples=show_counterexamples)
    bad = [r for r in results if not r.ok]
    total = sum(r.seconds for r in results)
    console.print(f"{len(results)} obligations, {len(bad)} failed, {total:.2f} s solver time")
    console.print(wall_line(results, wall, workers[0]), highlight=False)
    sys.exit(1 if bad else 0)


@main.command()
@click.option("--impl", "impl_specs", multiple=True, metavar="MODULE:FACTORY", envvar="KVPROOF_IMPL",
              help="Implementation factory (config -> implementation); repeatable, each serving the components "
                   "it declares; also $KVPROOF_IMPL (space-separated). Default: kvproof's torch runtime.")
@PROFILE
@CONFIG
@COMPONENTS
@click.option("--seed", type=int, default=None,
              help="Seed of a randomized profile (nightly, smoke; default: chosen and printed at the start). "
                   "Refused with a derandomized profile (ci, dev).")
@click.option("--skip-file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Lines 'component/config  # reason' (globs allowed): not run, reported as skipped.")
@click.option("--xfail-file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Lines 'component/config  # reason': expected to fail; a pass fails the run (stale entry).")
@JSON_REPORT
@JUNIT_XML
@click.option("--op-timeout", type=float, default=60.0, show_default=True, callback=_positive_seconds,
              help="Seconds (> 0) one implementation call may take before it counts as hung.")
@click.option("--fresh", is_flag=True,
              help="Do not replay the failures saved under .kvproof/failures/ before generating.")
@ACCEPT
@HARM
@shrink_option(DEFAULT_SHRINKER)
@with_isolation
@with_suite_options
def conform(impl_specs: tuple[str, ...], profile: str, configs: tuple[str, ...], components: tuple[str, ...],
            seed: int | None, skip_file: str | None, xfail_file: str | None, json_report: str | None,
            junit_xml: str | None, op_timeout: float, fresh: bool, accept: tuple[str, ...], harm: bool,
            shrink_with: str, suite_options: dict[str, str], isolation: dict[str, Any]) -> None:
    """Run the lockstep conformance suites, one row per component and pool config.

    Failures saved by earlier runs of the same test (.kvproof/failures/) are replayed first;
    one that still fails is the verdict (--fresh skips them). Each config runs in a child
    process (see --in-process). Exit codes: 0 pass, 1 a verdict (an implementation diverged,
    exited, crashed, hung or outgrew --memory-limit), 2 bad input or a harness error, 130 Ctrl-C.
    """
    from kvproof.cli.conform import CLIEvents, conform_table, counts, print_reports
    from kvproof.conformance.plan import load_impls, plan, run_plan
    from kvproof.conformance.report import load_selection

    console = _console()
    try:
        _refuse_seed(profile, seed)
        the_plan = plan(components, load_impls(impl_specs), configs, load_selection(skip_file, xfail_file),
                        suite_options, accept=_ids(accept))
    except _usage_errors() as err:
        _bad_input(console, err)
    events = CLIEvents(console, json_report, junit_xml)
    try:
        outcomes, info = run_plan(the_plan, profile=profile, seed=seed, op_timeout=op_timeout, events=events,
                                  replay_saved=not fresh, harm=harm, shrink_with=shrink_with, **isolation)
    except _usage_errors() as err:
        _bad_input(console, err)
    except KeyboardInterrupt:  # between two tests (run_plan finalises the reports of one interrupted inside a test)
        _interrupted(console, None)
    finally:
        events.progress.stop()
    reports = [o.report for o in outcomes if o.report is not None]
    console.print(conform_table(reports, console.width))
    print_reports(console, reports)
    for o in outcomes:
        if o.status in ("skipped", "xfailed", "xpassed") or (o.report is None and o.status == "failed"):
            style = "yellow" if o.status in ("skipped", "xfailed") else "red"
            console.print(f"[{style}]{o.component} {o.config}: {o.status} ({o.reason})[/]")
    for warning in info.warnings:
        console.print(f"[yellow]warning: {warning}[/]")
    console.print(f"implementation {info.impl} ({info.impl_version}); seed {info.seed_text()}; "
                  + ", ".join(f"{n} {k}" for k, n in counts(outcomes).items()), markup=False, highlight=False,
                  soft_wrap=True)
    if info.status == "interrupted":
        _interrupted(console, info.running)
    sys.exit(0 if all(o.ok for o in outcomes) else 1)


@main.command()
@click.option("--impl", "impl_specs", multiple=True, metavar="MODULE:FACTORY", envvar="KVPROOF_IMPL",
              help="Implementation factory, as for conform (default: kvproof's torch runtime).")
@CONFIG
@COMPONENTS
@click.option("--time", "duration", default=None, metavar="DURATION",
              help="Wall-clock budget: 90s, 10m, 2h, 1h30m (or --steps).")
@click.option("--steps", "step_budget", type=click.IntRange(min=1), default=None, metavar="N",
              help="Budget in lockstep steps, over all workers (or --time).")
@click.option("--workers", type=click.IntRange(min=1), default=None, metavar="K",
              help="Worker processes, each on its own slices (default: one per core).")
@click.option("--db", default=None, metavar="PATH|redis://HOST:PORT/N",
              help="Example database (default .kvproof/hypothesis); a Redis URL shares it across machines "
                   "(pip install 'kvproof[redis]').")
@click.option("--seed", type=int, default=0, show_default=True,
              help="The campaign's seed: each run's seed derives from it, its slice and its index.")
@click.option("--mode", type=click.Choice(list(ENGINES)), default=DEFAULT_ENGINE, show_default=True,
              help="hypothesis: Hypothesis' engine; breadth: the same rules without it (swarm testing), failures "
                   "shrunk by replaying their vectors.")
@click.option("--resume", is_flag=True,
              help="Go on with the campaign this command ran before (the same command does that by default; this "
                   "flag makes it an error if there is none).")
@click.option("--fresh", is_flag=True, help="Start over: new runs from index 0, saved failures not replayed first.")
@click.option("--examples", type=click.IntRange(min=1), default=25, show_default=True,
              help="Examples per run (the budget is checked between runs).")
@click.option("--steps-per-example", type=click.IntRange(min=1), default=50, show_default=True,
              help="Most rules per example.")
@click.option("--op-timeout", type=float, default=60.0, show_default=True, callback=_positive_seconds,
              help="Seconds (> 0) one implementation call may take before it counts as hung.")
@click.option("--memory-limit", "memory_limit", type=click.IntRange(min=0), default=MEMORY_LIMIT_MB,
              show_default=True, metavar="MIB", help="MiB an implementation's process may grow by (0: no limit).")
@ACCEPT
@shrink_option(CAMPAIGN_SHRINKER)
@with_suite_options
def fuzz(impl_specs: tuple[str, ...], configs: tuple[str, ...], components: tuple[str, ...], duration: str | None,
         step_budget: int | None, workers: int | None, db: str | None, seed: int, mode: str, resume: bool,
         fresh: bool, examples: int, steps_per_example: int, op_timeout: float, memory_limit: int,
         accept: tuple[str, ...], shrink_with: str, suite_options: dict[str, str]) -> None:
    """A fuzzing campaign: the lockstep suites under a time or step budget on K workers, nothing lost.

    Failures are saved the moment they are found (the example database, .kvproof/failures/); the same command
    again replays them first and goes on with new runs. Ctrl-C stops (the summary is printed), a second Ctrl-C
    kills the workers. Exit codes: 0 no failure, 1 a failure (found or still failing), 2 bad input or a harness
    error, 130 Ctrl-C.
    """
    from kvproof.cli.fuzz import FuzzView, ctrl_c, summarize
    from kvproof.conformance.fuzz import Budget, Campaign, Ledger, parse_duration, plan_campaign
    from kvproof.conformance.plan import load_impls, plan

    console = _console()
    try:
        if resume and fresh:
            raise click.UsageError("--resume and --fresh contradict each other")
        budget = Budget(parse_duration(duration) if duration is not None else None, step_budget)
        the_plan = plan(components, load_impls(impl_specs), configs, None, suite_options, accept=_ids(accept))
        spec = plan_campaign(the_plan.tests, budget, workers=workers, seed=seed, engine=mode, db=db,
                             examples=examples, steps_per_example=steps_per_example, op_timeout=op_timeout,
                             memory_limit_mb=memory_limit, fresh=fresh, shrink_with=shrink_with)
        if resume and not Ledger(spec.campaign_id).resumed:
            raise click.UsageError(f"--resume: no campaign to resume (no {Ledger(spec.campaign_id).path})")
        view = FuzzView(console)
        campaign = Campaign(spec, view)
    except _usage_errors() as err:
        _bad_input(console, err)
    for warning in the_plan.warnings:
        console.print(f"[yellow]warning: {warning}[/]")
    resumed = campaign.ledger.resumed
    shrinker = f", shrink {spec.shrink_with}" if spec.engine == "hypothesis" else ""  # breadth: always the vector
    console.print(f"kvproof fuzz: {len(spec.tests)} slice(s), {spec.workers} worker(s), {budget.text()}, mode "
                  f"{spec.engine}{shrinker}, seed {spec.seed}, "
                  f"database {spec.db or '.kvproof/hypothesis'}"
                  + (f"; resuming campaign {spec.campaign_id}" if resumed else ""), markup=False, highlight=False)
    with ctrl_c(campaign, view):  # held through the summary: a second Ctrl-C while it prints is not a traceback
        try:
            status = campaign.run()
        finally:
            view.stop()
        code = summarize(console, campaign, status, the_plan.accepted)
        sys.stdout.flush()
        sys.stderr.flush()
        # the workers are joined and everything is written: exit now, not through the interpreter's teardown (it
        # resets SIGINT to its default first, so a second Ctrl-C in that window would kill the process)
        os._exit(code)


def _refuse_seed(profile: str, seed: int | None) -> None:
    """``--seed`` with a derandomized profile would be ignored: a usage error instead."""
    from kvproof.conformance.generation import forced_seed
    from kvproof.conformance.profiles import get_profile

    with forced_seed(seed, get_profile(profile).derandomize):
        pass


def _interrupted(console: Console, running: str | None) -> NoReturn:
    console.print(f"[yellow]interrupted (Ctrl-C) during {running or 'the run'}: the reports say "
                  "status 'interrupted'; failures found so far are saved under .kvproof/failures/[/]")
    sys.exit(EXIT_INTERRUPTED)


@main.command()
@PROFILE
@COMPONENTS
@JSON_REPORT
@JUNIT_XML
@with_isolation
def check(profile: str, components: tuple[str, ...], json_report: str | None, junit_xml: str | None,
          isolation: dict[str, Any]) -> None:
    """prove + conform of the built-in runtime + mutants; exit 0 only if everything passes.

    Exit codes: 0 pass, 1 a verdict, 2 bad input or a harness error, 130 Ctrl-C.
    """
    from kvproof.cli.conform import CLIEvents, conform_table, mutants_absent, mutants_table, print_reports, run_mutants
    from kvproof.cli.progress import Progress
    from kvproof.cli.prove import effective_workers, print_failures, print_results, wall_line
    from kvproof.cli.prove import prove as run_prove
    from kvproof.cli.reports import CHECK_FORMAT, mutants_json, mutants_junit, prove_json, prove_junit
    from kvproof.conformance.plan import plan, run_plan
    from kvproof.conformance.report import conform_json, conform_junit, header, write_document, write_junit_suites

    console = _console()
    parts: dict[str, Any] = {"prove": [], "conform": ([], None), "mutants": []}
    no_mutants = mutants_absent(components)

    def write(status: str) -> None:
        docs = {"prove": prove_json(parts["prove"], complete=status == "complete"),
                "mutants": mutants_json(parts["mutants"], complete=status == "complete", skipped=no_mutants)}
        suites = [prove_junit(parts["prove"])]
        outcomes, info = parts["conform"]
        if info is not None:
            docs["conform"] = conform_json(outcomes, info)
            suites.append(conform_junit(outcomes, info))
        suites.append(mutants_junit(parts["mutants"], no_mutants))
        if json_report:
            write_document(json_report, {"format": CHECK_FORMAT, **header(), "status": status,
                                         "complete": status == "complete", "profile": profile, **docs})
        if junit_xml:
            write_junit_suites(junit_xml, suites)

    def conform_progress(outcomes: list[Any], info: Any) -> None:
        parts["conform"] = (outcomes, info)
        write("running")

    try:
        proved_at, jobs = time.monotonic(), os.cpu_count() or 1
        with Progress(console) as progress:
            results = run_prove(components, progress=progress.update, jobs=jobs)  # obligations on every core
        parts["prove"] = results
        write("running")
        print_results(console, results)
        print_failures(console, results, show_counterexamples=False)
        console.print(wall_line(results, time.monotonic() - proved_at, effective_workers(jobs, len(results))),
                      highlight=False)
        events = CLIEvents(console, None, None, conform_progress)
        try:
            outcomes, info = run_plan(plan(components), profile=profile, events=events, replay_saved=True,
                                      **isolation)
        finally:
            events.progress.stop()
        reports = [o.report for o in outcomes if o.report is not None]
        no_suite = [(o.component, o.reason) for o in outcomes if o.status == "skipped" and o.report is None]
        console.print(conform_table(reports, console.width))
        print_reports(console, reports)
        _print_skipped(console, no_suite, "no conformance run")
        if info.status == "interrupted":
            write("interrupted")
            _interrupted(console, info.running)
        def mutants_progress(verdicts: list[Any]) -> None:
            parts["mutants"] = list(verdicts)
            write("running")

        with Progress(console) as progress:
            verdicts = run_mutants(profile, components, progress.update, mutants_progress, **isolation)
    except KeyboardInterrupt:
        write("interrupted")
        _interrupted(console, None)
    except _usage_errors() as err:
        _bad_input(console, err)
    write("complete")
    console.print(mutants_table(verdicts, console.width))
    _print_skipped(console, no_mutants, "no mutants")
    summary = Table(title="kvproof check")
    for col in ("part", "items", "passed", "skipped", "verdict"):
        summary.add_column(col, overflow="fold")
    # a part with nothing to run passes only when the registry declares why (its components are skipped)
    rows = [("prove (obligations + broken twins)", len(results), sum(r.ok for r in results), 0),
            ("conform (components x pool configs)", len(reports), sum(r.passed for r in reports), len(no_suite)),
            ("mutants killed (test the tester)", len(verdicts), sum(v.killed for v in verdicts), len(no_mutants))]
    for part, n, ok, skips in rows:
        summary.add_row(part, str(n), str(ok), str(skips), "[green]pass[/]" if ok == n and (n or skips)
                        else "[red]FAIL[/]")
    console.print(summary)
    sys.exit(0 if all(ok == n and (n or skips) for _, n, ok, skips in rows) else 1)


@main.command()
@PROFILE
@COMPONENTS
@JSON_REPORT
@JUNIT_XML
@with_isolation
def mutants(profile: str, components: tuple[str, ...], json_report: str | None, junit_xml: str | None,
            isolation: dict[str, Any]) -> None:
    """Test the tester: each component's suite must kill every deliberately broken runtime.

    Exit codes: 0 every mutant killed, 1 one survived, 2 bad input or a harness error, 130 Ctrl-C.
    """
    from kvproof.cli.conform import mutants_absent, mutants_table, run_mutants
    from kvproof.cli.progress import Progress
    from kvproof.cli.reports import mutants_json, mutants_junit
    from kvproof.conformance.report import write_document, write_junit_suites

    console = _console()
    so_far: list[Any] = []
    skipped = mutants_absent(components)

    def write(verdicts: list[Any], status: str) -> None:
        so_far[:] = verdicts
        if json_report:
            write_document(json_report, {**mutants_json(verdicts, complete=status == "complete", skipped=skipped),
                                         "status": status})
        if junit_xml:
            write_junit_suites(junit_xml, [mutants_junit(verdicts, skipped)])

    try:
        with Progress(console) as progress:
            verdicts = run_mutants(profile, components, progress.update, lambda v: write(v, "running"), **isolation)
    except KeyboardInterrupt:
        write(list(so_far), "interrupted")
        _interrupted(console, None)
    write(verdicts, "complete")
    console.print(mutants_table(verdicts, console.width))
    _print_skipped(console, skipped, "no mutants")
    sys.exit(0 if (verdicts or skipped) and all(v.killed for v in verdicts) else 1)


def _print_skipped(console: Console, skipped: list[tuple[str, str]], what: str) -> None:
    """Components a part of the run skips (the registry declares the layer absent), each with the reason."""
    for component, reason in skipped:
        console.print(f"[yellow]{component}: skipped, {what} ({reason})[/]", highlight=False)


@main.command()
@click.argument("vector_file", metavar="VECTOR")
@click.option("--impl", "impl_spec", default=None, metavar="MODULE:FACTORY",
              help="Implementation to replay on. Default: the one the vector was recorded on (its 'impl').")
@click.option("--op-timeout", type=float, default=60.0, show_default=True, callback=_positive_seconds,
              help="Seconds (> 0) one implementation call may take before it counts as hung.")
@HARM
@click.option("--harm-seed", type=int, default=0, show_default=True, metavar="N",
              help="Seed of the harm continuation's walks (--harm): the same seed, the same continuation.")
@click.option("--harm-tries", type=click.IntRange(min=1), default=32, show_default=True, metavar="N",
              help="Walks the harm continuation tries (--harm); the most severe harm wins, then the shortest walk.")
@with_isolation
def replay(vector_file: str, impl_spec: str | None, op_timeout: float, harm: bool, harm_seed: int, harm_tries: int,
           isolation: dict[str, Any]) -> None:
    """Replay a failure vector (a .json saved under .kvproof/failures/ or a report) without Hypothesis.

    Without --impl the vector's own implementation (its 'impl', a module:factory) is used; a
    vector recorded through the Python API under another name needs --impl. Exit 0 if every
    step and check passes on the implementation, 1 if it fails, 2 if the vector cannot be
    replayed (missing, malformed, no implementation to replay on, or a step's rule does not apply).
    With --harm a failure is followed past its divergence (kvproof.conformance.harm).
    """
    from kvproof.conformance.check import replay_vector
    from kvproof.conformance.errors import UsageError
    from kvproof.conformance.plan import load_factory
    from kvproof.conformance.vector import load_vector

    console = _console()
    try:
        if not os.path.exists(vector_file) and not vector_file.lstrip().startswith("{"):
            raise UsageError(f"VECTOR {vector_file!r}: no such file")
        vector = load_vector(vector_file)
        recorded = str(vector.get("impl", ""))
        if impl_spec is None and ":" not in recorded:
            raise UsageError(f"the vector was recorded on {recorded!r}, not a 'module:factory'; name the "
                             "implementation to replay on with --impl MODULE:FACTORY")
        spec = impl_spec or recorded
        factory = load_factory(spec)
        if impl_spec is None:
            console.print(f"replaying on {spec} (the vector's implementation; --impl to choose another)",
                          markup=False, highlight=False)
        result = replay_vector(vector, factory, impl_name=spec, op_timeout=op_timeout, **isolation)
    except _usage_errors() as err:
        console.print(f"[red]cannot replay {vector_file}: {err}[/]", highlight=False)
        sys.exit(2)
    where = f"{result.component} {result.config}, {len(vector['steps'])} recorded step(s)"
    if result.passed:
        console.print(f"{spec}: [green]pass[/] ({where})")
        sys.exit(0)
    console.print(f"{spec}: [red]FAIL[/] after {result.steps} step(s) ({where})")
    console.print(result.failure, markup=False, highlight=False, soft_wrap=True)
    if result.evidence is not None:
        from kvproof.conformance.findings import Evidence, declared_findings, label

        console.print(f"known finding: {label(Evidence.from_json(result.evidence), declared_findings(factory))}; "
                      f"evidence: {result.evidence}", markup=False, highlight=False, soft_wrap=True)
    if harm:
        from kvproof.conformance.harm import continue_for_harm

        found = continue_for_harm(vector, factory, impl_name=spec, op_timeout=op_timeout, tries=harm_tries,
                                  seed=harm_seed, **isolation)
        console.print(found.text(), markup=False, highlight=False, soft_wrap=True)
    sys.exit(1)


@main.command()
@COMPONENTS
@click.option("--quick", is_flag=True, help="Fewer repetitions (smoke run).")
@click.option("--bugs", is_flag=True,
              help="The bug-finding benchmark instead: time and steps to detect each mutant and scenario (median over "
                   "--seeds), shrunk lengths, steps/s and coverage per component, in both modes.")
@click.option("--seeds", type=click.IntRange(min=1), default=5, show_default=True, metavar="N",
              help="Seeds per bug and mode (--bugs).")
def bench(components: tuple[str, ...], quick: bool, bugs: bool, seeds: int) -> None:
    """Each component's benchmark section: throughput, harness overhead and capacity, as ratios of one run."""
    if bugs:
        from kvproof.cli.bench_bugs import run_bug_bench

        run_bug_bench(_console(), quick=quick, components=components, seeds=seeds)
        return
    from kvproof.cli.bench import run_bench

    run_bench(_console(), quick=quick, components=components)
