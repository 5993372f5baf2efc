"""The run planner: which tests a conformance run consists of, and running them (habit 4: one planner).

``kvproof conform`` / ``kvproof check`` and the pytest plugin are presentation over
this module. A run is planned from

* the components (default: those the given implementations declare, else all of the
  registry), each with its suite's default configs, narrowed by config labels;
* the implementations (``--impl module:factory``, repeatable, or ``$KVPROOF_IMPL``):
  each serves the components it declares in ``components`` (a set of
  ``kvproof.reference.registry.Component``); one that declares none serves any; a
  component no given implementation serves is a usage error; without any, each
  component's default implementation from the registry (kvproof's torch runtime);
* the suites' own options (``--policy`` of ``decode_prealloc``);
* skip and expected-failure files (:mod:`kvproof.conformance.report`).

A chosen component whose suite the registry declares absent (``ComponentInfo.absent``) is no
test: the plan lists it in ``absent`` with the declared reason, and :func:`run_plan` reports it
as a ``skipped`` outcome (config :data:`NO_SUITE`), counted like any other skip.

:func:`plan` returns the :class:`PlannedTest` list (one per component x config, id
``component/config``) and the warnings; :func:`run_planned` runs one and classifies it;
:func:`run_plan` runs them all under one seed and returns what every report states.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

from kvproof.conformance.check import DEFAULT_OP_TIMEOUT, CheckReport, get_suite, run_check
from kvproof.conformance.errors import ImplSpecError, RunInterrupted, UsageError
from kvproof.conformance.findings import declared_findings, followed_by, unseen
from kvproof.conformance.generation import forced_seed
from kvproof.conformance.harm import continue_for_harm
from kvproof.conformance.isolation import DEFAULT_MEMORY_LIMIT_MB
from kvproof.conformance.lockstep import RunProgress
from kvproof.conformance.modes import DEFAULT_SHRINKER
from kvproof.conformance.profiles import get_profile
from kvproof.conformance.report import Outcome, RunInfo, Selection, impl_version
from kvproof.reference.registry import Component, Layer, info, parse_components

__all__ = ["ACCEPTED", "NO_SUITE", "Impl", "Plan", "PlannedTest", "RunEvents", "declared_components", "load_factory",
           "load_impls", "plan", "run_plan", "run_planned"]

#: The config column of a component skipped because it has no lockstep suite yet.
NO_SUITE = "(no suite)"


def load_factory(spec: str) -> Callable[..., Any]:
    """Import ``module:attr`` and return the callable; :class:`ImplSpecError` says what is wrong."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ImplSpecError(f"--impl must look like 'package.module:factory', got {spec!r}")
    try:
        module = _import(module_name)
    except ImportError as err:
        raise ImplSpecError(f"--impl {spec!r}: cannot import {module_name!r}: {err} (kvproof imports it with the "
                            f"current directory {os.getcwd()} on sys.path, as `python -m` does; run from the "
                            "directory that contains the package, add its parent to PYTHONPATH, or pip install "
                            "it)") from err
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ImplSpecError(f"--impl {spec!r}: {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ImplSpecError(f"--impl {spec!r}: {attr!r} is not callable")
    return target


def _import(module_name: str) -> Any:
    """Import ``module_name``; if its top-level package is not found, again with the working directory on sys.path.

    ``python -m`` puts the working directory first on ``sys.path``; the ``kvproof`` console
    script and ``pytest --pyargs`` do not, so an adapter next to the user (``mypkg/adapter.py``)
    would not be found. It is appended, not prepended: an installed package of the same name wins.
    """
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        cwd = os.getcwd()
        if err.name != module_name.split(".")[0] or cwd in sys.path or "" in sys.path:
            raise
        sys.path.append(cwd)
        return importlib.import_module(module_name)


def declared_components(factory: Any) -> tuple[Component, ...] | None:
    """The components a factory declares it serves (``components``), or ``None`` if it declares none.

    A name that is not in the registry is an ``UnknownComponent`` error naming the choices.
    """
    declared = getattr(factory, "components", None)
    return None if declared is None else parse_components(declared)


@dataclass(frozen=True)
class Impl:
    """An implementation given to a run: how it was named, its factory, the components it serves."""

    spec: str
    factory: Callable[..., Any]
    serves: tuple[Component, ...] | None  # None: serves any component

    @classmethod
    def load(cls, spec: str) -> Impl:
        factory = load_factory(spec)
        return cls(spec, factory, declared_components(factory))


def load_impls(specs: Iterable[str]) -> tuple[Impl, ...]:
    return tuple(Impl.load(spec) for spec in specs)


def _impl_for(component: Component, given: Sequence[Impl]) -> Impl:
    for impl in given:
        if impl.serves is not None and component in impl.serves:
            return impl
    for impl in given:
        if impl.serves is None:
            return impl
    if given:
        raise UsageError(f"no --impl serves component {component.value!r}; they declare "
                         f"{ {i.spec: [c.value for c in i.serves or ()] for i in given} }")
    default = info(component).default_impl
    return Impl(default, load_factory(default), None)


@dataclass(frozen=True)
class PlannedTest:
    """One test of a run: a component's suite on one config, against one implementation."""

    component: Component
    config: Any
    impl: Impl
    options: Mapping[str, Any] = field(default_factory=dict)  # machine options
    option_args: Mapping[str, str] = field(default_factory=dict)  # the CLI values behind them
    selected: tuple[str, str] | None = None  # ("skip" | "xfail", reason)

    @property
    def test_id(self) -> str:
        return f"{self.component.value}/{self.config.label()}"

    def replay_command(self, profile: str, seed: int | None, shrink_with: str = DEFAULT_SHRINKER) -> str:
        """The ``kvproof conform`` command that runs this test again: the same examples (``seed``) and the same
        shrinker, so it ends at the same shrunk failure (``--shrink`` only where it is not the default)."""
        extra = "".join(f" --{name} {value}" for name, value in self.option_args.items())
        return (f"kvproof conform --component {self.component.value} --impl {self.impl.spec} "
                f"--config {self.config.label()} --profile {profile}{extra}"
                + (f" --seed {seed}" if isinstance(seed, int) else "")
                + (f" --shrink {shrink_with}" if shrink_with != DEFAULT_SHRINKER else ""))


@dataclass(frozen=True)
class Plan:
    tests: tuple[PlannedTest, ...]
    impls: tuple[Impl, ...]
    warnings: tuple[str, ...] = ()
    #: chosen components without a suite, each with the registry's reason (reported as skipped)
    absent: tuple[tuple[Component, str], ...] = ()
    #: the known findings the run looks past (``--accept``: kvproof.conformance.findings), by component
    accepted: tuple[tuple[Component, str], ...] = ()

    def skipped(self) -> list[Outcome]:
        """The ``skipped`` outcome of every component without a suite."""
        return [Outcome(c.value, NO_SUITE, "skipped", reason) for c, reason in self.absent]

    def impl_names(self) -> str:
        return ", ".join(dict.fromkeys(t.impl.spec for t in self.tests)) or ", ".join(i.spec for i in self.impls)


def plan(components: Iterable[Component | str] = (), impls: Sequence[Impl] = (), labels: Sequence[str] = (),
         selection: Selection | None = None, suite_options: Mapping[str, str] | None = None,
         accept: Sequence[str] = ()) -> Plan:
    """The tests of a run (see the module docstring); :class:`UsageError` for a label no config has.

    ``accept``: ids of known findings to look past (:mod:`kvproof.conformance.findings`); each goes to the tests of
    the components whose implementation declares it with a behaviour the suite follows, and one no test can take is
    a :class:`UsageError` naming those that can."""
    wanted = parse_components(components)
    if not wanted:
        declared = [impl.serves for impl in impls]
        wanted = tuple(Component) if not impls or None in declared else parse_components(
            c for serves in declared for c in serves or ())
    absent = tuple((c, info(c).absent[Layer.SUITE]) for c in wanted if not info(c).has(Layer.SUITE))
    suites = [get_suite(c) for c in wanted if info(c).has(Layer.SUITE)]
    known = {cfg.label() for suite in suites for cfg in suite.configs}
    unknown = [label for label in labels if label not in known]
    if unknown:
        raise UsageError(f"unknown config(s) {unknown}; choose from {sorted(known)}")
    selection = selection or Selection()
    chosen = dict(suite_options or {})
    tests = []
    accepted: list[tuple[Component, str]] = []
    for suite in suites:
        impl = _impl_for(suite.component, impls)
        options = suite.options(chosen)
        option_args = suite.option_values(chosen)
        mine = _acceptable(suite, impl, accept)
        if mine:
            options = {**options, "accept": mine}
            accepted += [(suite.component, f) for f in mine]
        for cfg in suite.configs:
            if labels and cfg.label() not in labels:
                continue
            test_id = f"{suite.component.value}/{cfg.label()}"
            tests.append(PlannedTest(suite.component, cfg, impl, options, option_args, selection.match(test_id)))
    unknown_ids = [a for a in dict.fromkeys(accept) if a not in {f for _, f in accepted}]
    if unknown_ids:
        can = sorted({f"{f} ({suite.component.value})" for suite in suites
                      for f in _acceptable(suite, _impl_for(suite.component, impls), None)})
        raise UsageError(f"--accept {', '.join(unknown_ids)}: no component of this run can look past it (a finding "
                         f"its implementation declares, with a behaviour the suite follows); choose from "
                         f"{can or 'none'}")
    undeclared = [] if parse_components(components) else [
        f"{impl.spec} declares no `components`, so it runs every suite ({', '.join(c.value for c in wanted)}); "
        "declare the ones it implements, e.g. components = frozenset({Component.SWA_ALLOCATOR})"
        for impl in impls if impl.serves is None]
    return Plan(tuple(tests), tuple(impls), tuple(undeclared + selection.unmatched()), absent, tuple(accepted))


def _acceptable(suite: Any, impl: Impl, wanted: Sequence[str] | None) -> tuple[str, ...]:
    """The ids among ``wanted`` (``None``: all) of the findings ``impl`` declares for the suite's component with a
    behaviour the suite follows."""
    findings = declared_findings(impl.factory)
    followed = set(followed_by(suite.machine))
    can = [f.id for f in findings if suite.component.value in f.components and f.behaviour in followed]
    return tuple(f for f in can if wanted is None or f in wanted)


def run_planned(test: PlannedTest, *, profile: str, seed: int | None = None,
                op_timeout: float | None = DEFAULT_OP_TIMEOUT, replay_saved: bool = False,
                progress: Callable[[RunProgress], None] | None = None, isolation: str = "process",
                memory_limit_mb: int = DEFAULT_MEMORY_LIMIT_MB, harm: bool = False,
                shrink_with: str = DEFAULT_SHRINKER) -> Outcome:
    """Run one planned test (not its skip: the caller decides) and classify the result.

    ``isolation`` / ``memory_limit_mb``: see :func:`~kvproof.conformance.check.run_check`. ``harm``: a failure
    with a vector goes on past its divergence on the implementation alone (:mod:`kvproof.conformance.harm`); the
    continuation is printed under the failure and kept in the report. ``shrink_with``: who shrinks a failure (see
    :func:`~kvproof.conformance.check.run_check`).
    """
    if test.selected and test.selected[0] == "skip":
        return Outcome(test.component.value, test.config.label(), "skipped", test.selected[1])
    report = run_check(test.component, test.impl.factory, test.config, profile=profile, impl_name=test.impl.spec,
                       replay=test.replay_command(profile, seed, shrink_with), op_timeout=op_timeout,
                       replay_saved=replay_saved, progress=progress, isolation=isolation,
                       memory_limit_mb=memory_limit_mb, shrink_with=shrink_with, **test.options)
    if harm and report.failure is not None and report.vector is not None:
        found = continue_for_harm(report.vector, test.impl.factory, impl_name=test.impl.spec, op_timeout=op_timeout,
                                  isolation=isolation, memory_limit_mb=memory_limit_mb)
        report = replace(report, failure=f"{report.failure}\n\n{found.text()}", harm=found.to_json())
    status, reason = "passed" if report.passed else "failed", test.selected[1] if test.selected else ""
    if report.checked_nothing:  # not a pass: the implementation was never called
        status, reason = "skipped", report.nothing_checked()
    elif test.selected:  # an expected failure
        status = "xpassed" if report.passed else "xfailed"
    return Outcome(test.component.value, test.config.label(), status, reason, report)


class RunEvents:
    """What a front end hears while a plan runs (all no-ops here; the CLI prints, reports, shows progress)."""

    def started(self, info: RunInfo) -> None:
        """Before the first test: the seed is known."""

    def test_started(self, test: PlannedTest) -> None:
        """A test begins."""

    def example(self, test: PlannedTest, examples: int, shrinking: bool) -> None:
        """An example of ``test`` begins (``shrinking``: a failure was found and is being shrunk)."""

    def progressed(self, outcomes: list[Outcome], info: RunInfo) -> None:
        """Before and after every test (``info.status == "running"``; ``info.running`` names the test under way,
        ``None`` after one finished) and once at the end (``complete`` / ``interrupted`` / ``aborted``): what
        to write to incremental reports."""


def run_plan(the_plan: Plan, *, profile: str, seed: int | None = None, op_timeout: float | None = DEFAULT_OP_TIMEOUT,
             on_report: Callable[[CheckReport], None] | None = None, events: RunEvents | None = None,
             replay_saved: bool = False, isolation: str = "process",
             memory_limit_mb: int = DEFAULT_MEMORY_LIMIT_MB, harm: bool = False,
             shrink_with: str = DEFAULT_SHRINKER) -> tuple[list[Outcome], RunInfo]:
    """Run every planned test under one seed; the outcomes and what every report states about the run.

    Ctrl-C ends the run: the interrupted test is an ``interrupted`` outcome (with the failure
    it had found, if any) and the returned info's status is ``interrupted``. Any other
    exception out of a test tells ``events`` the run was ``aborted`` and propagates.
    A ``--seed`` with a derandomized profile is a :class:`UsageError`.
    """
    events = events or RunEvents()
    outcomes: list[Outcome] = the_plan.skipped()
    versions: set[str] = set()
    derandomized = get_profile(profile).derandomize
    ids = [t.test_id for t in the_plan.tests]

    def state(status: str, running: str | None = None, done: int = 0) -> RunInfo:
        return RunInfo(the_plan.impl_names(), "; ".join(sorted(versions)) or "unknown", used_seed, profile,
                       the_plan.warnings, derandomized, status, running, tuple(ids[done + (running is not None):]))

    with forced_seed(seed, derandomized) as used_seed:
        events.started(state("running", None, 0))
        for i, test in enumerate(the_plan.tests):
            events.test_started(test)
            events.progressed(outcomes, state("running", test.test_id, i))

            def progress(done: RunProgress, test: PlannedTest = test) -> None:
                events.example(test, done.examples, done.shrinking)

            try:
                outcome = run_planned(test, profile=profile, seed=used_seed, op_timeout=op_timeout,
                                      replay_saved=replay_saved, progress=progress, isolation=isolation,
                                      memory_limit_mb=memory_limit_mb, harm=harm, shrink_with=shrink_with)
            except KeyboardInterrupt as err:
                report = err.report if isinstance(err, RunInterrupted) else None
                outcomes.append(Outcome(test.component.value, test.config.label(), "interrupted",
                                        "interrupted (Ctrl-C)", cast(CheckReport | None, report)))
                info_ = state("interrupted", test.test_id, i)
                events.progressed(outcomes, info_)
                return outcomes, info_
            except BaseException:
                events.progressed(outcomes, state("aborted", test.test_id, i))
                raise
            outcomes.append(outcome)
            if outcome.report is not None:
                versions.add(outcome.report.impl_version or impl_version(None, test.impl.factory))
                if on_report:
                    on_report(outcome.report)
            events.progressed(outcomes, state("running", None, i + 1))
        outcomes += _unseen_accepted(the_plan, outcomes)
        info_ = state("complete", None, len(ids))
    events.progressed(outcomes, info_)
    return outcomes, info_


#: The config column of the outcome that fails a run for an accepted finding it never saw.
ACCEPTED = "(accepted, never seen)"


def _unseen_accepted(the_plan: Plan, outcomes: Sequence[Outcome]) -> list[Outcome]:
    """A failed outcome for each finding the run was told to look past and none of its component's tests saw
    (strict, as an expected failure that passes: the implementation changed, or the run cannot reach it)."""
    out = []
    for component, finding in the_plan.accepted:
        ran = [o.report for o in outcomes if o.report is not None and o.component == component.value]
        counts = [r.accepted for r in ran if not r.checked_nothing]
        if (counts or not ran) and unseen((finding,), counts):  # not where every run checked nothing (skipped)
            out.append(Outcome(component.value, ACCEPTED, "failed",
                               f"--accept {finding}: the run was told to look past {finding}, and it never occurred "
                               f"in {len(counts)} run(s) of {component.value} (drop --accept {finding}: the "
                               "implementation changed, or this run cannot reach it)"))
    return out
