"""``kvproof bench --bugs``: the bug-finding benchmark (issue 14).

For every bug kvproof knows how to plant -- each component's runtime mutants, and the reference-variant scenarios
of sglang_semantics.md §9 (S2, S8, S9, S10) and the mismatched collective T5 -- a lockstep run against the buggy
implementation under each mode (Hypothesis' engine and the breadth driver), from ``seeds`` different seeds,
config after config as ``kvproof mutants`` goes, until one config catches it. Per bug and mode it prints:

* **found** -- how many seeds found it within the ``ci`` budget (60 examples of 30 steps per config);
* **time / steps to detect** -- the median, over the seeds that found it, of the seconds and lockstep steps from the
  first config's start to the first failing example (before any shrinking; the configs that passed before it
  count);
* **shrunk length** -- the median number of operations in the failure's shrunk vector.

A second table gives each component's steps/s under both modes and its coverage on the same budget: rules run of
those declared, and structural dimensions at their maximum (:meth:`~kvproof.conformance.lockstep.Lockstep.structure`);
and how much sooner the breadth mode finds that component's bugs (:func:`sooner`: what a campaign's speed is for,
beside the steps/s both modes spend on a correct implementation). A last line gives the same over every bug.
Every number comes from runs made by this command; nothing is cached between invocations.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hypothesis import settings as hypothesis_settings
from rich.console import Console
from rich.table import Table

from kvproof.conformance.check import CheckReport, get_suite, mutants_of, run_check, structure_unreached
from kvproof.conformance.errors import HarnessBug
from kvproof.conformance.modes import ENGINES
from kvproof.conformance.plan import PlannedTest, load_impls, plan
from kvproof.conformance.profiles import get_profile
from kvproof.reference.registry import Component, parse_components

__all__ = ["SCENARIOS", "BugTarget", "Detection", "Sooner", "bug_targets", "detect", "run_bug_bench", "sooner"]

MODES = ENGINES  # every engine, Hypothesis' first


@dataclass(frozen=True)
class Scenario:
    """A known bug planted by a run option of the reference (a policy, budget or protocol variant) on the default
    implementation: ``configs`` names the configs it runs on (label prefixes; empty: all)."""

    name: str
    component: Component
    options: dict[str, str]
    configs: tuple[str, ...] = ()


#: The §9 scenarios the suites find through a run option (S3 is the mutant ``stale_tail_mapping``).
SCENARIOS: tuple[Scenario, ...] = (
    Scenario("S2 (--policy upstream)", Component.DECODE_PREALLOC, {"policy": "upstream"}),
    Scenario("S8 (--budget pre_27391)", Component.ADMISSION, {"budget": "pre_27391"}, ("long_tombstone",)),
    Scenario("S9 (--budget upstream_27391)", Component.ADMISSION, {"budget": "upstream_27391"}, ("long_tombstone",)),
    Scenario("S10 (--variant pre_27264)", Component.TP_PREFETCH, {"variant": "pre_27264"}, ("pair",)),
    Scenario("T5 (--ranks mixed)", Component.TP_PREFETCH, {"ranks": "mixed"}, ("pair",)),
)


@dataclass(frozen=True)
class BugTarget:
    """One planted bug: the tests (config and options) a run goes through in order, and the buggy factory."""

    component: Component
    name: str
    tests: tuple[PlannedTest, ...]
    factory: Callable[[Any], Any]


def bug_targets(components: Iterable[Component | str] = (), quick: bool = False) -> list[BugTarget]:
    """Every mutant and scenario of the chosen components (``quick``: the first mutant of each, and the
    scenarios)."""
    out: list[BugTarget] = []
    for component in parse_components(components) or tuple(Component):
        tests = plan((component,), load_impls(()), (), None, {}).tests
        mutants = list(mutants_of(component).items())
        for name, factory in mutants[:1] if quick else mutants:
            out.append(BugTarget(component, name + (" (S3)" if name == "stale_tail_mapping" else ""), tests, factory))
        for scenario in SCENARIOS:
            if scenario.component is not component:
                continue
            planned = [t for t in plan((component,), load_impls(()), (), None, scenario.options).tests
                       if not scenario.configs or t.config.label().startswith(scenario.configs)]
            out.append(BugTarget(component, scenario.name, tuple(planned), planned[0].impl.factory))
    return out


@dataclass(frozen=True)
class Detection:
    """One run of a target under one mode and seed: whether it found the bug, when, and the shrunk length."""

    found: bool
    seconds: float  # to the first failing example (or the whole run when not found)
    steps: int
    shrunk: int | None  # operations in the shrunk vector


def _settings() -> hypothesis_settings:
    """``ci``'s budget, randomized: each seed its own examples (``ci`` itself is derandomized)."""
    return hypothesis_settings(get_profile("ci"), derandomize=False, database=None)


