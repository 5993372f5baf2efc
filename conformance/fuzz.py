"""Fuzzing campaigns (``kvproof fuzz``): the lockstep suites under a time or step budget, on K worker processes.

A campaign is planned like a conformance run (:mod:`kvproof.conformance.plan`: components, configs,
implementations, run options) and cut into *slices*, one per planned test. Each of ``workers`` processes takes
every K-th slice and runs it again and again, each *run* a short randomized run of the suite (``examples``
examples of up to ``steps_per_example`` steps) with its own seed, until the budget is spent: a wall-clock time
(``seconds``) or a number of lockstep steps (``steps``, over all workers). Runs are seeded from the campaign seed,
the slice and the run's index (:func:`run_seed`), so the same seed gives the same runs whichever worker makes them.

**Two engines** over the same rules and checks: Hypothesis (the default; a failure is shrunk by Hypothesis) and the
breadth driver (:mod:`kvproof.conformance.breadth`: no per-step engine, swarm configurations; a failure's vector is
shrunk by replay, :mod:`kvproof.conformance.shrink`).

**Nothing lost.** Every run keeps its failures in the campaign's example database
(:mod:`kvproof.conformance.database`: a directory, or Redis for a fleet) and writes each, the moment it is first
seen, as a replayable vector and a text report under ``.kvproof/failures/`` (replaced by the shrunk one when
shrinking ends; :mod:`kvproof.conformance.saved`). A worker killed with SIGKILL loses nothing found before. A
campaign started again (the same command, or ``resume``) first replays every failure kept for each slice, on disk
and in the database, and reports which still fail; a slice with a failure that still fails is not fuzzed again
(its bug is known: fix it, or leave it out with ``--component`` / ``--config``), nor is one whose run never called
the implementation (its capabilities leave the suite nothing to call on that config: reported, never a pass).
Which runs each slice has done is kept in ``.kvproof/fuzz/<campaign>.json`` (:class:`Ledger`), so a resumed
campaign goes on with new seeds rather than repeating the old ones.

**Stopping.** The budget ends the campaign after the runs under way (a run is seconds long). The caller's first
Ctrl-C stops it the same way at once: each worker's run is interrupted (its failure, if it found one, is on disk
already); a second Ctrl-C kills the workers (:meth:`Campaign.kill`). Either way the summary says what was done.

The caller (the CLI) hears everything through :class:`CampaignEvents` and renders it; this module prints nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing
import os
import queue as queue_mod
import signal
import time
import traceback
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, settings

from kvproof.conformance.check import DEFAULT_OP_TIMEOUT, FAILURES_DIR, CheckReport, get_suite, run_check
from kvproof.conformance.database import open_database, test_identity
from kvproof.conformance.errors import RunInterrupted, UsageError, VectorError
from kvproof.conformance.isolation import DEFAULT_MEMORY_LIMIT_MB, fork_problem
from kvproof.conformance.lockstep import RunProgress
from kvproof.conformance.modes import CAMPAIGN_SHRINKER, DEFAULT_ENGINE, ENGINES, SHRINKERS
from kvproof.conformance.plan import PlannedTest
from kvproof.conformance.report import diagnosis
from kvproof.conformance.saved import FailureFile, saved_vectors, write_atomic

__all__ = ["Budget", "Campaign", "CampaignEvents", "CampaignSpec", "Failure", "Ledger", "SliceTally", "fuzz_settings",
           "parse_duration", "run_seed", "start_method"]

#: Examples per run and steps per example (a run is a few seconds: the budget is checked between runs).
RUN_EXAMPLES, RUN_STEPS = 25, 50
#: Seconds the campaign waits for the runs under way once the budget is spent, before it interrupts them.
WIND_DOWN_S = 30.0
LEDGER_DIR = Path(".kvproof/fuzz")


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``10m``, ``2h``, ``1h30m`` as seconds (> 0); :class:`UsageError` naming the value."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    total, number = 0.0, ""
    for ch in text.strip().lower():
        if ch.isdigit() or ch == ".":
            number += ch
        elif ch in units and number:
            total += float(number) * units[ch]
            number = ""
        else:
            raise UsageError(f"--time {text!r}: not a duration (e.g. 90s, 10m, 2h, 1h30m)")
    if number:
        total += float(number)
    if not total > 0:
        raise UsageError(f"--time {text!r}: a duration > 0 is needed")
    return total


def run_seed(base: int, slice_id: str, index: int) -> int:
    """The seed of run ``index`` of slice ``slice_id`` in a campaign of seed ``base``."""
    return int.from_bytes(hashlib.sha256(f"{base}:{slice_id}:{index}".encode()).digest()[:4], "big")


def fuzz_settings(examples: int = RUN_EXAMPLES, steps: int = RUN_STEPS) -> settings:
    """The profile of one fuzzing run: randomized (each run is seeded), the database given per run, shrinking on
    (a failure is worth its minimal example), targeting on (kvproof's suites report what to steer toward)."""
    return settings(settings.get_profile("default"), max_examples=examples, stateful_step_count=steps,
                    derandomize=False, deadline=None, print_blob=False,
                    phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink),
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                           HealthCheck.data_too_large])


