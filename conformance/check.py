"""``check_swa_allocator``: run the lockstep suite against any factory, with or without pytest.

In the style of trio's ``check_*`` functions: the caller passes a factory
``Callable[[PoolConfig], SWAAllocatorUnderTest]``; :func:`run_swa_allocator_check`
returns a :class:`CheckReport` (never raises for a misbehaving implementation) and
:func:`check_swa_allocator` raises :class:`ConformanceFailure` when the report is
not a pass. Every failure is also written to ``.kvproof/failures/`` with the
operation trace, Hypothesis' falsifying program and its reproduction blob, so
nothing a run finds is lost.
"""

from __future__ import annotations

import datetime as _dt
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import settings as Settings
from hypothesis.stateful import run_state_machine_as_test

from kvproof.conformance import decode_prealloc, loc_cache, swa_allocator
from kvproof.conformance.profiles import get_profile
from kvproof.conformance.protocol import AllocatorFactory, Capability
from kvproof.conformance.swa_allocator import MISUSE_CASES
from kvproof.reference.config import PoolConfig

__all__ = ["CheckReport", "ConformanceFailure", "MutantVerdict", "Suite", "SUITES", "get_suite", "run_check", "check",
           "run_swa_allocator_check", "check_swa_allocator", "check_loc_cache", "kill_mutants", "FAILURES_DIR"]

FAILURES_DIR = Path(".kvproof/failures")


class ConformanceFailure(AssertionError):
    """The implementation does not conform; the message is the full verdict."""


@dataclass(frozen=True)
class Suite:
    """One component's lockstep suite: how to build its machine, and what each rule needs."""

    component: str
    machine_for: Callable[..., type]
    rule_capabilities: dict[str, frozenset[Capability]]


#: The lockstep suites, by component name.
SUITES: dict[str, Suite] = {
    "swa_allocator": Suite("swa_allocator", swa_allocator.machine_for, swa_allocator.RULE_CAPABILITIES),
    "loc_cache": Suite("loc_cache", loc_cache.machine_for, loc_cache.RULE_CAPABILITIES),
    "decode_prealloc": Suite("decode_prealloc", decode_prealloc.machine_for, decode_prealloc.RULE_CAPABILITIES),
}


def get_suite(component: str) -> Suite:
    """The suite of ``component``; ``ValueError`` naming the choices otherwise."""
    try:
        return SUITES[component]
    except KeyError:
        raise ValueError(f"unknown component {component!r}; choose one of {sorted(SUITES)}") from None


@dataclass(frozen=True)
class CheckReport:
    """Outcome of one lockstep run: verdict, coverage counters, and what was not applicable."""

    component: str
    impl_name: str
    config: PoolConfig
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

    @property
    def passed(self) -> bool:
        return self.failure is None


def _not_applicable(suite: Suite, caps: frozenset[Capability]) -> tuple[str, ...]:
    rules = [name for name, needs in suite.rule_capabilities.items() if not needs <= caps]
    if Capability.REJECTS_MISUSE in caps:
        rules += [f"misuse:{case}" for case in MISUSE_CASES if _case_needs(case) - caps]
    return tuple(rules)


def _case_needs(case: str) -> frozenset[Capability]:
    op = case.split(":", 1)[0]
    return swa_allocator.RULE_CAPABILITIES.get(op, frozenset())


def _save_failure(text: str, component: str, impl_name: str, config: PoolConfig, directory: Path) -> str | None:
    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%S%fZ")
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", impl_name)[:60]
    path = directory / f"{component}-{safe}-{config.label()}-{stamp}.txt"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError:
        return None
    return str(path)


