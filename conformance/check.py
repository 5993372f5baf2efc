"""Run a component's lockstep suite against any implementation, with or without pytest.

In the style of trio's ``check_*`` functions: the caller passes a factory
``Callable[[config], implementation]``. :func:`run_check` returns a :class:`CheckReport`
(it never raises for a misbehaving implementation) and :func:`check` raises
:class:`~kvproof.conformance.errors.ConformanceFailure` when the report is not a pass.
Every failure is also written to ``.kvproof/failures/`` with the operation trace,
Hypothesis' falsifying program and a replayable vector, so nothing a run finds is lost.
Each run is isolated in a child process by default (:mod:`kvproof.conformance.isolation`):
an implementation that exits, crashes, hangs or exhausts memory gets a verdict there.

The suites are found through the component registry (``kvproof.reference.registry``):
each component's module ``kvproof.conformance.<component>`` exports ``SUITE``, a
:class:`Suite` built from its lockstep machine (whose rule declarations give every
rule's capability needs and misuse cases) and its default configs.
"""

from __future__ import annotations

import datetime as _dt
import functools
import hashlib
import importlib
import json
import re
import time
import unittest
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from hypothesis import settings as Settings  # noqa: N812 - the class, next to a `settings` argument
from hypothesis.stateful import run_state_machine_as_test
from pydantic import BaseModel

from kvproof.conformance.errors import ConformanceFailure, HarnessBug, LockstepFailure, UsageError
from kvproof.conformance.generation import stable_generation
from kvproof.conformance.isolation import DEFAULT_MEMORY_LIMIT_MB, ISOLATION_MODES, Crash, fork_problem, run_isolated
from kvproof.conformance.lockstep import (
    Binding,
    Lockstep,
    MisuseCase,
    OperationTimeout,
    RunStats,
    call_implementation,
    escape_message,
)
from kvproof.conformance.profiles import get_profile
from kvproof.conformance.vector import VECTOR_FORMAT, ReplayResult, replay
from kvproof.reference.contract import Capability
from kvproof.reference.registry import Component, Layer, info

__all__ = ["DEFAULT_OP_TIMEOUT", "FAILURES_DIR", "CheckReport", "MutantVerdict", "Suite", "check",
           "check_hisparse_host", "check_loc_cache", "check_swa_allocator", "get_suite", "kill_mutants",
           "make_test_case", "make_vector", "mutants_of", "replay_vector", "run_check", "run_swa_allocator_check"]

FAILURES_DIR = Path(".kvproof/failures")
#: Seconds an implementation call may take before the run calls it hung.
DEFAULT_OP_TIMEOUT = 60.0