@dataclass(frozen=True)
class Budget:
    """When the campaign ends: after ``seconds`` of wall-clock time, or once ``steps`` lockstep steps are done."""

    seconds: float | None = None
    steps: int | None = None

    def __post_init__(self) -> None:
        if (self.seconds is None) == (self.steps is None):
            raise UsageError("a campaign needs one budget: --time DURATION or --steps N")
        if self.steps is not None and self.steps < 1:
            raise UsageError(f"--steps {self.steps}: at least 1")

    def text(self) -> str:
        return f"{self.seconds:g} s" if self.seconds is not None else f"{self.steps:,} steps"


def start_method() -> str:
    """How the workers start: ``fork`` (cheap, the parent's imports shared) unless this process cannot fork a
    working child (CUDA initialised here, as ``kvproof bench`` does before its fuzz section; a forked worker
    could not use the runtime's device) or the platform has no ``fork``; then ``spawn``."""
    if fork_problem() is None and "fork" in multiprocessing.get_all_start_methods():
        return "fork"
    return "spawn"


@dataclass(frozen=True)
class CampaignSpec:
    """Everything a campaign's workers need (picklable)."""

    tests: tuple[PlannedTest, ...]
    budget: Budget
    workers: int
    seed: int
    engine: str = DEFAULT_ENGINE
    db: str | None = None
    examples: int = RUN_EXAMPLES
    steps_per_example: int = RUN_STEPS
    op_timeout: float | None = DEFAULT_OP_TIMEOUT
    memory_limit_mb: int = DEFAULT_MEMORY_LIMIT_MB
    fresh: bool = False  # ignore the ledger and the saved failures (start over)
    #: who shrinks a default-mode failure (``run_check``'s ``shrink_with``; a campaign's default is the vector
    #: shrinker, :data:`~kvproof.conformance.modes.CAMPAIGN_SHRINKER`); not part of the campaign's identity: the
    #: runs generate the same examples either way
    shrink_with: str = CAMPAIGN_SHRINKER

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise UsageError(f"--mode {self.engine!r}: choose one of {list(ENGINES)}")
        if self.shrink_with not in SHRINKERS:
            raise UsageError(f"--shrink {self.shrink_with!r}: choose one of {list(SHRINKERS)}")
        if self.workers < 1:
            raise UsageError(f"--workers {self.workers}: at least 1")
        if not self.tests:
            raise UsageError("nothing to fuzz: no planned test")

    @property
    def campaign_id(self) -> str:
        """The campaign's name in the ledger: what it fuzzes, how, and its seed (not its budget or workers)."""
        what = json.dumps([[slice_id(t), t.impl.spec] for t in self.tests] + [self.engine, self.seed, self.examples,
                                                                              self.steps_per_example])
        return hashlib.sha256(what.encode()).hexdigest()[:16]


def slice_id(test: PlannedTest) -> str:
    """A slice's name: the test id and its run options (``admission/shared --budget upstream_0523``)."""
    return test.test_id + "".join(f" --{k} {v}" for k, v in sorted(test.option_args.items()))


def identity(test: PlannedTest) -> str:
    return test_identity(test.component.value, test.config.label(), test.impl.spec, test.option_args)


# ---------------------------------------------------------------- what the parent hears