def run_check(component: str, factory: AllocatorFactory, config: PoolConfig, *, settings: Settings | None = None,
              profile: str = "ci", impl_name: str = "impl", replay: str = "",
              failures_dir: Path | None = FAILURES_DIR, **machine_options: Any) -> CheckReport:
    """Drive ``factory(config)`` against the reference with ``component``'s suite; return the report.

    ``machine_options`` go to the suite's machine (e.g. ``decode_config`` for ``decode_prealloc``).
    """
    suite = get_suite(component)
    settings = settings or get_profile(profile)
    hint = f"replay: {replay}" if replay else ""
    machine = suite.machine_for(factory, config, impl_name=impl_name, replay_hint=hint, **machine_options)
    caps = frozenset(factory(config).capabilities)
    start, failure, saved = time.perf_counter(), None, None
    try:
        run_state_machine_as_test(machine, settings=settings)
    except Exception as err:  # noqa: BLE001 - the verdict is data here
        notes = "\n".join(getattr(err, "__notes__", []))
        failure = f"{type(err).__name__}: {err}\n{notes}".rstrip()
        if failures_dir is not None:
            saved = _save_failure(failure, component, impl_name, config, failures_dir)
    stats = machine.stats
    na = _not_applicable(suite, caps)
    ran = {name for name, count in stats.rules.items() if count}
    never = tuple(r for r in suite.rule_capabilities if r not in na and r != "misuse" and r not in ran)
    return CheckReport(component, impl_name, config, caps, na, dict(stats.rules), dict(stats.outcomes),
                       stats.steps, stats.examples, time.perf_counter() - start, failure, saved, never)


def run_swa_allocator_check(factory: AllocatorFactory, config: PoolConfig, **kwargs: Any) -> CheckReport:
    """:func:`run_check` of component ``swa_allocator``."""
    return run_check("swa_allocator", factory, config, **kwargs)


def check(component: str, factory: AllocatorFactory, config: PoolConfig, *, settings: Settings | None = None,
          profile: str = "ci", impl_name: str = "impl") -> CheckReport:
    """Like :func:`run_check` but raise :class:`ConformanceFailure` on a failure (pytest-free, trio style)."""
    report = run_check(component, factory, config, settings=settings, profile=profile, impl_name=impl_name)
    if not report.passed:
        where = f"\n(saved to {report.failure_file})" if report.failure_file else ""
        raise ConformanceFailure(f"{impl_name} [{component} {config.label()}]: {report.failure}{where}")
    return report


def check_swa_allocator(factory: AllocatorFactory, config: PoolConfig, **kwargs: Any) -> CheckReport:
    """:func:`check` of component ``swa_allocator``."""
    return check("swa_allocator", factory, config, **kwargs)


def check_loc_cache(factory: AllocatorFactory, config: PoolConfig, **kwargs: Any) -> CheckReport:
    """:func:`check` of component ``loc_cache``."""
    return check("loc_cache", factory, config, **kwargs)


@dataclass(frozen=True)
class MutantVerdict:
    """Whether the lockstep suite caught one deliberately broken implementation, and where."""

    component: str
    name: str
    killed: bool
    config: str | None
    seconds: float
    evidence: str


def kill_mutants(mutants: dict[str, AllocatorFactory], configs: tuple[PoolConfig, ...], *,
                 profile: str = "ci", shrink: bool = False, component: str = "swa_allocator") -> list[MutantVerdict]:
    """Run the suite against each mutant, config by config, until one config catches it.

    Without ``shrink`` the profile's shrinking phase is skipped: a kill only needs the
    first failing example (the S3 test shrinks on purpose, to check the trace length).
    """
    base = get_profile(profile)
    settings = base if shrink else Settings(base, phases=[p for p in base.phases if p.name != "shrink"])
    verdicts = []
    for name, factory in mutants.items():
        start, hit = time.perf_counter(), None
        for config in configs:
            report = run_check(component, factory, config, settings=settings, impl_name=f"mutant {name}",
                               failures_dir=None)
            if not report.passed:
                hit = report
                break
        verdicts.append(MutantVerdict(component, name, hit is not None, hit.config.label() if hit else None,
                                      time.perf_counter() - start, _evidence(hit.failure if hit else None)))
    return verdicts


def _evidence(failure: str | None) -> str:
    """The line that says what diverged (the one after the lockstep header), or the first line."""
    if failure is None:
        return "survived every config"
    lines = [line.strip() for line in failure.splitlines() if line.strip()]
    return lines[1] if len(lines) > 1 and lines[0].startswith("LockstepFailure") else lines[0]