@dataclass(frozen=True)
class Suite:
    """One component's lockstep suite: its machine, its default configs, its options."""

    machine: type[Lockstep[Any, Any]]
    configs: tuple[Any, ...]
    #: machine options that are pydantic models, by name (rebuilt from JSON when a vector is replayed)
    option_types: Mapping[str, type[BaseModel]] = field(default_factory=dict)
    #: each run option of the component (``kvproof.reference.registry.Option``): its value as machine options
    apply: Mapping[str, Callable[[str], dict[str, Any]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        declared = {o.name for o in info(self.component).options}
        if declared != set(self.apply):
            raise HarnessBug(f"{self.machine.__name__}: the registry declares options {sorted(declared)}, the "
                             f"suite applies {sorted(self.apply)}")

    @property
    def component(self) -> Component:
        """The component the suite checks: its machine's."""
        component = self.machine.component
        if component is None:  # refused by __post_init__
            raise HarnessBug(f"{self.machine.__name__} declares no component")
        return component

    @property
    def default_impl(self) -> str:
        return info(self.component).default_impl

    @property
    def config_type(self) -> type[BaseModel]:
        return type(self.configs[0])

    def needs(self, config: Any) -> dict[str, frozenset[Capability]]:
        """Each rule's capability needs on ``config``, from the rule declarations."""
        return self.machine.needs(config)

    @property
    def misuse_cases(self) -> dict[str, MisuseCase]:
        return self.machine.misuse_cases

    def option_values(self, chosen: Mapping[str, str]) -> dict[str, str]:
        """The component's run options as chosen (an option not given takes its default); bad values refused."""
        out = {}
        for option in info(self.component).options:
            value = chosen.get(option.name, option.default)
            if value not in option.choices:
                raise UsageError(f"--{option.name} {value!r}: choose one of {list(option.choices)}")
            out[option.name] = value
        return out

    def options(self, chosen: Mapping[str, str]) -> dict[str, Any]:
        """Machine options for the run options ``chosen``."""
        out: dict[str, Any] = {}
        for name, value in self.option_values(chosen).items():
            out.update(self.apply[name](value))
        return out


@functools.cache
def get_suite(component: Component | str) -> Suite:
    """The suite of ``component`` (its module's ``SUITE``); ``UnknownComponent`` for a name not in the registry."""
    entry = info(component)
    suite = getattr(importlib.import_module(entry.module(Layer.SUITE)), "SUITE", None)
    if not isinstance(suite, Suite) or suite.component is not entry.component:
        raise HarnessBug(f"{entry.module(Layer.SUITE)} must export SUITE, the Suite of {entry.name}")
    return suite


@dataclass(frozen=True)
class CheckReport:
    """Outcome of one lockstep run: verdict, coverage counters, and what was not applicable."""

    component: str
    impl_name: str
    config: Any
    capabilities: frozenset[Capability]
    not_applicable: tuple[str, ...]
    rules: dict[str, int]
    outcomes: dict[str, int]
    steps: int
    examples: int
    seconds: float
    failure: str | None = None
    failure_file: str | None = None
    never_run: tuple[str, ...] = field(default=())
    vector: dict[str, Any] | None = None  # the failing example, replayable (kvproof replay)
    impl_version: str = ""  # the implementation's declared ``version`` attribute, if any
    fingerprint: str = ""  # digest of every example's steps: same seed and command, same fingerprint
    calls: dict[str, int] = field(default_factory=dict)  # operations called on both sides

    @property
    def passed(self) -> bool:
        return self.failure is None


def _save_failure(text: str, component: str, impl_name: str, config: Any, directory: Path,
                  vector: dict[str, Any] | None = None) -> str | None:
    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%S%fZ")
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", impl_name)[:60]
    path = directory / f"{component}-{safe}-{config.label()}-{stamp}.txt"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if vector is not None:
            path.with_suffix(".json").write_text(json.dumps(vector, indent=1))
    except OSError:
        return None
    return str(path)


class _MachineFactory:
    """Builds one machine per example from the run's binding.

    Its ``__name__`` is the test's identity, ``kvproof:<component>/<config>``: Hypothesis
    digests it into the derandomized seed and the example-database key, so a test gets
    the same examples whichever entry point (CLI, pytest plugin, Python API) runs it.
    """

    def __init__(self, suite: Suite, binding: Binding[Any]) -> None:
        self.suite, self.binding = suite, binding
        self.__name__ = f"kvproof:{suite.component.value}/{binding.config.label()}"

    def __call__(self) -> Lockstep[Any, Any]:
        return self.suite.machine(self.binding)


def _isolation(isolation: str) -> str:
    if isolation not in ISOLATION_MODES:
        raise UsageError(f"isolation={isolation!r}: choose one of {list(ISOLATION_MODES)}")
    return isolation


def _cannot_fork() -> bool:
    problem = fork_problem()
    if problem:
        warnings.warn(f"implementation runs in kvproof's process (not isolated): {problem}", stacklevel=3)
    return bool(problem)


def run_check(component: Component | str, factory: Callable[[Any], Any], config: Any, *,
              settings: Settings | None = None, profile: str = "ci", impl_name: str = "impl", replay: str = "",
              failures_dir: Path | None = FAILURES_DIR, op_timeout: float | None = DEFAULT_OP_TIMEOUT,
              isolation: str = "process", memory_limit_mb: int = DEFAULT_MEMORY_LIMIT_MB,
              **machine_options: Any) -> CheckReport:
    """Drive ``factory(config)`` against the reference with ``component``'s suite; return the report.

    ``machine_options`` go to the suite's machine (e.g. ``decode_config`` for ``decode_prealloc``).
    ``op_timeout`` bounds every call into the implementation (a hung call is a verdict; ``None``
    calls directly). A failure carries a replayable vector (:mod:`kvproof.conformance.vector`) of
    the shrunk failing example; with ``failures_dir`` both are saved there.

    ``isolation="process"`` (the default) runs the whole run in a child process
    (:mod:`kvproof.conformance.isolation`): an implementation that exits, crashes, hangs past
    any alarm or grows the process by more than ``memory_limit_mb`` MiB (0: no limit) gets a
    verdict naming the call and the step, never ends the caller. ``"in-process"`` is faster and
    unprotected against those.
    """
    if _isolation(isolation) == "process" and not _cannot_fork():
        start = time.perf_counter()
        outcome = run_isolated(
            lambda: run_check(component, factory, config, settings=settings, profile=profile, impl_name=impl_name,
                              replay=replay, failures_dir=failures_dir, op_timeout=op_timeout,
                              isolation="in-process", **machine_options),
            op_timeout=op_timeout, memory_limit_mb=memory_limit_mb)
        if not isinstance(outcome, Crash):
            return outcome
        return _crash_report(component, config, impl_name, replay, failures_dir, machine_options, outcome,
                             time.perf_counter() - start)
    suite = get_suite(component)
    name = suite.component.value
    # one failure per run, the shrunk one: its vector is the one the report carries
    settings = Settings(settings or get_profile(profile), report_multiple_bugs=False)
    start = time.perf_counter()
    try:  # under the per-call deadline, like every implementation call
        probe = call_implementation("the factory", lambda: factory(config), op_timeout)
        caps = frozenset(probe.capabilities)
        declared_version = str(getattr(probe, "version", "") or "")
    except (Exception, OperationTimeout, SystemExit, GeneratorExit) as err:  # noqa: BLE001 - a verdict, not a crash
        if isinstance(err, OperationTimeout):
            why = f"it did not return within {op_timeout:g} s (hung)"
        else:
            why = escape_message("the factory", err) or f"{type(err).__name__}: {err}"
        failure: str | None = f"the factory could not build an implementation for {config.label()}: {why}"
        return CheckReport(name, impl_name, config, frozenset(), (), {}, {}, 0, 0, time.perf_counter() - start,
                           failure)
    stats = RunStats(digest=hashlib.sha256())
    binding = Binding(factory, config, machine_options, impl_name, f"replay: {replay}" if replay else "", op_timeout,
                      stats)
    failure, saved, vector = None, None, None
    try:
        with stable_generation():
            # any zero-argument callable returning a machine is a factory (Hypothesis' docs); its stub says a class
            run_state_machine_as_test(cast(Any, _MachineFactory(suite, binding)), settings=settings)
    except HarnessBug:
        raise
    except Exception as err:  # noqa: BLE001 - the verdict is data here
        notes = "\n".join(getattr(err, "__notes__", []))
        failure = f"{type(err).__name__}: {err}\n{notes}".rstrip()
        steps = stats.last_vector
        if stats.hung:  # Hypothesis' own verdict after a hang is noise (flaky re-runs): report the hang
            failure, steps = f"LockstepFailure: {stats.hung}", stats.hung_vector
        vector = make_vector(name, config, impl_name, machine_options, steps, failure)
        if failures_dir is not None:
            saved = _save_failure(failure, name, impl_name, config, failures_dir, vector)
    na = suite.machine.not_applicable(caps, config)
    ran = {rule for rule, count in (stats.rules + stats.calls).items() if count}
    never = tuple(r for r in suite.needs(config) if r not in na and r != "misuse" and r not in ran)
    return CheckReport(name, impl_name, config, caps, na, dict(stats.rules), dict(stats.outcomes), stats.steps,
                       stats.examples, time.perf_counter() - start, failure, saved, never, vector, declared_version,
                       stats.digest.hexdigest(), dict(stats.calls))


def _crash_text(impl_name: str, label: str, crash: Crash, hint: str) -> str:
    """A crash as a lockstep verdict: the call and the step, the operations so far, what the process printed last."""
    lines = "\n".join(f"  | {line}" for line in crash.output.splitlines())
    output = f"\n\nthe implementation process's last output:\n{lines}" if crash.output else ""
    return (f"LockstepFailure: {impl_name} diverged from the reference [{label}] at step {crash.step}:\n"
            f"  {crash.message}\n\noperations so far:\n{crash.trace.render()}{output}"
            + (f"\n\n{hint}" if hint else ""))


def _crash_report(component: Component | str, config: Any, impl_name: str, replay: str, failures_dir: Path | None,
                  machine_options: Mapping[str, Any], crash: Crash, seconds: float) -> CheckReport:
    """The report of a run whose process ended without one: the call, the step, the operations so far, a vector."""
    name = get_suite(component).component.value
    failure = _crash_text(impl_name, config.label(), crash, f"replay: {replay}" if replay else "")
    vector = make_vector(name, config, impl_name, machine_options, crash.vector, failure)
    saved = _save_failure(failure, name, impl_name, config, failures_dir, vector) if failures_dir is not None else None
    return CheckReport(name, impl_name, config, frozenset(), (), {}, {}, crash.step, crash.examples, seconds, failure,
                       saved, (), vector)


def make_vector(component: str, config: Any, impl_name: str, machine_options: Mapping[str, Any],
                steps: list[dict[str, Any]], failure: str | None = None) -> dict[str, Any]:
    """A replayable vector: the suite, the config, the machine options and the steps (JSON-able)."""
    options = {k: v.model_dump(mode="json") if isinstance(v, BaseModel) else v for k, v in machine_options.items()}
    first = (failure or "").strip().splitlines()
    return {"format": VECTOR_FORMAT, "component": component,
            "config": {"label": config.label(), "value": config.model_dump(mode="json")},
            "machine_options": options, "impl": impl_name, "steps": list(steps),
            "verdict": first[1].strip() if len(first) > 1 else (first[0] if first else "")}


def replay_vector(vector: dict[str, Any], factory: Callable[[Any], Any], *, impl_name: str = "impl",
                  op_timeout: float | None = DEFAULT_OP_TIMEOUT, isolation: str = "process",
                  memory_limit_mb: int = DEFAULT_MEMORY_LIMIT_MB) -> ReplayResult:
    """Replay a vector (from :func:`make_vector` or a report) on ``factory``'s implementation, without Hypothesis.

    ``isolation`` and ``memory_limit_mb`` as for :func:`run_check`.
    """
    suite = get_suite(str(vector["component"]))
    config: Any = suite.config_type.model_validate_json(json.dumps(vector["config"]["value"]))
    if _isolation(isolation) == "process" and not _cannot_fork():
        outcome = run_isolated(lambda: replay_vector(vector, factory, impl_name=impl_name, op_timeout=op_timeout,
                                                     isolation="in-process"),
                               op_timeout=op_timeout, memory_limit_mb=memory_limit_mb)
        if not isinstance(outcome, Crash):
            return outcome
        failure = _crash_text(impl_name, config.label(), outcome, "")
        return ReplayResult(suite.component.value, config.label(), max(len(outcome.vector) - 1, 0), failure)
    options = {k: suite.option_types[k].model_validate_json(json.dumps(v)) if k in suite.option_types else v
               for k, v in vector.get("machine_options", {}).items()}
    binding = Binding(factory, config, options, impl_name, f"replay: kvproof replay VECTOR --impl {impl_name}",
                      op_timeout, RunStats())
    try:
        machine = suite.machine(binding)
    except LockstepFailure as err:
        return ReplayResult(suite.component.value, config.label(), 0, f"LockstepFailure: {err}")
    return replay(vector, machine)


def run_swa_allocator_check(factory: Callable[[Any], Any], config: Any, **kwargs: Any) -> CheckReport:
    """:func:`run_check` of component ``swa_allocator``."""
    return run_check(Component.SWA_ALLOCATOR, factory, config, **kwargs)


def check(component: Component | str, factory: Callable[[Any], Any], config: Any, *,
          settings: Settings | None = None, profile: str = "ci", impl_name: str = "impl", isolation: str = "process",
          memory_limit_mb: int = DEFAULT_MEMORY_LIMIT_MB, **machine_options: Any) -> CheckReport:
    """Like :func:`run_check` but raise :class:`ConformanceFailure` on a failure (pytest-free, trio style)."""
    report = run_check(component, factory, config, settings=settings, profile=profile, impl_name=impl_name,
                       isolation=isolation, memory_limit_mb=memory_limit_mb, **machine_options)
    if not report.passed:
        where = f"\n(saved to {report.failure_file})" if report.failure_file else ""
        raise ConformanceFailure(f"{impl_name} [{report.component} {config.label()}]: {report.failure}{where}")
    return report


def check_swa_allocator(factory: Callable[[Any], Any], config: Any, **kwargs: Any) -> CheckReport:
    """:func:`check` of component ``swa_allocator``."""
    return check(Component.SWA_ALLOCATOR, factory, config, **kwargs)


def check_loc_cache(factory: Callable[[Any], Any], config: Any, **kwargs: Any) -> CheckReport:
    """:func:`check` of component ``loc_cache``."""
    return check(Component.LOC_CACHE, factory, config, **kwargs)


def check_hisparse_host(factory: Callable[[Any], Any], config: Any, **kwargs: Any) -> CheckReport:
    """:func:`check` of component ``hisparse_host``."""
    return check(Component.HISPARSE_HOST, factory, config, **kwargs)


def make_test_case(component: Component | str, factory: Callable[[Any], Any], config: Any, *,
                   profile: str = "ci", impl_name: str = "impl", **machine_options: Any) -> type[unittest.TestCase]:
    """A ``unittest.TestCase`` class with one test, the suite on ``config`` (collected by pytest and unittest)."""
    def test_conforms(self: unittest.TestCase) -> None:
        check(component, factory, config, profile=profile, impl_name=impl_name, **machine_options)

    label = re.sub(r"\W", "_", f"{info(component).name}_{config.label()}")
    return type(f"Conformance_{label}", (unittest.TestCase,), {"test_conforms": test_conforms})


@dataclass(frozen=True)
class MutantVerdict:
    """Whether the lockstep suite caught one deliberately broken implementation, and where."""

    component: str
    name: str
    killed: bool
    config: str | None
    seconds: float
    evidence: str


def mutants_of(component: Component | str) -> dict[str, Callable[[Any], Any]]:
    """The component's mutants (``kvproof.conformance.mutants.<component>.MUTANTS``; none if the layer is absent)."""
    entry = info(component)
    if not entry.has(Layer.MUTANTS):
        return {}
    module = importlib.import_module(entry.module(Layer.MUTANTS))
    mutants = getattr(module, "MUTANTS", None)
    if not isinstance(mutants, dict):
        raise HarnessBug(f"{entry.module(Layer.MUTANTS)} must export MUTANTS, a dict of name -> factory")
    return mutants


def kill_mutants(mutants: Mapping[str, Callable[[Any], Any]], configs: tuple[Any, ...] | None = None, *,
                 profile: str = "ci", shrink: bool = False, component: Component | str = Component.SWA_ALLOCATOR,
                 isolation: str = "process", memory_limit_mb: int = DEFAULT_MEMORY_LIMIT_MB,
                 **machine_options: Any) -> list[MutantVerdict]:
    """Run the suite against each mutant, config by config, until one config catches it.

    Without ``shrink`` the profile's shrinking phase is skipped: a kill only needs the
    first failing example (the S3 test shrinks on purpose, to check the trace length).
    """
    suite = get_suite(component)
    configs = suite.configs if configs is None else configs
    base = get_profile(profile)
    settings = base if shrink else Settings(base, phases=[p for p in base.phases if p.name != "shrink"])
    verdicts = []
    for name, factory in mutants.items():
        start, hit = time.perf_counter(), None
        for config in configs:
            report = run_check(component, factory, config, settings=settings, impl_name=f"mutant {name}",
                               failures_dir=None, isolation=isolation, memory_limit_mb=memory_limit_mb,
                               **machine_options)
            if not report.passed:
                hit = report
                break
        verdicts.append(MutantVerdict(suite.component.value, name, hit is not None,
                                      hit.config.label() if hit else None, time.perf_counter() - start,
                                      _evidence(hit.failure if hit else None)))
    return verdicts


def _evidence(failure: str | None) -> str:
    """The line that says what diverged (the one after the lockstep header), or the first line."""
    if failure is None:
        return "survived every config"
    lines = [line.strip() for line in failure.splitlines() if line.strip()]
    return lines[1] if len(lines) > 1 and lines[0].startswith("LockstepFailure") else lines[0]