def detect(target: BugTarget, mode: str, seed: int) -> Detection:
    """Run ``target`` config after config until one finds it; the time and steps before its first failing example."""
    seconds, steps = 0.0, 0
    for test in target.tests:
        report = run_check(test.component, target.factory, test.config, settings=_settings(), seed=seed,
                           engine=mode, impl_name=f"bug {target.name}", failures_dir=None, **test.options)
        if report.passed:
            seconds, steps = seconds + report.seconds, steps + report.steps
            continue
        at_s = report.detected_seconds if report.detected_seconds is not None else report.seconds
        at_steps = report.detected_steps if report.detected_steps is not None else report.steps
        shrunk = len(report.vector["steps"]) if report.vector else None
        return Detection(True, seconds + at_s, steps + at_steps, shrunk)
    return Detection(False, seconds, steps, None)


@dataclass
class Coverage:
    """One component's default runs under one mode: steps/s, rules run, structural dimensions at their maximum."""

    steps: int = 0
    seconds: float = 0.0
    rules_run: set[str] = field(default_factory=set)
    rules: set[str] = field(default_factory=set)
    reports: list[CheckReport] = field(default_factory=list)


def coverage(component: Component, mode: str, seed: int) -> Coverage:
    out = Coverage()
    for test in plan((component,), load_impls(()), (), None, {}).tests:
        report = run_check(test.component, test.impl.factory, test.config, settings=_settings(), seed=seed,
                           engine=mode, impl_name=test.impl.spec, failures_dir=None, isolation="in-process",
                           **test.options)
        if not report.passed:
            raise HarnessBug(f"bench --bugs: the default run of {test.test_id} failed: {report.failure}")
        out.steps += report.steps
        out.seconds += report.seconds
        declared = set(get_suite(component).needs(test.config)) - set(report.not_applicable) - {"misuse"}
        out.rules |= declared
        out.rules_run |= declared - set(report.never_run)
        out.reports.append(report)
    return out


@dataclass(frozen=True)
class Sooner:
    """How much sooner the breadth mode finds bugs than Hypothesis' engine, over the bugs both modes found (by at
    least one seed each): the geometric mean of the ratio of their median seconds to detect (Hypothesis' over
    breadth's: above 1, breadth is sooner), and of their median steps (a step counted as at least 1). A bug one mode
    alone found is counted apart, never in a ratio: a ratio over what both found says nothing of what one missed."""

    bugs: int
    seconds: float | None
    steps: float | None
    found_by_one: dict[str, int]  # mode -> bugs that mode alone found
    seeds: dict[str, tuple[int, int]]  # mode -> (seeds that found a bug, seeds run), over every bug

    def cell(self) -> str:
        if self.seconds is None or self.steps is None:
            return "-"
        alone = ", ".join(f"{n} {mode} only" for mode, n in self.found_by_one.items() if n)
        return f"{self.seconds:.2f}x ({self.steps:.2f}x) over {self.bugs} bugs" + (f"; {alone}" if alone else "")


