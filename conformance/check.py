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

import collections
import contextlib
import functools
import gc
import hashlib
import importlib
import json
import re
import time
import unittest
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hypothesis
from hypothesis import Phase
from hypothesis import settings as Settings  # noqa: N812 - the class, next to a `settings` argument
from hypothesis.database import ExampleDatabase
from hypothesis.errors import Flaky
from hypothesis.stateful import run_state_machine_as_test
from pydantic import BaseModel

from kvproof.conformance.breadth import drive
from kvproof.conformance.database import load_vectors, save_vector
from kvproof.conformance.errors import (
    ConformanceFailure,
    HarnessBug,
    LockstepFailure,
    RunInterrupted,
    UsageError,
    VectorError,
)
from kvproof.conformance.findings import Evidence, declared_findings, followed_by, label, resolve_accepted
from kvproof.conformance.generation import stable_generation
from kvproof.conformance.isolation import (
    DEFAULT_MEMORY_LIMIT_MB,
    ISOLATION_MODES,
    Crash,
    fork_problem,
    notify,
    run_isolated,
)
from kvproof.conformance.lockstep import (
    Binding,
    Lockstep,
    MisuseCase,
    OperationTimeout,
    RunProgress,
    RunStats,
    call_implementation,
    deadline_scope,
    escape_message,
)
from kvproof.conformance.modes import DEFAULT_ENGINE, DEFAULT_SHRINKER, ENGINES, SHRINKERS
from kvproof.conformance.profiles import get_profile
from kvproof.conformance.report import diagnosis
from kvproof.conformance.saved import FIRST_SEEN, FailureFile, first_failing
from kvproof.conformance.shrink import shrink
from kvproof.conformance.vector import VECTOR_FORMAT, ReplayResult, replay
from kvproof.reference.contract import Capability
from kvproof.reference.registry import Component, Layer, info

__all__ = ["DEFAULT_OP_TIMEOUT", "FAILURES_DIR", "CheckReport", "MutantVerdict", "Suite", "check",
           "check_hisparse_host", "check_loc_cache", "check_swa_allocator", "factory_spec", "failure_text", "get_suite",
           "kill_mutants", "make_test_case", "make_vector", "mutants_of", "replay_machine", "replay_vector",
           "run_check", "run_swa_allocator_check", "structure_unreached"]

FAILURES_DIR = Path(".kvproof/failures")
#: Seconds an implementation call may take before the run calls it hung.
DEFAULT_OP_TIMEOUT = 60.0
#: Seconds between two progress reports of a run (a report is a note from an isolated child).
PROGRESS_S = 0.25


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
    #: the most each structural dimension reached, and the most the suite's strategies can reach on the config
    structure: dict[str, int] = field(default_factory=dict)
    structure_targets: dict[str, int] = field(default_factory=dict)
    #: when the run first saw its failure, before any shrinking: seconds from its start and lockstep steps done
    detected_seconds: float | None = None
    detected_steps: int | None = None
    #: what the failure's verdict saw (kvproof.conformance.findings.Evidence, as JSON) and the declared finding it
    #: is (its id, ``new``, or ``-`` without evidence: a crash of the implementation's process)
    evidence: dict[str, Any] | None = None
    finding: str = ""
    #: the known findings the run looked past (``accept``), each with how often it occurred
    accepted: dict[str, int] = field(default_factory=dict)
    #: the harm continuation of the failure (``--harm``: kvproof.conformance.harm.HarmReport, as JSON)
    harm: dict[str, Any] | None = None
    #: where the run's time went (``RunStats.seconds``): the implementation's calls, the reference's operations and
    #: the per-step checks, in seconds; the rest of ``seconds`` is the driver's and the harness' bookkeeping
    split: dict[str, float] = field(default_factory=dict)

    def structure_missed(self) -> dict[str, tuple[int, int]]:
        """Dimensions the run did not take to their maximum: ``{name: (reached, maximum)}``."""
        return {k: (self.structure.get(k, 0), v) for k, v in self.structure_targets.items()
                if self.structure.get(k, 0) < v}

    @property
    def passed(self) -> bool:
        return self.failure is None

    @property
    def checked_nothing(self) -> bool:
        """A pass that never called the implementation: the capabilities it declares leave the suite no rule that
        reaches it on this config (SGLang's allocator at page size 1 has no ``alloc_extend``, so ``decode_prealloc``
        admits nothing there). Not a pass: reported as skipped, with :meth:`nothing_checked` as the reason."""
        return self.passed and not any(self.calls.values())

    def nothing_checked(self) -> str:
        na = ", ".join(self.not_applicable) or "none"
        return (f"nothing checked: {self.steps} steps and not one call of the implementation; the capabilities it "
                f"declares leave this suite no rule that calls it on {self.config.label()} (not applicable: {na})")


