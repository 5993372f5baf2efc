"""pytest plugin: run kvproof's conformance suites against an implementation from any test session.

Registered by the package (entry point ``pytest11``); it only acts in sessions that
collect its test, ``kvproof.conformance.suite``::

    pytest --pyargs kvproof.conformance.suite --kvproof-impl mypkg.adapter:MyAllocator \
        [--kvproof-component swa_allocator] [--kvproof-config P4-W6-F48-S24] [--kvproof-profile ci] \
        [--kvproof-seed N] [--kvproof-policy upstream] [--kvproof-skip-file F] [--kvproof-xfail-file F]

It is presentation over the run planner (:mod:`kvproof.conformance.plan`), exactly like
``kvproof conform``: the same tests (one per component x config, id ``component/config``),
the same seeds and therefore the same examples. Choices come from the component registry
and the suites' own options. After collection it prints a report header (the
implementation, its version, its capabilities per component, the profile and the seed, as
array-api-tests does); each test records its counters as ``user_properties`` (so
``--junitxml`` carries them) and the session ends with the rules that were not applicable
(capabilities not declared) and the applicable rules no example reached. Skip and
expected-failure files work as for ``kvproof conform`` (expected failures are strict);
entries matching no test are warnings.
"""

from __future__ import annotations

import os
import random
import warnings
from typing import TYPE_CHECKING, Any

import pytest

from kvproof.conformance.modes import DEFAULT_SHRINKER, SHRINKERS
from kvproof.reference.registry import Component, options

if TYPE_CHECKING:  # the plugin loads in every pytest session: the harness is imported when a kvproof test runs
    from kvproof.conformance.plan import Plan, PlannedTest
    from kvproof.conformance.report import Outcome

__all__ = ["kvproof_profile", "kvproof_seed", "kvproof_test_run", "pytest_addoption", "pytest_generate_tests",
           "pytest_report_collectionfinish", "pytest_terminal_summary"]

_PLAN = pytest.StashKey["Plan"]()
_SEED = pytest.StashKey["int | str"]()
_OUTCOMES = pytest.StashKey["list[Outcome]"]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvproof", "kvproof conformance suites")
    group.addoption("--kvproof-impl", action="append", default=None, metavar="MODULE:FACTORY",
                    help="implementation factory, repeatable: each serves the components it declares "
                         "(default: $KVPROOF_IMPL, space-separated, else each component's torch runtime)")
    group.addoption("--kvproof-component", action="append", default=None, choices=[c.value for c in Component],
                    help="component suite to run; repeatable (default: all, or those the implementations declare)")
    group.addoption("--kvproof-config", action="append", default=None, metavar="LABEL",
                    help="run only this config (e.g. P4-W6-F48-S24); repeatable")
    group.addoption("--kvproof-profile", default="ci", help="Hypothesis profile: ci, dev, nightly or smoke")
    group.addoption("--kvproof-seed", type=int, default=None, help="seed of a randomized profile (default: chosen)")
    group.addoption("--kvproof-skip-file", default=None, help="lines 'component/config  # reason': skipped")
    group.addoption("--kvproof-xfail-file", default=None, help="lines 'component/config  # reason': expected to fail")
    group.addoption("--kvproof-shrink", default=DEFAULT_SHRINKER, choices=list(SHRINKERS),
                    help="who shrinks a failure: Hypothesis' shrinker, or kvproof's vector shrinker (as kvproof "
                         "conform --shrink)")
    for option in options():
        group.addoption(f"--kvproof-{option.name}", default=option.default, choices=list(option.choices),
                        help=option.help)


