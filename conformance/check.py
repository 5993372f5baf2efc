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
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import settings as Settings
from hypothesis.stateful import run_state_machine_as_test
from pydantic import BaseModel

from kvproof.conformance import decode_prealloc, hisparse_host, loc_cache, swa_allocator
from kvproof.conformance.configs import CONFORMANCE_CONFIGS
from kvproof.conformance.profiles import get_profile
from kvproof.reference.contract import AllocatorFactory, Capability
from kvproof.conformance.swa_allocator import MISUSE_CASES
from kvproof.conformance.vector import VECTOR_FORMAT, ReplayResult, replay
from kvproof.reference.config import PoolConfig
from kvproof.reference.decode_prealloc import DecodeConfig
from kvproof.reference.hisparse_host import HostPoolConfig

AnyConfig = PoolConfig | HostPoolConfig

__all__ = ["CheckReport", "ConformanceFailure", "MutantVerdict", "Suite", "SUITES", "get_suite", "run_check", "check",
           "run_swa_allocator_check", "check_swa_allocator", "check_loc_cache", "check_hisparse_host", "kill_mutants",
           "FAILURES_DIR", "make_vector", "replay_vector", "declared_components", "impl_for"]

FAILURES_DIR = Path(".kvproof/failures")
#: Seconds an implementation call may take before the run calls it hung.
DEFAULT_OP_TIMEOUT = 60.0


class ConformanceFailure(AssertionError):
    """The implementation does not conform; the message is the full verdict."""


@dataclass(frozen=True)
class Suite:
    """One component's lockstep suite: how to build its machine, and what each rule needs."""

    component: str
    machine_for: Callable[..., type]
    rule_capabilities: dict[str, frozenset[Capability]]
    configs: tuple[Any, ...] = CONFORMANCE_CONFIGS  # what the suite runs on by default (each has label())
    default_impl: str = "kvproof.gpu_runtime.swa_allocator:SWATokenToKVPoolAllocator"
    misuse_cases: tuple[str, ...] = tuple(MISUSE_CASES)
    option_types: dict[str, type[BaseModel]] = field(default_factory=dict)  # machine options, for replay
    needs_for: Callable[[Any], dict[str, frozenset[Capability]]] | None = None  # per-config rule needs

    def rules_for(self, config: Any) -> dict[str, frozenset[Capability]]:
        """Each rule's capability needs on ``config``."""
        return self.needs_for(config) if self.needs_for else self.rule_capabilities


#: The lockstep suites, by component name.
SUITES: dict[str, Suite] = {
    "swa_allocator": Suite("swa_allocator", swa_allocator.machine_for, swa_allocator.RULE_CAPABILITIES),
    "loc_cache": Suite("loc_cache", loc_cache.machine_for, loc_cache.RULE_CAPABILITIES),
    "decode_prealloc": Suite("decode_prealloc", decode_prealloc.machine_for, decode_prealloc.RULE_CAPABILITIES,
                             option_types={"decode_config": DecodeConfig},
                             needs_for=decode_prealloc.rule_capabilities),
    "hisparse_host": Suite("hisparse_host", hisparse_host.machine_for, hisparse_host.RULE_CAPABILITIES,
                           hisparse_host.HOST_CONFIGS, "kvproof.gpu_runtime.hisparse_host:HiSparseHostPool",
                           tuple(hisparse_host.MISUSE_CASES)),
}


def get_suite(component: str) -> Suite:
    """The suite of ``component``; ``ValueError`` naming the choices otherwise."""
    try:
        return SUITES[component]
    except KeyError:
        raise ValueError(f"unknown component {component!r}; choose one of {sorted(SUITES)}") from None


def declared_components(factory: Callable) -> tuple[str, ...] | None:
    """The suites a factory declares it serves (``components``), or ``None`` if it declares none."""
    declared = getattr(factory, "components", None)
    return tuple(declared) if declared is not None else None


def impl_for(component: str, given: list[tuple[str, Callable]]) -> tuple[str, Callable | None]:
    """The given implementation for ``component``: one declaring it, else one declaring nothing."""
    if not given:
        return "", None
    for spec, factory in given:
        if component in (declared_components(factory) or ()):
            return spec, factory
    for spec, factory in given:
        if declared_components(factory) is None:
            return spec, factory
    raise ValueError(f"no --impl serves component {component!r}; they declare "
                     f"{ {spec: declared_components(f) for spec, f in given} }")


@dataclass(frozen=True)
class CheckReport:
    """Outcome of one lockstep run: verdict, coverage counters, and what was not applicable."""

    component: str
    impl_name: str
    config: AnyConfig
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

    @property
    def passed(self) -> bool:
        return self.failure is None


def _not_applicable(suite: Suite, caps: frozenset[Capability], config: Any) -> tuple[str, ...]:
    needs = suite.rules_for(config)
    rules = [name for name, need in needs.items() if not need <= caps]
    if Capability.REJECTS_MISUSE in caps:
        rules += [f"misuse:{case}" for case in suite.misuse_cases
                  if needs.get(case.split(":", 1)[0], frozenset()) - caps]
    return tuple(rules)


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