def structure_unreached(reports: Iterable[CheckReport]) -> dict[str, tuple[int, int]]:
    """Over the runs of one component on its configs (a ``ci`` run of the default configs): the dimensions no run
    took to its maximum on its config, each with the most any run reached and the largest maximum declared. A
    dimension's maximum may differ per config (pages of one request), or be 0 where a config cannot reach it (a
    misuse of a page of P > 1): reaching it on one config is reaching it."""
    best: dict[str, tuple[int, int]] = {}
    done: set[str] = set()
    for report in reports:
        for dim, most in report.structure_targets.items():
            got = report.structure.get(dim, 0)
            if got >= most:
                done.add(dim)
            old = best.get(dim, (0, 0))
            best[dim] = (max(old[0], got), max(old[1], most))
    return {dim: v for dim, v in sorted(best.items()) if dim not in done}


class _MachineFactory:
    """Builds one machine per example from the run's binding.

    Its ``__name__`` is the test's identity, ``kvproof:<component>/<config>``: Hypothesis
    digests it into the derandomized seed and the example-database key, so a test gets
    the same examples whichever entry point (CLI, pytest plugin, Python API) runs it.
    """

    def __init__(self, suite: Suite, binding: Binding[Any], name: str | None = None) -> None:
        self.suite, self.binding = suite, binding
        self.__name__ = name or f"kvproof:{suite.component.value}/{binding.config.label()}"

    def __call__(self) -> Lockstep[Any, Any]:
        return self.suite.machine(self.binding)


def factory_spec(factory: Any) -> str:
    """``module:qualname`` of a factory, the ``--impl`` that names it; a local (non-importable) one says so."""
    module, qualname = getattr(factory, "__module__", None), getattr(factory, "__qualname__", None)
    if not module or not qualname:
        return repr(factory)
    spec = f"{module}:{qualname}"
    try:
        target: Any = importlib.import_module(module)
        for part in qualname.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError):
        target = None
    return spec if target is factory else f"{module}.{qualname} (not importable: replay it with replay_vector)"