def _plan(config: pytest.Config) -> Plan:
    from kvproof.conformance.errors import HarnessError, UsageError
    from kvproof.conformance.plan import load_impls, plan
    from kvproof.conformance.profiles import get_profile
    from kvproof.conformance.report import load_selection
    from kvproof.reference.errors import ConfigError

    if _PLAN not in config.stash:
        opt = config.getoption
        specs = list(opt("kvproof_impl") or os.environ.get("KVPROOF_IMPL", "").split())
        selection = load_selection(opt("kvproof_skip_file"), opt("kvproof_xfail_file"))
        chosen = {o.name: str(opt(f"kvproof_{o.name}")) for o in options()}
        problem = ""
        try:
            the_plan = plan(opt("kvproof_component") or (), load_impls(specs), opt("kvproof_config") or (),
                            selection, chosen)
            profile = get_profile(opt("kvproof_profile"))
            seed = opt("kvproof_seed")
            if profile.derandomize and seed is not None:  # refused as `kvproof conform --seed` refuses it
                raise UsageError(f"--kvproof-seed {seed}: profile {opt('kvproof_profile')} is derandomized (each "
                                 "test's seed derives from its name); use a randomized profile (nightly, smoke)")
        except (HarnessError, ConfigError) as err:
            problem = str(err)
        if problem:  # bad input: one line naming it, not a traceback
            pytest.fail(f"kvproof: {problem}", pytrace=False)
        config.stash[_PLAN] = the_plan
        config.stash[_SEED] = ("derandomized (derived from each test)" if profile.derandomize
                               else seed if seed is not None else random.randrange(2**32))
        config.stash[_OUTCOMES] = []
    return config.stash[_PLAN]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "kvproof_test" not in metafunc.fixturenames:
        return
    the_plan = _plan(metafunc.config)
    params = []
    for test in the_plan.tests:
        marks: list[Any] = []
        if test.selected and test.selected[0] == "skip":
            marks.append(pytest.mark.skip(reason=test.selected[1]))
        elif test.selected:
            marks.append(pytest.mark.xfail(reason=test.selected[1], strict=True))
        params.append(pytest.param(test, id=test.test_id, marks=marks))
    for component, reason in the_plan.absent:  # no suite yet: a skip with the registry's reason, counted by pytest
        params.append(pytest.param(None, id=f"{component.value}/no-suite",
                                   marks=[pytest.mark.skip(reason=f"{component.value}: {reason}")]))
    for warning in the_plan.warnings:
        warnings.warn(warning, stacklevel=1)
    metafunc.parametrize("kvproof_test", params)


def pytest_report_collectionfinish(config: pytest.Config, start_path: Any, items: list[pytest.Item]) -> list[str]:
    """The report header: implementation, version, capabilities, profile and seed (only if the suite was collected)."""
    if _PLAN not in config.stash:
        return []
    from kvproof.conformance.report import impl_version

    the_plan = config.stash[_PLAN]
    lines = [f"kvproof: profile {config.getoption('kvproof_profile')}, seed {config.stash[_SEED]}"]
    shown: set[tuple[str, str]] = set()
    for test in the_plan.tests:
        key = (test.impl.spec, test.component.value)
        if key in shown:
            continue
        shown.add(key)
        try:
            impl = test.impl.factory(test.config)
            caps = ", ".join(sorted(c.value for c in impl.capabilities)) or "none"
            version = impl_version(impl, test.impl.factory)
        except Exception as err:  # noqa: BLE001 - the test itself will report the factory failure as a verdict
            caps, version = f"(factory failed: {type(err).__name__}: {err})", "unknown"
        lines.append(f"kvproof: {test.component.value}: {test.impl.spec} ({version}); capabilities: {caps}")
    return lines


@pytest.fixture
def kvproof_profile(request: pytest.FixtureRequest) -> str:
    return str(request.config.getoption("kvproof_profile"))


@pytest.fixture
def kvproof_seed(request: pytest.FixtureRequest) -> int | str:
    _plan(request.config)
    return request.config.stash[_SEED]


def kvproof_test_run(request: pytest.FixtureRequest, test: PlannedTest) -> Outcome:
    """Run one planned test under the session's seed and record its counters (used by the suite's test)."""
    from kvproof.conformance.generation import forced_seed
    from kvproof.conformance.plan import run_planned
    from kvproof.conformance.profiles import get_profile

    seed = request.config.stash[_SEED]
    profile = str(request.config.getoption("kvproof_profile"))
    with forced_seed(seed if isinstance(seed, int) else None, get_profile(profile).derandomize) as used:
        outcome = run_planned(test, profile=profile, seed=used,
                              shrink_with=str(request.config.getoption("kvproof_shrink")))
    request.config.stash[_OUTCOMES].append(outcome)
    report = outcome.report
    if report is not None:
        for key, value in (("examples", report.examples), ("steps", report.steps), ("fingerprint", report.fingerprint),
                           ("not_applicable", ",".join(report.not_applicable)),
                           ("never_run", ",".join(report.never_run))):
            request.node.user_properties.append((f"kvproof.{key}", value))
    return outcome


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """Not-applicable and never-executed rules of every kvproof test that ran: counted, never silent."""
    outcomes = config.stash.get(_OUTCOMES, [])
    if not outcomes:
        return
    terminalreporter.section("kvproof")
    for o in outcomes:
        r = o.report
        if r is None:
            continue
        terminalreporter.write_line(f"{o.component}/{o.config}: {o.status}, {r.examples} examples, {r.steps} steps")
        if r.not_applicable:
            terminalreporter.write_line(f"  not applicable (capabilities not declared): {', '.join(r.not_applicable)}")
        if r.never_run:
            terminalreporter.write_line(f"  rules never executed: {', '.join(r.never_run)}")