def sooner(results: dict[str, Any], component: Component | None = None) -> Sooner:
    """:class:`Sooner` over ``results`` (:func:`run_bug_bench`'s, keyed ``component/bug/mode``; the coverage rows are
    not bugs), of one component or of all."""
    found: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    seeds = dict.fromkeys(MODES, (0, 0))
    for key, summary in results.items():
        comp, rest = key.split("/", 1)
        bug, mode = rest.rsplit("/", 1)
        if bug == "coverage" or (component is not None and comp != component.value):
            continue
        hit, run = seeds[mode]
        seeds[mode] = (hit + summary["found"], run + summary["seeds"])
        if summary["found"]:
            found.setdefault((comp, bug), {})[mode] = summary
    both = [by_mode for by_mode in found.values() if set(by_mode) == set(MODES)]
    by_one = {mode: sum(1 for by_mode in found.values() if set(by_mode) == {mode}) for mode in MODES}

    def mean_ratio(measure: str, least: float) -> float | None:
        ratios = [max(m["hypothesis"][measure], least) / max(m["breadth"][measure], least) for m in both]
        return math.exp(statistics.fmean(math.log(r) for r in ratios)) if ratios else None

    return Sooner(len(both), mean_ratio("seconds", 0.0), mean_ratio("steps", 1), by_one, seeds)


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def run_bug_bench(console: Console, *, quick: bool = False, components: Iterable[Component | str] = (),
                  seeds: int = 5) -> dict[str, Any]:
    """The benchmark (module docstring); the numbers, by target and mode."""
    if seeds < 1:
        raise HarnessBug("bench --bugs needs at least one seed")
    chosen = parse_components(components) or tuple(Component)
    # names fold rather than end in an ellipsis, and numbers are never cut: a log of 150 columns shows every name whole
    table = Table(title=f"kvproof bench --bugs: time to detect, median over {seeds} seeds ('ci' budget, randomized)",
                  caption="found: seeds that found it; s, steps: the median seconds and lockstep steps to the first "
                          "failing example; shrunk: the median shrunk length")
    for col in ("component", "bug"):
        table.add_column(col, overflow="fold")
    for mode in MODES:
        for col in ("found", "s", "steps", "shrunk"):
            table.add_column(f"{mode}\n{col}", justify="right", min_width=6)
    results: dict[str, Any] = {}
    for target in bug_targets(chosen, quick):
        row = [target.component.value, target.name]
        for mode in MODES:
            runs = [detect(target, mode, seed) for seed in range(seeds)]
            hits = [r for r in runs if r.found]
            shrunk = [r.shrunk for r in hits if r.shrunk is not None]
            summary = {"found": len(hits), "seeds": seeds, "seconds": _median([r.seconds for r in hits]),
                       "steps": _median([r.steps for r in hits]), "shrunk": _median(shrunk)}
            results[f"{target.component.value}/{target.name}/{mode}"] = summary
            row += [f"{len(hits)}/{seeds}", _cell(summary["seconds"], ".2f"), _cell(summary["steps"], ",.0f"),
                    _cell(summary["shrunk"], ".0f")]
        table.add_row(*row)
    console.print(table)

    cov = Table(title="kvproof bench --bugs: each component's default runs ('ci' budget, seed 0)",
                caption="breadth sooner: Hypothesis' median seconds (steps) to detect over breadth's, the geometric "
                        "mean over the bugs both modes found")
    cov.add_column("component", overflow="fold")
    for mode in MODES:
        cov.add_column(f"{mode}\nsteps/s", justify="right", min_width=6)
    cov.add_column("breadth /\nhypothesis", justify="right", min_width=6)
    cov.add_column("breadth\nsooner", justify="right", min_width=6)
    for mode in MODES:
        cov.add_column(f"{mode}\nrules run", justify="right", min_width=6)
        cov.add_column(f"{mode}\nstructure at max", justify="right", min_width=6)
    for component in chosen:
        measured = {mode: coverage(component, mode, 0) for mode in MODES}
        rates = {mode: c.steps / c.seconds if c.seconds else 0.0 for mode, c in measured.items()}
        row = [component.value, *(f"{rates[m]:,.0f}" for m in MODES),
               f"{rates['breadth'] / rates['hypothesis']:.2f}x" if rates["hypothesis"] else "-",
               sooner(results, component).cell()]
        for mode in MODES:
            c = measured[mode]
            declared = {d for r in c.reports for d in r.structure_targets}
            missed = structure_unreached(c.reports)
            row += [f"{len(c.rules_run)}/{len(c.rules)}", f"{len(declared) - len(missed)}/{len(declared)}"]
            results[f"{component.value}/coverage/{mode}"] = {
                "steps_per_s": rates[mode], "rules_run": len(c.rules_run), "rules": len(c.rules),
                "structure_at_max": len(declared) - len(missed), "structure": len(declared)}
        cov.add_row(*row)
    console.print(cov)
    overall = sooner(results)
    console.print(f"every bug: breadth sooner {overall.cell()}; seeds that found "
                  "their bug: " + ", ".join(f"{mode} {hit}/{run}" for mode, (hit, run) in overall.seeds.items()),
                  highlight=False)
    console.print("rerun: kvproof bench --bugs" + (" --quick" if quick else "") + f" --seeds {seeds}"
                  + "".join(f" --component {c.value}" for c in parse_components(components)), highlight=False)
    return results