def _replay_line(failure_file: str | None, impl_name: str) -> str:
    """How to replay a saved failure without Hypothesis (the CLI if the implementation is importable)."""
    if not failure_file:
        return ""
    vector = str(Path(failure_file).with_suffix(".json"))
    if " " in impl_name or ":" not in impl_name:
        return (f"\nreplay without Hypothesis: kvproof.conformance.check.replay_vector(json.load(open({vector!r})), "
                "factory)")
    return f"\nreplay without Hypothesis: kvproof replay {vector} --impl {impl_name}"


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
              settings: Settings | None = None, profile: str = "ci", impl_name: str | None = None, replay: str = "",
              failures_dir: Path | None = FAILURES_DIR, op_timeout: float | None = DEFAULT_OP_TIMEOUT,
              replay_saved: bool = False, progress: Callable[[RunProgress], None] | None = None,
              isolation: str = "process", memory_limit_mb: int = DEFAULT_MEMORY_LIMIT_MB, seed: int | None = None,
              database: ExampleDatabase | None = None, identity: str | None = None, engine: str = DEFAULT_ENGINE,
              target: bool = False, shrink_with: str = DEFAULT_SHRINKER, **machine_options: Any) -> CheckReport:
    """Drive ``factory(config)`` against the reference with ``component``'s suite; return the report.

    ``machine_options`` go to the suite's machine (e.g. ``decode_config`` for ``decode_prealloc``).
    ``op_timeout`` bounds every call into the implementation (a hung call is a verdict; ``None``
    calls directly). A failure carries a replayable vector (:mod:`kvproof.conformance.vector`) of
    the shrunk failing example; with ``failures_dir`` both are saved there the moment the failure
    is first seen and replaced by the shrunk one at the end (:mod:`kvproof.conformance.saved`).
    With ``replay_saved`` the failures saved there for this test are replayed first, and one that
    still fails is the verdict. ``progress`` hears a :class:`RunProgress` as examples go by (at most every
    :data:`PROGRESS_S` seconds, and when shrinking starts).
    Ctrl-C raises :class:`RunInterrupted` carrying the report so far.

    ``isolation="process"`` (the default) runs the whole run in a child process
    (:mod:`kvproof.conformance.isolation`): an implementation that exits, crashes, hangs past
    any alarm or grows the process by more than ``memory_limit_mb`` MiB (0: no limit) gets a
    verdict naming the call and the step, never ends the caller. ``"in-process"`` is faster and
    unprotected against those. The child's progress and its first verdict come back to this
    process as they happen (``progress`` is called here, not in the child).

    A fuzzing campaign (:mod:`kvproof.conformance.fuzz`) runs a randomized profile with ``seed`` (Hypothesis' public
    ``@seed`` on the test: the same seed, the same examples) and a shared ``database``
    (:mod:`kvproof.conformance.database`): Hypothesis saves each failure's choices there the moment it is found and
    replays them first in later runs, and every failure's vector is kept there too (``replay_saved`` replays those as
    well); ``identity`` names the test there (default ``kvproof:<component>/<config>``). ``engine="breadth"`` runs
    the suite's rules and checks without Hypothesis' engine (:mod:`kvproof.conformance.breadth`: ``max_examples``
    swarm examples of ``stateful_step_count`` steps from ``seed``) and shrinks a failure's vector by replaying
    candidates (:mod:`kvproof.conformance.shrink`). ``target`` steers Hypothesis toward the suite's
    :attr:`~kvproof.conformance.lockstep.Lockstep.targets` (a campaign's runs; a conformance run never does, so its
    examples stay what its seed makes them).

    ``shrink_with="vector"`` has Hypothesis find a failure but not shrink it (no shrink phase): the failing example's
    vector is shrunk by replaying candidates, as the breadth engine's are (seconds where Hypothesis' shrinker can take
    minutes on a long stateful example; the examples generated are the same).
    """
    if engine not in ENGINES:
        raise UsageError(f"engine {engine!r}: choose one of {list(ENGINES)}")
    if shrink_with not in SHRINKERS:
        raise UsageError(f"--shrink {shrink_with!r}: choose one of {list(SHRINKERS)}")
    # "child": this run is the one an isolated run's child process makes (its notes go to the parent)
    if isolation != "child" and _isolation(isolation) == "process" and not _cannot_fork():
        return _run_isolated(component, factory, config, settings=settings, profile=profile, impl_name=impl_name,
                             replay=replay, failures_dir=failures_dir, op_timeout=op_timeout,
                             replay_saved=replay_saved, progress=progress, memory_limit_mb=memory_limit_mb,
                             seed=seed, database=database, identity=identity, engine=engine, target=target,
                             shrink_with=shrink_with, **machine_options)
    suite = get_suite(component)
    name = suite.component.value
    impl_name = impl_name or factory_spec(factory)
    config = suite.machine.effective_config(config, machine_options)
    # one failure per run, the shrunk one: its vector is the one the report carries; no @reproduce_failure
    # advice (the stateful test it names is built inside run_state_machine_as_test: nobody can decorate it)
    settings = Settings(settings or get_profile(profile), report_multiple_bugs=False, print_blob=False)
    if database is not None:
        settings = Settings(settings, database=database)
    by_vector = engine == "breadth" or shrink_with == "vector"
    if by_vector and Phase.shrink in settings.phases:
        settings = Settings(settings, phases=[p for p in settings.phases if p != Phase.shrink])
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
    findings = declared_findings(probe) or declared_findings(factory)
    # the known findings the run looks past: ids the implementation declares, each one the suite can follow
    accepting = [f.id for f in resolve_accepted(machine_options.get("accept", ()), findings, name,
                                                followed_by(suite.machine))]
    stats = RunStats(digest=hashlib.sha256())
    binding = Binding(factory, config, machine_options, impl_name, f"replay: {replay}" if replay else "", op_timeout,
                      stats, target=target)
    na = suite.machine.not_applicable(caps, config)
    store = FailureFile(failures_dir, name, impl_name, config.label()) if failures_dir is not None else None
    identity = identity or f"kvproof:{name}/{config.label()}"
    if replay_saved and (failures_dir is not None or database is not None):
        hit = first_failing(failures_dir, name, impl_name, config,
                            make_vector(name, config, impl_name, machine_options, [])["machine_options"],
                            lambda v: replay_vector(v, factory, impl_name=impl_name, op_timeout=op_timeout,
                                                    replay_hint=binding.replay_hint or None),
                            load_vectors(database, identity) if database is not None else ())
        if hit is not None:
            where, saved_vector, result = hit
            if where.endswith(".txt"):  # a file under failures_dir
                vector_file = str(Path(where).with_suffix(".json"))
                source, path = (f"{vector_file}, a failure saved by an earlier run, before generating: kvproof replay "
                                f"{vector_file} --impl {impl_name}"), where
            else:  # kept in the example database only (found on another machine of the fleet)
                source, path = f"a failure kept in {where} ({identity}), before generating", None
            failure = f"{result.failure}\n\n(found by replaying {source}; --fresh ignores saved failures)"
            return CheckReport(name, impl_name, config, caps, na, {}, {}, result.steps, 0,
                               time.perf_counter() - start, failure, path, (), saved_vector, declared_version)
    first: list[tuple[str, list[dict[str, Any]]]] = []  # the first verdict of the run and its steps
    first_vector: list[dict[str, Any]] = []  # its vector, as kept in the database until the shrunk one replaces it
    detected: dict[str, Any] = {"seconds": None, "steps": None}  # when the first verdict came (the bug benchmark)

    def first_seen(text: str, steps: list[dict[str, Any]]) -> None:
        if not first:
            # labelled now: a campaign that stops before shrinking ends reports this text, not the final report
            text = f"{text}\n\nknown finding: {label(stats.evidence, findings)} (matched by the verdict's evidence)"
            detected.update(seconds=time.perf_counter() - start, steps=stats.steps)
            first.append((text, json.loads(json.dumps(steps))))
            seen = {**make_vector(name, config, impl_name, machine_options, steps, f"LockstepFailure: {text}"),
                    "first_seen": True}
            if store is not None:
                store.write(FIRST_SEEN + text, seen)
            if database is not None:
                save_vector(database, identity, seen)
            first_vector.append(seen)
            notify("first_seen", text, first[0][1], str(store.path) if store is not None and store.path else None)

    stats.on_verdict = first_seen
    told: dict[str, Any] = {"at": 0.0, "shrinking": False}

    def progressed(s: RunStats) -> None:  # at every example; passed on every PROGRESS_S, and when shrinking starts
        now, shrinking = time.monotonic(), bool(first)
        if now - told["at"] < PROGRESS_S and shrinking == told["shrinking"]:
            return
        told.update(at=now, shrinking=shrinking)
        done = RunProgress(s.examples, s.steps, shrinking, dict(s.rules), dict(s.structure))
        if progress is not None:
            progress(done)
        elif isolation == "child":  # the parent's progress callback is called there, by note
            notify("progress", done)

    stats.on_example = progressed
    failure = None
    saved: str | None = None
    vector: dict[str, Any] | None = None

    def report() -> CheckReport:
        ran = {rule for rule, count in stats.rules.items() if count} | legal_calls(stats)
        never = tuple(r for r in suite.needs(config) if r not in na and r != "misuse" and r not in ran)
        evidence = stats.evidence if failure is not None else None
        return CheckReport(name, impl_name, config, caps, na, dict(stats.rules), dict(stats.outcomes), stats.steps,
                           stats.examples, time.perf_counter() - start, failure, saved, never, vector,
                           declared_version, stats.digest.hexdigest(), dict(stats.calls), dict(stats.structure),
                           structure_targets(suite, config, caps, na), detected["seconds"], detected["steps"],
                           evidence.to_json() if evidence is not None else None,
                           label(evidence, findings) if failure is not None else "",
                           {f: stats.accepted.get(f, 0) for f in accepting}, split=dict(stats.seconds))

    def interrupted() -> RunInterrupted:
        """Stopped by the user (Ctrl-C), while generating or while shrinking (Hypothesis' or the breadth driver's
        vector shrink): the run so far, with the first-seen failure (if any: on disk already) as its failure."""
        nonlocal failure, saved, vector
        if first:
            failure, vector = _unshrunk(first[0][0], first[0][1], name, config, impl_name, machine_options)
            saved = str(store.path) if store is not None and store.path is not None else None
        return RunInterrupted(report())

    try:
        machines: Any = _MachineFactory(suite, binding, identity)
        if seed is not None:
            machines = hypothesis.seed(seed)(machines)
        with stable_generation(), deadline_scope(), _heap_frozen():
            if engine == "breadth":
                drive(machines, seed=seed or 0, examples=settings.max_examples, steps=settings.stateful_step_count)
            else:
                # any zero-argument callable returning a machine is a factory (Hypothesis' docs); its stub says a class
                run_state_machine_as_test(machines, settings=settings)
    except HarnessBug:
        raise
    except KeyboardInterrupt as err:
        raise interrupted() from err
    except Exception as err:  # noqa: BLE001 - the verdict is data here
        notes = "\n".join(n for n in getattr(err, "__notes__", []) if "reproduce_failure" not in n)
        failure = f"{type(err).__name__}: {err}\n{notes}".rstrip()
        evidence = getattr(err, "evidence", None)
        if isinstance(evidence, Evidence):  # the reported example's (shrunk) verdict
            stats.evidence = evidence
        steps = stats.last_vector
        if stats.hung:  # Hypothesis' own verdict after a hang is noise (flaky re-runs): report the hang
            failure, steps = f"LockstepFailure: {stats.hung}", stats.hung_vector
        elif isinstance(err, Flaky) and first:  # a verdict that did not recur: report it, say it is intermittent
            failure = (f"LockstepFailure: {first[0][0]}\n\n(intermittent: the failure did not recur when "
                       f"Hypothesis ran the example again; Hypothesis reported {type(err).__name__})")
            steps = first[0][1]
        elif by_vector:  # no engine shrank it: the vector is shrunk by replaying candidates
            progressed(stats)  # "shrinking", with the run's counts (what an interruption while shrinking reports)
            replayed = functools.partial(_replayed, factory=factory, impl_name=impl_name, op_timeout=op_timeout,
                                         hint=binding.replay_hint)
            try:
                shrunk = shrink(make_vector(name, config, impl_name, machine_options, steps, failure),
                                lambda v: (0, None) if (r := replayed(v)) is None else (r.steps, r.failure))
                # the report's evidence (op, step, operations: what the known-finding label reads) is the shrunk
                # verdict's, as its text is; the unshrunk one's if that replay does not fail (an intermittent bug)
                final = replayed(shrunk.vector) if shrunk is not None else None
            except KeyboardInterrupt as interrupt:
                raise interrupted() from interrupt
            if shrunk is not None:
                failure, steps = shrunk.failure, shrunk.vector["steps"]
                if final is not None and final.failure is not None and final.evidence:
                    stats.evidence = Evidence.from_json(final.evidence)
        vector = make_vector(name, config, impl_name, machine_options, steps, failure)
        if store is not None:
            saved = store.write(failure, vector)
        if database is not None:
            save_vector(database, identity, vector, replaces=first_vector[0] if first_vector else None)
    else:
        if first and store is not None and store.path is not None:  # seen once, then never again: say so
            saved = store.write(f"seen once, but the run passed (Hypothesis could not reproduce it):\n\n"
                                f"{first[0][0]}", None)
    return report()