def run_check(component: str, factory: Callable[[Any], Any], config: AnyConfig, *, settings: Settings | None = None,
              profile: str = "ci", impl_name: str = "impl", replay: str = "",
              failures_dir: Path | None = FAILURES_DIR, op_timeout: float | None = DEFAULT_OP_TIMEOUT,
              **machine_options: Any) -> CheckReport:
    """Drive ``factory(config)`` against the reference with ``component``'s suite; return the report.

    ``machine_options`` go to the suite's machine (e.g. ``decode_config`` for ``decode_prealloc``).
    ``op_timeout`` bounds every call into the implementation (a hung call is a verdict;
    ``None`` calls directly, without the watchdog thread). A failure carries a replayable vector (:mod:`kvproof.conformance.vector`) of the
    shrunk failing example; with ``failures_dir`` both are saved there.
    """
    suite = get_suite(component)
    # one failure per run, the shrunk one: its vector is the one the report carries
    settings = Settings(settings or get_profile(profile), report_multiple_bugs=False)
    hint = f"replay: {replay}" if replay else ""
    start = time.perf_counter()
    try:
        probe = factory(config)
        caps = frozenset(probe.capabilities)
        declared_version = str(getattr(probe, "version", "") or "")
    except Exception as err:  # noqa: BLE001 - a factory that cannot build is a verdict, not a crash
        failure = f"the factory could not build an implementation for {config.label()}: {type(err).__name__}: {err}"
        return CheckReport(component, impl_name, config, frozenset(), (), {}, {}, 0, 0,
                           time.perf_counter() - start, failure)
    machine = suite.machine_for(factory, config, impl_name=impl_name, replay_hint=hint, **machine_options)
    machine.op_timeout = op_timeout
    failure, saved, vector = None, None, None
    try:
        run_state_machine_as_test(machine, settings=settings)
    except Exception as err:  # noqa: BLE001 - the verdict is data here
        notes = "\n".join(getattr(err, "__notes__", []))
        failure = f"{type(err).__name__}: {err}\n{notes}".rstrip()
        steps = machine.stats.last_vector
        if machine.stats.hung:  # Hypothesis' own verdict after a hang is noise (flaky re-runs): report the hang
            failure, steps = f"LockstepFailure: {machine.stats.hung}", machine.stats.hung_vector
        vector = make_vector(component, config, impl_name, machine_options, steps, failure)
        if failures_dir is not None:
            saved = _save_failure(failure, component, impl_name, config, failures_dir, vector)
    stats = machine.stats
    na = _not_applicable(suite, caps, config)
    ran = {name for name, count in stats.rules.items() if count}
    never = tuple(r for r in suite.rules_for(config) if r not in na and r != "misuse" and r not in ran)
    return CheckReport(component, impl_name, config, caps, na, dict(stats.rules), dict(stats.outcomes),
                       stats.steps, stats.examples, time.perf_counter() - start, failure, saved, never, vector,
                       declared_version)


def make_vector(component: str, config: AnyConfig, impl_name: str, machine_options: dict[str, Any],
                steps: list[dict[str, Any]], failure: str | None = None) -> dict[str, Any]:
    """A replayable vector: the suite, the config, the machine options and the steps (JSON-able)."""
    options = {k: v.model_dump(mode="json") if hasattr(v, "model_dump") else v for k, v in machine_options.items()}
    first = (failure or "").strip().splitlines()
    return {"format": VECTOR_FORMAT, "component": component,
            "config": {"label": config.label(), "value": config.model_dump(mode="json")},
            "machine_options": options, "impl": impl_name, "steps": list(steps),
            "verdict": first[1].strip() if len(first) > 1 else (first[0] if first else "")}


def replay_vector(vector: dict[str, Any], factory: Callable[[Any], Any], *, impl_name: str = "impl") -> ReplayResult:
    """Replay a vector (from :func:`make_vector` or a report) on ``factory``'s implementation, without Hypothesis."""
    suite = get_suite(str(vector["component"]))
    config_type = type(suite.configs[0])
    config = config_type.model_validate_json(json.dumps(vector["config"]["value"]))
    options = {k: suite.option_types[k].model_validate_json(json.dumps(v)) if k in suite.option_types else v
               for k, v in vector.get("machine_options", {}).items()}
    machine = suite.machine_for(factory, config, impl_name=impl_name,
                                replay_hint=f"replay: kvproof replay VECTOR --impl {impl_name}", **options)
    return replay(vector, machine)


def run_swa_allocator_check(factory: AllocatorFactory, config: PoolConfig, **kwargs: Any) -> CheckReport:
    """:func:`run_check` of component ``swa_allocator``."""
    return run_check("swa_allocator", factory, config, **kwargs)


def check(component: str, factory: Callable[[Any], Any], config: AnyConfig, *, settings: Settings | None = None,
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


def check_hisparse_host(factory: Callable[[HostPoolConfig], Any], config: HostPoolConfig,
                        **kwargs: Any) -> CheckReport:
    """:func:`check` of component ``hisparse_host``."""
    return check("hisparse_host", factory, config, **kwargs)


@dataclass(frozen=True)
class MutantVerdict:
    """Whether the lockstep suite caught one deliberately broken implementation, and where."""

    component: str
    name: str
    killed: bool
    config: str | None
    seconds: float
    evidence: str


def kill_mutants(mutants: dict[str, Callable[[Any], Any]], configs: tuple[AnyConfig, ...] | None = None, *,
                 profile: str = "ci", shrink: bool = False, component: str = "swa_allocator") -> list[MutantVerdict]:
    """Run the suite against each mutant, config by config, until one config catches it.

    Without ``shrink`` the profile's shrinking phase is skipped: a kill only needs the
    first failing example (the S3 test shrinks on purpose, to check the trace length).
    """
    configs = get_suite(component).configs if configs is None else configs
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