@dataclass(frozen=True)
class Failure:
    """A failure a campaign found or replayed: where, what, where it is kept, whether it was known before."""

    slice: str
    text: str
    file: str | None
    replayed: bool  # found by replaying a failure kept from an earlier run (a known one that still fails)
    seed: int | None = None
    label: str = ""  # the finding the run's report matched by the verdict's evidence (kvproof.conformance.findings)

    @property
    def diagnosis(self) -> str:
        return diagnosis(self.text)

    @property
    def finding(self) -> str:
        """The finding the report's evidence matched; for a failure heard before its run ended (a first-seen note,
        a replay), the one the verdict names (``known finding: S10 ...``); else ``new``."""
        if self.label and self.label != "-":
            return self.label
        for line in self.text.splitlines():
            if "known finding:" in line:
                return line.split("known finding:", 1)[1].strip().split(" (")[0]
        return "new"


@dataclass
class SliceTally:
    """What the campaign did on one slice so far (the runs it finished, the run under way)."""

    slice: str
    component: str
    rules: tuple[str, ...]  # the rules the suite declares on the slice's config
    runs: int = 0
    examples: int = 0
    steps: int = 0
    seconds: float = 0.0  # worker-seconds spent in runs
    covered: Counter[str] = field(default_factory=Counter)
    structure: dict[str, int] = field(default_factory=dict)  # the most each structural dimension reached
    targets: dict[str, int] = field(default_factory=dict)  # the most each can reach (the suite's declaration)
    fingerprints: dict[int, str] = field(default_factory=dict)  # run index -> the run's fingerprint
    live: RunProgress | None = None  # the run under way
    failures: list[Failure] = field(default_factory=list)
    replayed: int = 0  # saved failures replayed at the start
    still_failing: int = 0
    done: bool = False  # not fuzzed any further (it fails, or a run of it checked nothing)
    accepted: Counter[str] = field(default_factory=Counter)  # occurrences of each known finding looked past
    #: the rules (and misuse cases) the implementation cannot run, its capabilities not declared (known after a run)
    not_applicable: tuple[str, ...] = ()
    #: why the slice is not fuzzed further although it passes: a run never called the implementation
    #: (``CheckReport.nothing_checked``); the worker drops the slice
    nothing_checked: str = ""

    @property
    def total_steps(self) -> int:
        return self.steps + (self.live.steps if self.live else 0)

    @property
    def total_examples(self) -> int:
        return self.examples + (self.live.examples if self.live else 0)

    def reached(self) -> dict[str, int]:
        """The most each structural dimension reached, the run under way included."""
        out = dict(self.structure)
        for k, v in (self.live.structure if self.live else {}).items():
            out[k] = max(v, out.get(k, 0))
        return out

    def applicable_rules(self) -> set[str]:
        """The rules the implementation can run: the suite's on this config, less those its capabilities rule out."""
        return set(self.rules) - set(self.not_applicable)

    def rules_covered(self) -> set[str]:
        live = {r for r, n in (self.live.rules if self.live else {}).items() if n}
        return {r for r, n in self.covered.items() if n} | live


class CampaignEvents:
    """What a front end hears (all no-ops here; the CLI shows a live table and a summary)."""

    def started(self, campaign: Campaign) -> None:
        """The workers are up."""

    def updated(self, campaign: Campaign) -> None:
        """Something changed (a run's progress, a run's end, a failure); at most a few times a second."""

    def failure(self, campaign: Campaign, failure: Failure) -> None:
        """A failure was found (or a saved one still fails): it is on disk and in the database already."""


# ---------------------------------------------------------------- the ledger


class Ledger:
    """``.kvproof/fuzz/<campaign>.json``: how many runs each slice of a campaign has done (resume goes on from
    there) and what the campaign found. Written atomically after every run."""

    def __init__(self, campaign_id: str, directory: Path = LEDGER_DIR, fresh: bool = False) -> None:
        self.path = directory / f"{campaign_id}.json"
        self.runs: dict[str, int] = {}
        self.found: list[dict[str, Any]] = []
        self.resumed = False  # an earlier start of this campaign left its ledger (even one killed in its first run)
        if not fresh and self.path.exists():
            try:
                doc = json.loads(self.path.read_text())
                self.runs = {str(k): int(v) for k, v in doc.get("runs", {}).items()}
                self.found = list(doc.get("found", []))
                self.resumed = True
            except (OSError, ValueError, TypeError):
                pass

    def start(self) -> None:
        """The campaign starts: the ledger exists from now on (a campaign killed before any run ends resumes)."""
        self._write()

    def record(self, slice_name: str, runs: int, failure: Failure | None = None) -> None:
        self.runs[slice_name] = max(runs, self.runs.get(slice_name, 0))
        if failure is not None:
            self.found.append({"slice": failure.slice, "diagnosis": failure.diagnosis, "file": failure.file,
                               "seed": failure.seed})
        self._write()

    def _write(self) -> None:
        write_atomic(self.path, json.dumps({"runs": self.runs, "found": self.found}, indent=1))