_frozen = 0  # depth of _heap_frozen scopes


@contextlib.contextmanager
def _heap_frozen() -> Iterator[None]:
    """Leave the objects that exist before a run (torch, Hypothesis, the suites: about 200,000) out of the collector's
    passes during it (``gc.freeze``), and give them back after (``gc.unfreeze``). Hypothesis' engine makes enough
    objects that a default-mode run triggers full collections, and each scanned all of them: about 10 % of its time
    (``kvproof bench``; collections only ever free garbage, so nothing the run does or decides changes)."""
    global _frozen
    if _frozen or not gc.isenabled():
        yield
        return
    gc.freeze()
    _frozen += 1
    try:
        yield
    finally:
        _frozen -= 1
        gc.unfreeze()


def legal_calls(stats: RunStats) -> set[str]:
    """The operations a run called outside a misuse case (a rule, a scenario, the harness): a rule whose operation
    was only ever called as misuse never ran (each misuse case ``misuse:op:case`` makes one call of ``op``)."""
    misused = collections.Counter[str]()
    for name, count in stats.rules.items():
        if name.startswith("misuse:"):
            misused[name.split(":")[1]] += count
    return {op for op, count in stats.calls.items() if count > misused[op]}


def structure_targets(suite: Suite, config: Any, caps: frozenset[Capability], na: tuple[str, ...]
                      ) -> dict[str, int]:
    """The structural dimensions a run of ``suite`` on ``config`` must take to their maximum: each applicable misuse
    case once (for an implementation that rejects misuse), and the suite's own (which also says which misuse cases
    ``config`` cannot stage: maximum 0). A dimension named after a rule (``"replay per example"``) is dropped where
    that rule is not applicable (``na``: the implementation lacks a capability it needs), and so is a misuse case
    the implementation cannot be asked (``misuse:<case>`` in ``na``), whatever the suite says of the config. The
    suite declares its maxima knowing ``na`` too: a dimension only those rules take to its maximum is held to what
    the others reach (:meth:`~kvproof.conformance.lockstep.Lockstep.structure`)."""
    out: dict[str, int] = {}
    if Capability.REJECTS_MISUSE in caps:
        out = {f"misuse {name}": 1 for name in suite.misuse_cases}
    out |= suite.machine.structure(config, na)
    return {k: v for k, v in out.items()
            if v > 0 and k.split(" ", 1)[0] not in na and k.replace(" ", ":", 1) not in na}


def _unshrunk(text: str, steps: list[dict[str, Any]], component: str, config: Any, impl_name: str,
              options: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """A run interrupted while shrinking: its first-seen failure (``text``, the example's ``steps``) and vector."""
    failure = f"LockstepFailure: {text}\n\n(interrupted while shrinking: this is the unshrunk failure)"
    return failure, {**make_vector(component, config, impl_name, options, steps, failure), "first_seen": True}


def _replayed(vector: dict[str, Any], factory: Callable[[Any], Any], impl_name: str, op_timeout: float | None,
              hint: str) -> ReplayResult | None:
    """A vector replayed in this process (a shrink candidate, or the shrunk vector once more for its verdict's
    evidence); ``None`` if its rules no longer apply."""
    try:
        return replay_vector(vector, factory, impl_name=impl_name, op_timeout=op_timeout, replay_hint=hint or None,
                             isolation="in-process")
    except VectorError:
        return None


def _run_isolated(component: Component | str, factory: Callable[[Any], Any], config: Any, *,
                  progress: Callable[[RunProgress], None] | None, memory_limit_mb: int, impl_name: str | None,
                  replay: str, failures_dir: Path | None, op_timeout: float | None,
                  **kwargs: Any) -> CheckReport:
    """:func:`run_check` in a supervised child; its progress and first verdict come back as notes."""
    start = time.perf_counter()
    spec = impl_name or factory_spec(factory)
    options = {k: v for k, v in kwargs.items() if k not in _RUN_OPTIONS}  # the machine options
    first: list[tuple[str, list[dict[str, Any]], str | None]] = []
    last: list[RunProgress] = []  # the child's latest progress note (sent when shrinking starts too)

    def on_note(note: tuple[Any, ...]) -> None:
        if note[0] == "progress":
            last[:] = [note[1]]
            if progress is not None:
                progress(note[1])
        elif note[0] == "first_seen" and not first:
            first.append((note[1], note[2], note[3]))

    try:
        outcome = run_isolated(
            lambda: run_check(component, factory, config, impl_name=spec, replay=replay,
                              failures_dir=failures_dir, op_timeout=op_timeout, isolation="child", **kwargs),
            op_timeout=op_timeout, memory_limit_mb=memory_limit_mb, on_note=on_note)
    except KeyboardInterrupt as err:  # the child is killed; what it had found is on disk and in `first`
        name = get_suite(component).component.value
        failure, vector = _unshrunk(first[0][0], first[0][1], name, config, spec, options) if first else (None, None)
        done = last[0] if last else RunProgress(0, 0, False)  # the counts as of the child's latest note
        raise RunInterrupted(CheckReport(name, spec, config, frozenset(), (), dict(done.rules), {}, done.steps,
                                         done.examples, time.perf_counter() - start, failure,
                                         first[0][2] if first else None, (), vector,
                                         structure=dict(done.structure))) from err
    if not isinstance(outcome, Crash):
        return outcome
    return _crash_report(component, config, spec, replay, failures_dir, options, outcome,
                         time.perf_counter() - start)


#: keyword arguments of run_check that are not machine options
_RUN_OPTIONS = frozenset({"settings", "profile", "replay_saved", "seed", "database", "identity", "engine",
                          "target", "shrink_with"})


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
    saved = FailureFile(failures_dir, name, impl_name, config.label()).write(failure, vector) if failures_dir else None
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


def replay_vector(vector: dict[str, Any], factory: Callable[[Any], Any], *, impl_name: str | None = None,
                  op_timeout: float | None = DEFAULT_OP_TIMEOUT, replay_hint: str | None = None,
                  isolation: str = "process", memory_limit_mb: int = DEFAULT_MEMORY_LIMIT_MB) -> ReplayResult:
    """Replay a vector (from :func:`make_vector` or a report) on ``factory``'s implementation, without Hypothesis.

    ``replay_hint`` is the line a failure ends with (default: the ``kvproof replay`` command);
    ``isolation`` and ``memory_limit_mb`` as for :func:`run_check`.
    """
    suite = get_suite(str(vector["component"]))
    impl_name = impl_name or factory_spec(factory)
    config: Any = suite.config_type.model_validate_json(json.dumps(vector["config"]["value"]))
    if _isolation(isolation) == "process" and not _cannot_fork():
        outcome = run_isolated(lambda: replay_vector(vector, factory, impl_name=impl_name, op_timeout=op_timeout,
                                                     replay_hint=replay_hint, isolation="in-process"),
                               op_timeout=op_timeout, memory_limit_mb=memory_limit_mb)
        if not isinstance(outcome, Crash):
            return outcome
        failure = _crash_text(impl_name, config.label(), outcome, "")
        return ReplayResult(suite.component.value, config.label(), max(len(outcome.vector) - 1, 0), failure)
    with deadline_scope():
        try:
            machine = replay_machine(vector, factory, impl_name=impl_name, op_timeout=op_timeout,
                                     replay_hint=replay_hint)
        except LockstepFailure as err:
            return ReplayResult(suite.component.value, config.label(), 0, f"LockstepFailure: {err}")
        return replay(vector, machine)


def replay_machine(vector: dict[str, Any], factory: Callable[[Any], Any], *, impl_name: str,
                   op_timeout: float | None, replay_hint: str | None = None) -> Any:
    """A fresh machine of ``vector``'s suite on ``factory``'s implementation, with the vector's config and machine
    options, in this process (what :func:`replay_vector` replays on; :mod:`kvproof.conformance.harm` goes on from
    where it stops). Raises ``LockstepFailure`` when the implementation cannot be built."""
    suite = get_suite(str(vector["component"]))
    config: Any = suite.config_type.model_validate_json(json.dumps(vector["config"]["value"]))
    options = {k: suite.option_types[k].model_validate_json(json.dumps(v)) if k in suite.option_types else v
               for k, v in vector.get("machine_options", {}).items()}
    hint = f"replay: kvproof replay VECTOR --impl {impl_name}" if replay_hint is None else replay_hint
    return suite.machine(Binding(factory, config, options, impl_name, hint, op_timeout, RunStats()))


def run_swa_allocator_check(factory: Callable[[Any], Any], config: Any, **kwargs: Any) -> CheckReport:
    """:func:`run_check` of component ``swa_allocator``."""
    return run_check(Component.SWA_ALLOCATOR, factory, config, **kwargs)


def check(component: Component | str, factory: Callable[[Any], Any], config: Any, *,
          settings: Settings | None = None, profile: str = "ci", impl_name: str | None = None,
          isolation: str = "process", memory_limit_mb: int = DEFAULT_MEMORY_LIMIT_MB,
          **machine_options: Any) -> CheckReport:
    """Like :func:`run_check` but raise :class:`ConformanceFailure` on a failure (pytest-free, trio style)."""
    report = run_check(component, factory, config, settings=settings, profile=profile, impl_name=impl_name,
                       isolation=isolation, memory_limit_mb=memory_limit_mb, **machine_options)
    if not report.passed:
        raise ConformanceFailure(failure_text(report))
    return report


def failure_text(report: CheckReport) -> str:
    """A failed report as a test failure: who, where, the verdict, where it was saved and how to replay it."""
    where = f"\n(saved to {report.failure_file})" if report.failure_file else ""
    return (f"{report.impl_name} [{report.component}/{report.config.label()}]: {report.failure}{where}"
            f"{_replay_line(report.failure_file, report.impl_name)}")


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
                   profile: str = "ci", impl_name: str | None = None,
                   **machine_options: Any) -> type[unittest.TestCase]:
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
    """The line that says what diverged (:func:`kvproof.conformance.report.diagnosis`)."""
    return "survived every config" if failure is None else diagnosis(failure)