# ---------------------------------------------------------------- a worker (its own process)


def _worker(wid: int, spec: CampaignSpec, mine: list[int], first_run: dict[str, int], out: Any, stop: Any) -> None:
    """Worker ``wid``: replay the saved failures of its slices, then runs round-robin until told to stop."""
    import torch

    torch.set_num_threads(1)  # one core per worker
    interrupted: list[bool] = []

    def on_sigint(signum: int, frame: Any) -> None:  # the first Ctrl-C interrupts the run; later ones are ignored
        if not interrupted:
            interrupted.append(True)
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)
    try:
        db = open_database(spec.db)
        slices = [spec.tests[i] for i in mine]
        retired: set[str] = set()  # slices not fuzzed further: they fail, or a run of theirs checked nothing
        if not spec.fresh:
            for test in slices:
                if stop.is_set():
                    break
                if _replay_saved(wid, spec, test, db, out):
                    retired.add(slice_id(test))
        index = {slice_id(t): first_run.get(slice_id(t), 0) for t in slices}
        # a step budget is split between the workers, each stopping at its own share: which runs a worker makes
        # never depends on when the parent hears of the others' steps (the same seed, the same runs)
        share = None if spec.budget.steps is None else -(-spec.budget.steps // spec.workers)
        done_steps = 0
        while not stop.is_set() and (share is None or done_steps < share):
            live = [t for t in slices if slice_id(t) not in retired]
            if not live:
                break
            for test in live:
                if stop.is_set() or (share is not None and done_steps >= share):
                    break
                name = slice_id(test)
                report = _one_run(wid, spec, test, db, index[name], out)
                index[name] += 1
                done_steps += report.steps if report is not None else 0
                if report is not None and (not report.passed or report.checked_nothing):
                    retired.add(name)
    except KeyboardInterrupt:
        pass
    except Exception:  # noqa: BLE001 - a harness error: the parent reports it
        out.put(("error", wid, traceback.format_exc()))
    finally:
        out.put(("done", wid))


def _replay_saved(wid: int, spec: CampaignSpec, test: PlannedTest, db: Any, out: Any) -> bool:
    """Replay every failure kept for ``test`` (on disk and in the database); report each; True if one still fails."""
    from kvproof.conformance.check import make_vector, replay_vector
    from kvproof.conformance.database import load_vectors

    config = get_suite(test.component).machine.effective_config(test.config, dict(test.options))
    options = make_vector(test.component.value, config, test.impl.spec, test.options, [])["machine_options"]
    kept = saved_vectors(FAILURES_DIR, test.component.value, test.impl.spec, config, options,
                         load_vectors(db, identity(test)))
    still = 0
    for where, vector in kept:
        try:
            result = replay_vector(vector, test.impl.factory, impl_name=test.impl.spec, op_timeout=spec.op_timeout,
                                   memory_limit_mb=spec.memory_limit_mb)
        except VectorError:
            continue  # the suite changed since: it no longer applies
        if result.failure is not None:
            still += 1
            file = where if where.endswith(".txt") else None
            if file is None:  # kept in the database only (another machine found it): its files on this one too
                file = FailureFile(FAILURES_DIR, test.component.value, test.impl.spec, config.label()).write(
                    result.failure, vector)
            out.put(("failure", wid, slice_id(test), Failure(slice_id(test), result.failure, file, True)))
    out.put(("replayed", wid, slice_id(test), len(kept), still))
    return still > 0


def _one_run(wid: int, spec: CampaignSpec, test: PlannedTest, db: Any, index: int, out: Any) -> CheckReport | None:
    """One run of ``test`` (its ``index``-th in the campaign); its progress and result go to the parent."""
    name = slice_id(test)
    seed = run_seed(spec.seed, name, index)

    def progress(done: RunProgress) -> None:
        out.put(("progress", wid, name, done))

    report: CheckReport | None
    try:
        report = run_check(test.component, test.impl.factory, test.config,
                           settings=fuzz_settings(spec.examples, spec.steps_per_example), impl_name=test.impl.spec,
                           replay=(test.replay_command("ci", None, spec.shrink_with)
                                   + f" (fuzz run seed {seed}, --mode {spec.engine})"),
                           op_timeout=spec.op_timeout, progress=progress, memory_limit_mb=spec.memory_limit_mb,
                           seed=seed, database=db, identity=identity(test), engine=spec.engine,
                           shrink_with=spec.shrink_with, **test.options)
    except RunInterrupted as err:
        report = err.report if isinstance(err.report, CheckReport) else None
        if report is not None:
            out.put(("run", wid, name, index, _summary(report, seed)))
        raise KeyboardInterrupt from err
    out.put(("run", wid, name, index, _summary(report, seed)))
    return report


@dataclass(frozen=True)
class _RunSummary:
    steps: int
    examples: int
    seconds: float
    rules: dict[str, int]
    structure: dict[str, int]
    targets: dict[str, int]
    fingerprint: str
    failure: Failure | None
    accepted: dict[str, int] = field(default_factory=dict)
    not_applicable: tuple[str, ...] = ()
    nothing_checked: str = ""


def _summary(report: CheckReport, seed: int) -> _RunSummary:
    failure = None if report.passed else Failure("", report.failure or "", report.failure_file, False, seed,
                                                 report.finding)
    return _RunSummary(report.steps, report.examples, report.seconds, dict(report.rules), dict(report.structure),
                       dict(report.structure_targets), report.fingerprint, failure, dict(report.accepted),
                       tuple(report.not_applicable), report.nothing_checked() if report.checked_nothing else "")


# ---------------------------------------------------------------- the campaign (the caller's process)


class Campaign:
    """A running campaign: its workers, its tallies, its ledger (module docstring)."""

    def __init__(self, spec: CampaignSpec, events: CampaignEvents | None = None) -> None:
        self.spec = spec
        self.events = events or CampaignEvents()
        open_database(spec.db)  # a bad --db is a usage error before any worker starts
        self.ledger = Ledger(spec.campaign_id, fresh=spec.fresh)
        self.tallies: dict[str, SliceTally] = {}
        for test in spec.tests:
            suite = get_suite(test.component)
            rules = tuple(sorted(set(suite.needs(test.config))))
            self.tallies[slice_id(test)] = SliceTally(slice_id(test), test.component.value, rules)
        self.failures: list[Failure] = []
        self.errors: list[str] = []
        self.started = 0.0
        self.elapsed = 0.0
        self.status = "starting"  # running | complete | stopping | interrupted | killed
        self._procs: list[Any] = []
        self._stop: Any = None
        self._out: Any = None

    # ------------------------------------------------------------ driving

    def run(self) -> str:
        """Run to the end of the budget (or a stop); the final status (``complete``, ``interrupted``, ``killed``)."""
        ctx: Any = multiprocessing.get_context(start_method())
        self._stop, self._out = ctx.Event(), ctx.Queue()
        first = {name: runs for name, runs in self.ledger.runs.items()}
        k = min(self.spec.workers, len(self.spec.tests))
        self.started = time.monotonic()
        self.ledger.start()
        for wid in range(k):
            mine = list(range(wid, len(self.spec.tests), k))
            proc = ctx.Process(target=_worker, args=(wid, self.spec, mine, first, self._out, self._stop),
                               name=f"kvproof-fuzz-{wid}", daemon=True)
            proc.start()
            self._procs.append(proc)
        self.status = "running"
        self.events.started(self)
        done: set[int] = set()
        stopping_since: float | None = None
        last_update = 0.0
        while len(done) < len(self._procs):
            try:
                message = self._out.get(timeout=0.2)
            except queue_mod.Empty:
                message = None
            if message is not None:
                self._hear(message, done)
            for wid, proc in enumerate(self._procs):  # a worker that died without saying so
                if wid not in done and not proc.is_alive() and self._out.empty():
                    done.add(wid)
                    if proc.exitcode not in (0, None):
                        self.errors.append(f"worker {wid} ended with exit code {proc.exitcode}")
            self.elapsed = time.monotonic() - self.started
            if self.status == "running" and self._spent():
                self.status, stopping_since = "stopping", time.monotonic()
                self._stop.set()
            if stopping_since is not None and time.monotonic() - stopping_since > WIND_DOWN_S:
                self._signal(signal.SIGINT)  # runs that outlast the wind-down are interrupted
                stopping_since = time.monotonic() + 3600
            if time.monotonic() - last_update >= 0.25:
                last_update = time.monotonic()
                self.events.updated(self)
        for proc in self._procs:
            proc.join(5)
        if self.status in ("running", "stopping"):
            self.status = "complete"
        self.elapsed = time.monotonic() - self.started
        self.events.updated(self)
        return self.status

    def interrupt(self) -> None:
        """The caller's first Ctrl-C: stop now, interrupting the runs under way (their failures are on disk)."""
        self.status = "interrupted"
        if self._stop is not None:
            self._stop.set()
        self._signal(signal.SIGINT)

    def kill(self) -> None:
        """The caller's second Ctrl-C: kill every worker at once (what they found is on disk and in the database)."""
        self.status = "killed"
        if self._stop is not None:
            self._stop.set()
        self._signal(signal.SIGKILL)
        for proc in self._procs:
            proc.join(5)

    def _signal(self, sig: int) -> None:
        for proc in self._procs:
            if proc.is_alive() and proc.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, sig)

    def _spent(self) -> bool:
        budget = self.spec.budget
        if budget.seconds is not None:
            return self.elapsed >= budget.seconds
        return self.total_steps >= (budget.steps or 0)

    def _hear(self, message: tuple[Any, ...], done: set[int]) -> None:
        kind, wid = message[0], message[1]
        if kind == "done":
            done.add(wid)
        elif kind == "error":
            self.errors.append(f"worker {wid}: {message[2]}")
        elif kind == "progress":
            self.tallies[message[2]].live = message[3]
        elif kind == "replayed":
            tally = self.tallies[message[2]]
            tally.replayed, tally.still_failing = message[3], message[4]
            tally.done = tally.done or message[4] > 0
        elif kind == "failure":
            self._found(message[3])
        elif kind == "run":
            name, index, summary = message[2], message[3], message[4]
            tally = self.tallies[name]
            tally.live = None
            tally.runs += 1
            tally.examples += summary.examples
            tally.steps += summary.steps
            tally.seconds += summary.seconds
            tally.covered.update(summary.rules)
            tally.targets = summary.targets
            tally.fingerprints[index] = summary.fingerprint
            tally.accepted.update(summary.accepted)
            tally.not_applicable = summary.not_applicable
            if summary.nothing_checked:
                tally.nothing_checked, tally.done = summary.nothing_checked, True
            for k, v in summary.structure.items():
                tally.structure[k] = max(v, tally.structure.get(k, 0))
            failure = None
            if summary.failure is not None:
                failure = Failure(name, summary.failure.text, summary.failure.file, False, summary.failure.seed,
                                  summary.failure.label)
                tally.done = True
                self._found(failure)
            self.ledger.record(name, index + 1, failure)

    def _found(self, failure: Failure) -> None:
        self.tallies[failure.slice].failures.append(failure)
        self.failures.append(failure)
        self.events.failure(self, failure)

    # ------------------------------------------------------------ what the front end shows

    @property
    def total_steps(self) -> int:
        return sum(t.total_steps for t in self.tallies.values())

    def fingerprint(self) -> str:
        """A digest of every run's examples, by slice and run index: the same seed and runs, the same digest."""
        runs = sorted((name, i, f) for name, t in self.tallies.items() for i, f in t.fingerprints.items())
        return hashlib.sha256(json.dumps(runs).encode()).hexdigest()[:16]

    def by_component(self) -> dict[str, list[SliceTally]]:
        out: dict[str, list[SliceTally]] = {}
        for tally in self.tallies.values():
            out.setdefault(tally.component, []).append(tally)
        return out


def plan_campaign(tests: Sequence[PlannedTest], budget: Budget, *, workers: int | None = None, seed: int | None = None,
                  engine: str = DEFAULT_ENGINE, db: str | None = None, examples: int = RUN_EXAMPLES,
                  steps_per_example: int = RUN_STEPS, op_timeout: float | None = DEFAULT_OP_TIMEOUT,
                  memory_limit_mb: int = DEFAULT_MEMORY_LIMIT_MB, fresh: bool = False,
                  shrink_with: str = CAMPAIGN_SHRINKER) -> CampaignSpec:
    """A campaign over ``tests`` (skipped ones left out): the workers default to the machine's cores."""
    import random

    runnable = tuple(t for t in tests if not (t.selected and t.selected[0] == "skip"))
    return CampaignSpec(runnable, budget, workers or os.cpu_count() or 1,
                        random.randrange(2**32) if seed is None else seed, engine, db, examples, steps_per_example,
                        op_timeout, memory_limit_mb, fresh, shrink_with)

