"""The lockstep framework every component suite is written in (habits 5-8).

A suite is a :class:`Lockstep` subclass whose rules are *declared*, once, with
:func:`operation` (a reference operation, named exactly like the reference function
and the implementation's method) or :func:`scenario` (a harness step made of several
operations, e.g. "the scheduler's next decode step"). The declaration carries the
rule's capability needs and its extra precondition, and from it alone the framework

* gates the rule: it runs only when the implementation declares what it needs
  (``needs`` all, ``needs_any`` one of) and ``when`` holds; a rule whose needs are not
  declared is reported *not applicable*, never silently skipped;
* records each execution for replay (:mod:`kvproof.conformance.vector`): the rule's
  arguments and every value it draws;
* counts it (rule executions, operation calls, outcomes) in the run's :class:`RunStats`;
* and hands the rule an implementation (``self.impl``) whose every method call runs
  under the per-operation deadline, so a hung call anywhere is a verdict naming it.

Misuse cases are declared the same way, on the operation they misuse, with
:func:`misuse`: a method returning the :class:`MisuseCall` both sides must reject with
``InvalidOperation``. One generic rule, ``misuse``, draws among the applicable cases
(gated by ``Capability.REJECTS_MISUSE`` and the misused operation's own needs).

Each operation runs on both sides through :meth:`Lockstep.call`, which requires the same
outcome class (success, ``OutOfMemory``, ``InvalidOperation``; sglang_semantics.md §7 G4:
a failed operation changes nothing) and turns anything else into a :class:`LockstepFailure`
whose message names the operation, the step, the values, the operations so far and a
replay command (habit 7). A machine is built from a :class:`Binding` (factory, config,
options, the run's counters): no generated classes, no class-level state.

Errors are of two kinds and never mixed: *verdicts* about the implementation
(:class:`Verdict`: :class:`LockstepFailure`), and *harness errors*
(:class:`HarnessError`): kvproof itself or its inputs are at fault.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, NoReturn, Protocol, TypeVar

from hypothesis import currently_in_test_context, target
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvproof.conformance import strategies as st
from kvproof.conformance.custody import Custody
from kvproof.conformance.errors import HarnessBug, LockstepFailure
from kvproof.conformance.findings import Evidence, Finding, declared_findings, followed_by, resolve_accepted
from kvproof.reference.contract import CALLER_OWNED_RESULTS, QUERIES, Capability
from kvproof.reference.errors import InvalidOperation, OutOfMemory, PoolError
from kvproof.reference.registry import Component

__all__ = ["Binding", "CallMonitor", "Lockstep", "MisuseCall", "MisuseCase", "Operation", "OperationTimeout",
           "RunProgress", "RunStats", "Trace", "call_implementation", "check_after_each_step", "deadline_scope",
           "escape_message", "index_problem", "misuse", "operation", "scenario", "set_monitor"]

ConfigT = TypeVar("ConfigT")
ImplT = TypeVar("ImplT")
Needs = frozenset[Capability] | Callable[[Any], frozenset[Capability]]

_OPERATION = "__kvproof_operation__"
_MISUSE = "__kvproof_misuse__"
_CHECK = "__kvproof_check__"


# ---------------------------------------------------------------- declarations


@dataclass(frozen=True)
class Operation:
    """What a rule declares once: its name, its capability needs, its extra precondition."""

    name: str
    needs: Needs = frozenset()
    needs_any: frozenset[Capability] = frozenset()
    when: Callable[[Any], Any] | None = None
    #: a reference operation (``True``) or a harness scenario made of several operations
    is_operation: bool = True
    #: performed on the environment (index memory, the scheduler), not a method of the implementation
    environment: bool = False
    #: the strategies of the rule's plain arguments, by name (``data`` for draws that depend on the state): what
    #: Hypothesis draws them from, and what the breadth driver samples (kvproof.conformance.breadth)
    strategies: tuple[tuple[str, Any], ...] = ()
    #: the configs on which the rule has anything legal to do (``None``: every config). Off them it is no rule of the
    #: suite: not declared (:meth:`Lockstep.needs`), never enabled, never reported as never run; the misuse cases of
    #: its operation are declared apart and stay
    on: Callable[[Any], bool] | None = None

    def on_config(self, config: Any) -> bool:
        return self.on is None or bool(self.on(config))

    def needs_on(self, config: Any) -> frozenset[Capability]:
        """The capabilities this rule needs on ``config`` (a suite may make them depend on the page size)."""
        return self.needs(config) if callable(self.needs) else self.needs

    def applicable(self, caps: frozenset[Capability], config: Any) -> bool:
        return self.needs_on(config) <= caps and (not self.needs_any or bool(self.needs_any & caps))


@dataclass(frozen=True)
class MisuseCase:
    """A declared misuse of ``op``: ``when`` says the machine can stage it now."""

    op: str
    case: str
    when: Callable[[Any], Any] | None
    function: Callable[..., MisuseCall]

    @property
    def name(self) -> str:
        return f"{self.op}:{self.case}"


@dataclass(frozen=True)
class MisuseCall:
    """The call a misuse case stages: both sides must raise ``InvalidOperation`` and change nothing."""

    args: str
    reference: Callable[[], Any]
    implementation: Callable[[], Any]


def _declare(op: Operation, strategies: Mapping[str, Any]) -> Callable[[Callable[..., Any]], Any]:
    def decorate(function: Callable[..., Any]) -> Any:
        @functools.wraps(function)
        def body(self: Lockstep[Any, Any], **kwargs: Any) -> Any:
            return self._execute(op, function, kwargs)

        gated = precondition(lambda self: self._enabled(op))(body)
        final = rule(**strategies)(gated)
        setattr(final, _OPERATION, op)
        return final

    return decorate


def operation(name: str | None = None, *, needs: Needs | Iterable[Capability] = frozenset(),
              needs_any: Iterable[Capability] = (), when: Callable[[Any], Any] | None = None,
              on: Callable[[Any], bool] | None = None, environment: bool = False,
              **strategies: Any) -> Callable[[Callable[..., Any]], Any]:
    """Declare a rule that performs the reference operation named like the method (or ``name``).

    ``strategies`` are Hypothesis strategies for the method's arguments (``data=st.data()``
    for draws that depend on the state). ``when`` is the rule's precondition on the machine's state; ``on`` the
    configs where it can act at all (:attr:`Operation.on`). The operation's name must be a function of the
    component's reference module and a transition of its spec, and, unless it acts on the ``environment`` (index
    memory, the scheduler), a method of the component's contract (``tests/test_registry.py``).
    """
    def decorate(function: Callable[..., Any]) -> Any:
        caps = needs if callable(needs) else frozenset(needs)
        op = Operation(name or function.__name__, caps, frozenset(needs_any), when, True, environment,
                       tuple(strategies.items()), on)
        return _declare(op, strategies)(function)

    return decorate


def scenario(*, needs: Needs | Iterable[Capability] = frozenset(), needs_any: Iterable[Capability] = (),
             when: Callable[[Any], Any] | None = None, on: Callable[[Any], bool] | None = None,
             **strategies: Any) -> Callable[[Callable[..., Any]], Any]:
    """Declare a harness step made of several operations (its name is the method's); gated and recorded alike."""
    def decorate(function: Callable[..., Any]) -> Any:
        caps = needs if callable(needs) else frozenset(needs)
        op = Operation(function.__name__, caps, frozenset(needs_any), when, False, True, tuple(strategies.items()),
                       on)
        return _declare(op, strategies)(function)

    return decorate


def misuse(op: str, case: str, *, when: Callable[[Any], Any] | None = None
           ) -> Callable[[Callable[..., MisuseCall]], Callable[..., MisuseCall]]:
    """Declare a misuse case of operation ``op``; the method ``(self, data) -> MisuseCall`` stages it."""
    def decorate(function: Callable[..., MisuseCall]) -> Callable[..., MisuseCall]:
        setattr(function, _MISUSE, MisuseCase(op, case, when, function))
        return function

    return decorate


def check_after_each_step(function: Callable[..., None]) -> Any:
    """Declare the comparison run after every step (a Hypothesis invariant; replay runs it too). Its time, less that
    of the implementation calls it makes (counted as the implementation's), adds to ``stats.seconds["checks"]``."""

    @functools.wraps(function)
    def timed(self: Lockstep[Any, Any]) -> None:
        seconds = self.stats.seconds
        start, inner = time.perf_counter(), seconds["implementation"]
        try:
            function(self)
        finally:
            seconds["checks"] += time.perf_counter() - start - (seconds["implementation"] - inner)

    setattr(timed, _CHECK, True)
    return invariant()(timed)


# ---------------------------------------------------------------- the deadline on implementation calls


class OperationTimeout(BaseException):
    """An implementation call did not return within the per-operation timeout.

    A ``BaseException``, so that an implementation's own ``except Exception`` cannot swallow it.
    """


class _Worker:
    """One daemon thread that runs implementation calls, so a hung call can be abandoned (never joined)."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[tuple[Callable[[], Any], list[Any], threading.Event]] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="kvproof-impl-call", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            fn, box, done = self._jobs.get()
            try:
                box.append((True, fn()))
            except BaseException as err:  # noqa: BLE001 - handed back to the calling thread, which re-raises it
                box.append((False, err))
            done.set()

    def call(self, fn: Callable[[], Any], timeout: float) -> Any:
        if threading.current_thread() is self._thread:  # nested (an observation inside a watched call)
            return fn()
        box: list[Any] = []
        done = threading.Event()
        self._jobs.put((fn, box, done))
        if not done.wait(timeout):
            raise OperationTimeout(f"no return within {timeout:g} s")
        ok, value = box[0]
        if ok:
            return value
        raise value


_worker: _Worker | None = None
_watched = 0  # depth of watched calls on the main thread (a nested call runs inside the outer deadline)
_scoped = 0  # depth of deadline scopes: while > 0, SIGALRM's handler is the lazy one and calls arm the timer lazily
#: inside a scope: when the watched call in progress must have returned (``time.monotonic``; ``None``: no call), and
#: when the armed timer fires (``None``: not armed)
_call_deadline: float | None = None
_armed_until: float | None = None


def _alarm(signum: int, frame: Any) -> None:
    raise OperationTimeout("no return within the per-operation timeout")


def _lazy_alarm(signum: int, frame: Any) -> None:
    """A scope's ``SIGALRM`` handler: the timer was armed by some earlier call and may fire after that call returned.
    Outside a call it does nothing (the next call arms it again); inside a call whose deadline is still ahead it
    re-arms for what is left; past that deadline it raises, in the hung call."""
    global _armed_until
    _armed_until = None
    deadline = _call_deadline
    if deadline is None:
        return
    left = deadline - time.monotonic()
    if left > 0:
        signal.setitimer(signal.ITIMER_REAL, left)
        _armed_until = deadline
        return
    raise OperationTimeout("no return within the per-operation timeout")


def _forget_timer() -> None:
    """In a forked child: no timer is inherited (POSIX), so none is armed and no call is in progress."""
    global _armed_until, _call_deadline
    _armed_until = _call_deadline = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_timer)


def _alarms() -> bool:
    return threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")


@contextlib.contextmanager
def deadline_scope() -> Iterator[None]:
    """Install a lazy ``SIGALRM`` handler for a whole run (main thread, POSIX). Inside the block a watched call only
    notes its deadline (two clock reads), and arms the timer only when none is armed that fires by then: the timer
    armed by an earlier call fires at most once per timeout, and the handler re-arms it for the call in progress
    or lets it lapse between calls (:func:`_lazy_alarm`). A hang is still caught at its own call's deadline, for
    no system call per call instead of two (arming and disarming), or four outside a scope (:func:`call_with_timeout`
    installs and restores the handler around every call). Elsewhere a no-op."""
    global _scoped, _armed_until, _call_deadline
    if not _alarms():
        yield
        return
    previous = signal.signal(signal.SIGALRM, _lazy_alarm) if not _scoped else None
    _scoped += 1
    try:
        yield
    finally:
        _scoped -= 1
        if not _scoped:
            signal.setitimer(signal.ITIMER_REAL, 0)
            _armed_until = _call_deadline = None
            signal.signal(signal.SIGALRM, previous)


def call_with_timeout(fn: Callable[[], Any], timeout: float | None) -> Any:
    """``fn()`` under a deadline.

    On the main thread of a POSIX process the deadline is a ``SIGALRM`` timer: it interrupts Python code, sleeps and
    lock waits (inside a :func:`deadline_scope`, armed lazily). Elsewhere the call runs on a daemon worker thread,
    abandoned (never joined) when it hangs; handing every call to a thread costs about 2x in lockstep steps/s
    (``kvproof bench``).
    """
    global _worker, _watched, _call_deadline, _armed_until
    if timeout is None or _watched:
        return fn()
    if _scoped and threading.get_ident() == threading.main_thread().ident:  # the lazy handler is installed
        deadline = time.monotonic() + timeout
        if _armed_until is None or _armed_until > deadline:
            signal.setitimer(signal.ITIMER_REAL, timeout)
            _armed_until = deadline
        _watched += 1
        _call_deadline = deadline
        try:
            return fn()
        finally:
            _call_deadline = None
            _watched -= 1
    if _alarms():
        previous = signal.signal(signal.SIGALRM, _alarm)
        _watched += 1
        signal.setitimer(signal.ITIMER_REAL, timeout)
        try:
            return fn()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            _watched -= 1
    if _worker is None:
        _worker = _Worker()
    try:
        return _worker.call(fn, timeout)
    except OperationTimeout:
        _worker = None  # the hung thread keeps running detached; later calls get a fresh one
        raise


def escape_message(what: str, err: BaseException) -> str | None:
    """The verdict on a ``BaseException`` an implementation call raised that is not an ``Exception`` (``sys.exit``
    inside an operation): ``None`` for kvproof's own (``OperationTimeout``), a real Ctrl-C and Hypothesis' control flow.
    """
    if isinstance(err, Exception | OperationTimeout | KeyboardInterrupt):
        return None
    if type(err).__module__.split(".")[0] == "hypothesis":
        return None
    return f"{what} raised {err!r}: an implementation may not exit the process"


class CallMonitor(Protocol):
    """Told about every implementation call (set in the implementation's process, kvproof.conformance.isolation)."""

    def example(self, machine: Lockstep[Any, Any]) -> None:
        """A new example (test case) starts on ``machine``."""

    def enter(self, what: str, machine: Lockstep[Any, Any] | None) -> None:
        """An implementation call (``what``: the method, "the factory", "snapshot()") begins."""

    def leave(self) -> None:
        """The call begun last returned (or raised)."""


_monitor: CallMonitor | None = None


def set_monitor(monitor: CallMonitor | None) -> None:
    """Report every implementation call of this process to ``monitor`` (``None``: to nobody)."""
    global _monitor
    _monitor = monitor


def call_implementation(what: str, fn: Callable[[], Any], timeout: float | None,
                        machine: Lockstep[Any, Any] | None = None) -> Any:
    """``fn()`` under the deadline (:func:`call_with_timeout`), reported to the monitor if one is set."""
    monitor = _monitor
    if monitor is None:
        return call_with_timeout(fn, timeout)
    monitor.enter(what, machine)
    try:
        return call_with_timeout(fn, timeout)
    finally:
        monitor.leave()


class Watched:
    """An implementation (or the KV pool it returns) as rules see it.

    Every method call goes through the machine's deadline (:meth:`Lockstep._deadline`);
    the result of a contract method listed in :data:`SERVICES` is wrapped too. Wrapped
    objects are unwrapped when passed back; attributes that are not methods read through.
    """

    __slots__ = ("_machine", "_methods", "_target")

    def __init__(self, target: Any, machine: Lockstep[Any, Any]) -> None:
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_machine", machine)
        object.__setattr__(self, "_methods", {})  # name -> its watched wrapper (built once)

    def __getattr__(self, name: str) -> Any:
        known = self._methods.get(name)
        if known is not None:
            return known
        value = getattr(self._target, name)
        if not callable(value) or isinstance(value, type):
            return value
        machine = self._machine
        changes = name not in QUERIES  # any other call may change what snapshot() reports
        owned = name in CALLER_OWNED_RESULTS

        def watched(*args: Any, **kwargs: Any) -> Any:
            if args and any(type(a) is Watched for a in args):
                args = tuple([unwrap(a) for a in args])
            if kwargs:
                kwargs = {k: unwrap(v) for k, v in kwargs.items()}
            if changes:
                machine.impl_calls += 1
            custody = machine.custody
            inputs = custody.before(args, kwargs)
            try:
                result = machine._deadline(name, lambda: value(*args, **kwargs))
            except LockstepFailure:
                raise
            except Exception:
                problem = custody.after(name, value, inputs)
                if problem:
                    machine.fail(problem)
                raise
            problem = custody.after(name, value, inputs, len(machine.trace) if owned else 0, result, returned=True)
            if problem:
                machine.fail(problem)
            return Watched(result, machine) if name in SERVICES else result

        self._methods[name] = watched
        return watched

    def __repr__(self) -> str:
        return f"Watched({self._target!r})"


#: Methods of the contract (kvproof.reference.contract) that return an object the harness calls in turn.
SERVICES = frozenset({"get_kvcache"})


def unwrap(value: Any) -> Any:
    """The object behind a :class:`Watched` (or ``value`` itself)."""
    return object.__getattribute__(value, "_target") if isinstance(value, Watched) else value


def index_problem(value: Any, n: int, device: Any) -> str | None:
    """What is wrong with ``value`` as ``n`` int64 slot indices on ``device`` (``None`` if nothing)."""
    import torch

    if not isinstance(value, torch.Tensor):
        return f"a {type(value).__name__}, not a torch.Tensor"
    if value.dtype != torch.int64:
        return f"dtype {value.dtype}, not torch.int64"
    want = torch.device(device)
    if value.device.type != want.type or (want.index is not None and value.device.index != want.index):
        return f"a tensor on {value.device}, not on {want}"
    if value.numel() != n:
        return f"{value.numel()} indices, the reference returned {n}"
    return None


# ---------------------------------------------------------------- the trace and the counters


class Trace:
    """The operations of one test case, grouped by state-machine step (a rule and what it did)."""

    def __init__(self, *, journal: bool = False) -> None:
        self.steps: list[list[str]] = [[]]
        self._heads: list[int | None] = [None]
        self._done = 0  # steps before the last one that hold an operation (every one: _next_step drops empty ones)
        #: with ``journal``, every call below as ``(method, args)``, for a copy in another process to repeat
        self.journal: list[tuple[str, tuple[Any, ...]]] | None = [] if journal else None

    def repeat(self, entries: Iterable[tuple[str, tuple[Any, ...]]]) -> None:
        """Apply another trace's journal entries to this one."""
        for method, args in entries:
            if method not in ("_op", "_outcome", "_next_step"):
                raise HarnessBug(f"not a trace journal entry: {method!r}")
            getattr(self, method)(*args)

    def op(self, text: str, *, aside: str | None = None) -> None:
        """Record an operation; an ``aside`` (e.g. a harness read around the step's operation) is annotated."""
        if self.journal is not None:
            self.journal.append(("_op", (text, aside)))
        self._op(text, aside)

    def _op(self, text: str, aside: str | None) -> None:
        if aside is None and self._heads[-1] is None:
            self._heads[-1] = len(self.steps[-1])
        self.steps[-1].append(f"{text}" if aside is None else f"({aside}) {text}")

    def outcome(self, text: str) -> None:
        if self.journal is not None:
            self.journal.append(("_outcome", (text,)))
        self._outcome(text)

    def _outcome(self, text: str) -> None:
        self.steps[-1][-1] += text

    def next_step(self) -> None:
        if self.journal is not None:
            self.journal.append(("_next_step", ()))
        self._next_step()

    def _next_step(self) -> None:
        if self.steps[-1]:
            self.steps.append([])
            self._heads.append(None)
            self._done += 1

    def __len__(self) -> int:
        """Steps that hold an operation (asked several times a step: counted, not recomputed)."""
        return self._done + bool(self.steps[-1])

    def render(self) -> str:
        """Numbered steps, each headed by its own operation; asides and further operations indented, in order."""
        lines = []
        steps = [(s, h) for s, h in zip(self.steps, self._heads, strict=True) if s]
        for i, (step, head) in enumerate(steps, 1):
            first = head if head is not None else 0
            lines.append(f"  {i}. {step[first]}")
            lines += [f"       {'then ' if j > first else 'before: '}{op}" for j, op in enumerate(step) if j != first]
        return "\n".join(lines) or "  (no operation yet)"


@dataclass(frozen=True)
class RunProgress:
    """What a run has done so far, as a progress callback hears it (from an isolated child: by note)."""

    examples: int
    steps: int
    shrinking: bool  # a failure was found and is being shrunk
    rules: Mapping[str, int] = field(default_factory=dict)  # rule executions so far
    structure: Mapping[str, int] = field(default_factory=dict)  # the most each structural dimension reached so far


@dataclass
class RunStats:
    """One run's counters, shared by the machines of its examples (reported by ``run_check``)."""

    rules: collections.Counter[str] = field(default_factory=collections.Counter)  # rule executions
    calls: collections.Counter[str] = field(default_factory=collections.Counter)  # operations called on both sides
    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)
    steps: int = 0
    examples: int = 0
    last_vector: list[dict[str, Any]] = field(default_factory=list)  # the latest example's steps (the failing one)
    hung: str = ""  # the verdict of a call that timed out (later examples stop at once)
    hung_vector: list[dict[str, Any]] = field(default_factory=list)
    digest: Any = None  # hashlib object over every example's steps (the run's fingerprint)
    #: called with (verdict, the example's steps) at every verdict ``Lockstep.fail`` raises: ``run_check``
    #: saves the first one at once, before Hypothesis shrinks it (nothing is lost if the run is killed)
    on_verdict: Callable[[str, list[dict[str, Any]]], None] | None = None
    #: called at the start of every example (live progress: examples so far, "shrinking…")
    on_example: Callable[[RunStats], None] | None = None
    #: the most each structural dimension reached (:meth:`Lockstep.note`, :meth:`Lockstep.measure`)
    structure: dict[str, int] = field(default_factory=dict)
    #: the evidence of the latest verdict (the failing example's, once Hypothesis has shrunk it)
    evidence: Evidence | None = None
    #: occurrences of each known finding the run looked past (``Binding.accept``)
    accepted: collections.Counter[str] = field(default_factory=collections.Counter)
    #: where the run's time went, in seconds: ``implementation`` (every call under the deadline, observations
    #: included), ``reference`` (its operations) and ``checks`` (the per-step checks, less their implementation calls);
    #: the rest is the driver's (Hypothesis' engine or the breadth driver) and the harness' bookkeeping
    seconds: collections.defaultdict[str, float] = field(default_factory=lambda: collections.defaultdict(float))


@dataclass(frozen=True)
class Binding(Generic[ConfigT]):
    """What one run binds a machine to: the implementation factory, the config, the options, the counters."""

    factory: Callable[[ConfigT], Any]
    config: ConfigT
    options: Mapping[str, Any] = field(default_factory=dict)
    impl_name: str = "impl"
    replay_hint: str = ""
    op_timeout: float | None = None  # seconds per implementation call; None: no deadline
    stats: RunStats = field(default_factory=RunStats)
    #: steer Hypothesis toward the suite's :attr:`Lockstep.targets` (``hypothesis.target``; a campaign's runs)
    target: bool = False


# ---------------------------------------------------------------- the machine


class Lockstep(RuleBasedStateMachine, Generic[ConfigT, ImplT]):
    """The implementation, the trace, the counters and one call on both sides; rules come from subclasses."""

    #: the component whose operations this class declares (a subclass may extend another component's suite)
    component: ClassVar[Component | None] = None
    #: what ``snapshot()`` must return (``None``: not checked)
    snapshot_type: ClassVar[type | None] = None
    #: structural dimensions Hypothesis is steered toward in a campaign (``hypothesis.target``, once per example,
    #: with the most the example reached): those that make the state deep, such as a full pool
    targets: ClassVar[tuple[str, ...]] = ()
    #: the declarations of the class, collected once per class (rules, misuse cases, per-step checks)
    operations: ClassVar[dict[str, Operation]]
    rule_methods: ClassVar[dict[str, str]]  # operation name -> the method that declares it
    declared_by: ClassVar[dict[str, Component | None]]  # operation name -> the component of the declaring class
    misuse_cases: ClassVar[dict[str, MisuseCase]]
    checks: ClassVar[tuple[str, ...]]
    #: why :meth:`ghost` is ``None`` for this component (the harm continuation reports it)
    ghost_missing: ClassVar[str] = "it has no ghost ownership model"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        ops: dict[str, Operation] = {}
        methods: dict[str, str] = {}
        cases: dict[str, MisuseCase] = {}
        checks: dict[str, None] = {}
        owners: dict[str, Component | None] = {}
        members: dict[str, Any] = {}
        for klass in reversed(cls.__mro__):  # the class dicts: no descriptor (TestCase) is triggered
            for name, member in vars(klass).items():
                members[name] = member
                owners[name] = vars(klass).get("component", getattr(klass, "component", None))
        declared_by: dict[str, Component | None] = {}
        for attr, member in sorted(members.items()):
            if (op := getattr(member, _OPERATION, None)) is not None:
                ops[op.name], methods[op.name], declared_by[op.name] = op, attr, owners[attr]
            if (case := getattr(member, _MISUSE, None)) is not None:
                cases[case.name] = case
            if getattr(member, _CHECK, False):
                checks[attr] = None
        cls.operations, cls.rule_methods, cls.misuse_cases, cls.checks = ops, methods, cases, tuple(checks)
        cls.declared_by = declared_by
        unknown = sorted({c.op for c in cases.values()} - set(ops))
        if unknown:
            raise HarnessBug(f"{cls.__name__}: misuse cases of undeclared operations {unknown}")

    def __init__(self, binding: Binding[ConfigT]) -> None:
        super().__init__()
        self.binding = binding
        self.config: ConfigT = binding.config
        self.impl_name, self.op_timeout = binding.impl_name, binding.op_timeout
        self.stats = binding.stats
        if self.stats.hung:  # an earlier example hung: never call the implementation again in this run
            raise LockstepFailure(self.stats.hung)
        self.trace = Trace(journal=_monitor is not None)
        self.example_structure: dict[str, int] = {}  # the most each dimension reached in this example
        self.example_counts: collections.Counter[tuple[str, object]] = collections.Counter()  # count()'s tallies
        self._gates_at = -1  # the step whose preconditions _gates holds
        self._gates: dict[str, bool] = {}
        self.impl_calls = 0  # implementation calls so far, snapshot() excepted (Watched counts them)
        self._snap: tuple[int, Any] | None = None  # (impl_calls when taken, the snapshot)
        self.last_op = ""
        self.vector: list[dict[str, Any]] = []  # the steps so far, replayable (kvproof.conformance.vector)
        self.custody = Custody()  # the caller's tensors: inputs and returned indices (kvproof.conformance.custody)
        self.stats.examples += 1
        self.stats.last_vector = self.vector
        if self.stats.on_example is not None:
            self.stats.on_example(self.stats)
        if _monitor is not None:
            _monitor.example(self)
        try:
            built = self._deadline("the factory", lambda: binding.factory(binding.config))
        except LockstepFailure:
            raise
        except Exception as err:  # noqa: BLE001 - a factory that fails here (run_check's probe passed) is a verdict
            self.fail(f"the factory {self.impl_name} raised {type(err).__name__}: {err} (building the "
                      f"implementation of example {self.stats.examples})")
        self.caps: frozenset[Capability] = frozenset(built.capabilities)
        #: each operation's capability gate on this run (capabilities and config are fixed for the example): what
        #: its misuse cases need; its rule also needs the config to be one it acts on
        self.applicable = {name: op.applicable(self.caps, self.config) for name, op in self.operations.items()}
        self.rule_on = {name: self.applicable[name] and op.on_config(self.config)
                        for name, op in self.operations.items()}
        self.impl: Any = Watched(built, self)
        self.target: Any = built  # the implementation itself, for queries (:meth:`query`)
        #: the known findings this run looks past (the machine option ``accept``: finding ids the implementation
        #: declares, each with a documented behaviour the suite follows; :mod:`kvproof.conformance.findings`)
        self.accepting: tuple[Finding, ...] = resolve_accepted(
            binding.options.get("accept", ()), declared_findings(built) or declared_findings(binding.factory),
            self.component.value if self.component is not None else "?", followed_by(type(self)))

    # ------------------------------------------------------------ declarations at work

    @classmethod
    def needs(cls, config: Any) -> dict[str, frozenset[Capability]]:
        """Each rule's capability needs on ``config``, of the rules that act on it (``misuse`` needs REJECTS_MISUSE)."""
        out = {name: op.needs_on(config) for name, op in sorted(cls.operations.items()) if op.on_config(config)}
        if cls.misuse_cases:
            out["misuse"] = frozenset({Capability.REJECTS_MISUSE})
        return out

    @classmethod
    def effective_config(cls, config: Any, options: dict[str, Any]) -> Any:
        """The config both sides are built from under the run's machine ``options`` (the factory too: its probe
        sees what the run will build). The default: ``config`` itself."""
        return config

    @classmethod
    def not_applicable(cls, caps: frozenset[Capability], config: Any) -> tuple[str, ...]:
        """Rules (and, for an implementation that rejects misuse, misuse cases) whose needs ``caps`` lacks; a rule
        that does not act on ``config`` is none of them (it is no rule there)."""
        out = [name for name, op in sorted(cls.operations.items())
               if op.on_config(config) and not op.applicable(caps, config)]
        if cls.misuse_cases and Capability.REJECTS_MISUSE not in caps:
            out.append("misuse")
        elif Capability.REJECTS_MISUSE in caps:
            out += [f"misuse:{name}" for name, case in sorted(cls.misuse_cases.items())
                    if not cls.operations[case.op].applicable(caps, config)]
        return tuple(out)

    def _gate(self, name: str, compute: Callable[[], bool]) -> bool:
        """A rule's precondition, computed once per step (Hypothesis asks it several times while it picks a rule;
        nothing changes the machine between two rules)."""
        step = len(self.vector)
        if self._gates_at != step:
            self._gates_at, self._gates = step, {}
        known = self._gates.get(name)
        if known is None:
            known = self._gates[name] = bool(compute())
        return known

    def _enabled(self, op: Operation) -> bool:
        if not self.rule_on[op.name]:
            return False
        when = op.when
        return when is None or self._gate(op.name, lambda: when(self))

    def teardown(self) -> None:
        """End of an example: fold its steps into the run's fingerprint (same seed, same examples, same digest); in a
        campaign, tell Hypothesis how far toward its targets the example got."""
        if self.stats.digest is not None:  # repr: the steps are plain values, made by the same code every time
            self.stats.digest.update(repr(self.vector).encode())
        if self.binding.target and currently_in_test_context():
            for label in self.targets:
                target(float(self.example_structure.get(label, 0)), label=label)

    # ------------------------------------------------------------ structural coverage

    @classmethod
    def structure(cls, config: Any, na: tuple[str, ...] = ()) -> Mapping[str, int]:
        """The suite's structural dimensions on ``config``, each with the most its strategies can reach there (what
        a ``ci`` run of the default configs must reach: ``tests/conformance/test_structure.py``). Default: none.

        ``na``: the rules (and ``misuse:<case>``) not applicable to the implementation under test (its declared
        capabilities lack what they need, :meth:`not_applicable`). A dimension that only those rules take to its
        maximum is declared with the most the remaining rules reach (a dimension named after a rule is dropped
        with it by :func:`~kvproof.conformance.check.structure_targets` whatever this says)."""
        return {}

    def measure(self) -> Mapping[str, int]:
        """Each state dimension's value now (called after every step: requests alive, pools full, ...)."""
        return {}

    def note(self, dimension: str, value: int = 1) -> None:
        """An event dimension reached ``value`` (a batch's size, a misuse case staged): the run keeps the most."""
        for record in (self.stats.structure, self.example_structure):
            if value > record.get(dimension, -1):
                record[dimension] = value

    def count(self, dimension: str, key: object = None) -> None:
        """One more event of ``dimension`` in this example (``"restore_state per example"``); with ``key``, counted
        per key (``"add_chunked_req per request"``, by request), the most over the keys kept."""
        self.example_counts[dimension, key] += 1
        self.note(dimension, self.example_counts[dimension, key])

    @check_after_each_step
    def measured(self) -> None:
        """After every step: the tensors the implementation returned are as it returned them
        (:mod:`kvproof.conformance.custody`), and the state dimensions (:meth:`measure`)."""
        problem = self.custody.returned_problem(lambda: f"a call of step {len(self.trace)} (the last: {self.last_op})")
        if problem:
            self.fail(problem)
        run, example = self.stats.structure, self.example_structure
        for dimension, value in self.measure().items():  # note(), inlined: this runs after every step
            if value > run.get(dimension, -1):
                run[dimension] = value
            if value > example.get(dimension, -1):
                example[dimension] = value

    def supports(self, cap: Capability) -> bool:
        return cap in self.caps

    def ghost(self) -> Any:
        """The implementation, from where this machine stands, driven alone under a ghost ownership model (a
        :class:`kvproof.conformance.harm.Ghost`: the harm continuation after a divergence); ``None``: this component
        has none."""
        return None

    def run_checks(self) -> None:
        """Every per-step check the class declares (``check_after_each_step``), as Hypothesis runs them after a rule:
        the drivers without Hypothesis' stateful runner (replay, breadth) call this."""
        for name in type(self).checks:
            getattr(self, name)()

    def _execute(self, op: Operation, function: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
        """Run one rule: record it (kvproof.conformance.vector), count it, then its body."""
        from kvproof.conformance.vector import begin_step

        kwargs = begin_step(self, op.name, kwargs)
        self.stats.rules[op.name] += 1
        self.last_op = op.name
        return function(self, **kwargs)

    def _misuse_cases_now(self) -> list[str]:
        """Cases whose operation the implementation supports and that the machine can stage now."""
        return [name for name, case in sorted(self.misuse_cases.items()) if self._stageable(case)]

    def _stageable(self, case: MisuseCase) -> bool:
        return self.applicable[case.op] and (case.when is None or bool(case.when(self)))

    def misuse_allowed(self) -> bool:
        """A machine may ration misuse (e.g. every third step only) so it does not crowd out the lifecycle."""
        return True

    def misuse_enabled(self) -> bool:
        """The generic ``misuse`` rule's precondition."""
        return (bool(self.misuse_cases) and self.supports(Capability.REJECTS_MISUSE) and self.misuse_allowed()
                and self._gate("misuse", lambda: any(map(self._stageable, self.misuse_cases.values()))))

    @precondition(lambda self: self.misuse_enabled())
    @rule(data=st.data())
    def misuse(self, data: st.DataObject) -> None:
        """A call that violates one documented precondition: both sides must raise InvalidOperation."""
        from kvproof.conformance.vector import begin_step

        kwargs = begin_step(self, "misuse", {"data": data})
        self.stats.rules["misuse"] += 1
        # every case the machine can stage now, those not yet staged in this example first; and since Hypothesis
        # favours the first of a list, the first turns with the step
        now = self._misuse_cases_now()
        cases = [c for c in now if f"misuse {c}" not in self.example_structure] or now
        turn = len(self.trace) % len(cases)
        name = kwargs["data"].draw(st.sampled_from(cases[turn:] + cases[:turn]), label="case")
        case = self.misuse_cases[name]
        staged = case.function(self, kwargs["data"])
        self.stats.rules[f"misuse:{name}"] += 1
        self.note(f"misuse {name}")
        self.call(case.op, f"{staged.args} [misuse: {case.case}]", staged.reference, staged.implementation,
                  expect_misuse=True)

    # ------------------------------------------------------------ verdicts

    def verdict(self, message: str) -> str:
        """The op, the step, the values, the trace and a replay command."""
        label = getattr(self.config, "label", lambda: "?")()
        return (f"{self.impl_name} diverged from the reference [{label}] at step {len(self.trace)}:\n"
                f"  {message}\n\noperations so far:\n{self.trace.render()}\n\n{self.binding.replay_hint}")

    def fail(self, message: str, *, check: str = "other", detail: Mapping[str, Any] | None = None) -> NoReturn:
        """A verdict: raise :class:`LockstepFailure` with the full explanation and its evidence (what ``check`` saw,
        with its values ``detail``: :mod:`kvproof.conformance.findings`), first told to ``stats.on_verdict``."""
        text = self.verdict(message)
        evidence = self.evidence(check, detail)
        self.stats.evidence = evidence
        if self.stats.on_verdict is not None:
            self.stats.on_verdict(text, self.vector)
        raise LockstepFailure(text, evidence)

    def evidence(self, check: str, detail: Mapping[str, Any] | None = None) -> Evidence:
        """What a verdict of ``check`` at this point saw (the op, the step, the operations so far)."""
        component = self.component.value if self.component is not None else "?"
        ops = tuple(step[0].split("(", 1)[0] for step in self.trace.steps if step)
        return Evidence(component, self.last_op, check, len(self.trace), ops, dict(detail or {}))

    def looks_past(self, evidence: Evidence, **context: Any) -> bool:
        """Whether the run looks past this occurrence: a finding it accepts (``Binding.accept``) matches the evidence
        and the suite's method for the finding's behaviour (:func:`kvproof.conformance.findings.follows`) confirms
        the implementation did exactly that and makes the reference do the same. Counted and noted in the trace."""
        if not self.accepting:
            return False
        methods = followed_by(type(self))
        for finding in self.accepting:
            method = methods.get(finding.behaviour or "")
            if method is not None and finding(evidence) and getattr(self, method)(evidence, **context):
                self.stats.accepted[finding.id] += 1
                self.trace.outcome(f" [known {finding.id}, looked past: {finding.behaviour}]")
                return True
        return False

    # ------------------------------------------------------------ one operation on both sides

    def call(self, op: str, args: str, ref_call: Callable[[], Any], impl_call: Callable[[], Any],
             *, expect_misuse: bool = False, aside: str | None = None) -> tuple[Any, Any] | None:
        """Run ``op`` on both sides; same outcome class or a verdict. ``None`` if both failed alike.

        The reference's ``InvalidOperation`` outside a misuse case is a harness bug (kvproof
        generated a call its own contract rejects), never a verdict about the implementation.
        """
        self.stats.calls[op] += 1
        self.trace.op(f"{op}({args})", aside=aside)
        self.last_op = op
        start = time.perf_counter()
        try:
            ref_result = ref_call()
        except (OutOfMemory, InvalidOperation) as err:
            self.stats.seconds["reference"] += time.perf_counter() - start
            if isinstance(err, InvalidOperation) and not expect_misuse:
                raise HarnessBug(f"harness generated an invalid call {op}({args}): {err}") from err
            self._expect_failure(op, err, impl_call)
            return None
        self.stats.seconds["reference"] += time.perf_counter() - start
        if expect_misuse:
            raise HarnessBug(f"misuse case {op}({args}) was accepted by the reference")
        try:
            impl_result = impl_call()
        except PoolError as err:
            self.fail(f"{op} raised {type(err).__name__}: {err}; the reference succeeded", check="outcome",
                      detail={"reference": "ok", "implementation": type(err).__name__})
        except LockstepFailure:
            raise
        except Exception as err:  # noqa: BLE001 - any crash of the implementation is a verdict
            self.fail(f"{op} crashed with {type(err).__name__}: {err}; the reference succeeded", check="crash",
                      detail={"reference": "ok", "implementation": type(err).__name__})
        self.trace.outcome(" -> ok")
        self.stats.outcomes["ok"] += 1
        return ref_result, impl_result

    def _expect_failure(self, op: str, ref_err: PoolError, impl_call: Callable[[], Any]) -> None:
        """The reference failed: the implementation must fail the same way and change nothing."""
        kind = type(ref_err)
        before = self.snapshot()
        self.trace.outcome(f" -> {kind.__name__}")
        self.stats.outcomes[kind.__name__] += 1
        outcome = {"reference": kind.__name__}
        try:
            impl_call()
        except kind:
            pass
        except LockstepFailure:
            raise
        except PoolError as err:
            self.fail(f"{op} raised {type(err).__name__} ({err}); the reference raised {kind.__name__} ({ref_err})",
                      check="outcome", detail={**outcome, "implementation": type(err).__name__})
        except Exception as err:  # noqa: BLE001 - any crash of the implementation is a verdict
            self.fail(f"{op} crashed with {type(err).__name__}: {err}; expected {kind.__name__} ({ref_err})",
                      check="crash", detail={**outcome, "implementation": type(err).__name__})
        else:
            self.fail(f"{op} succeeded; the reference raised {kind.__name__}: {ref_err}", check="outcome",
                      detail={**outcome, "implementation": "ok"})
        after = self.snapshot()
        if not self.unchanged(before, after):
            detail = {**outcome, **self.describe_change(before, after)}
            if self.looks_past(self.evidence("unchanged_on_failure", detail), before=before, after=after,
                               error=ref_err):
                return
            self.fail(f"{op} failed with {kind.__name__} but changed the allocator (a failed operation must "
                      "leave the state unchanged)", check="unchanged_on_failure", detail=detail)

    # ------------------------------------------------------------ observing the implementation

    def unchanged(self, before: Any, after: Any) -> bool:
        """Whether a failed call left the implementation as it was (G4), as far as its contract observes: by
        default the snapshots are equal; a suite whose order of free pages is policy unless declared says so."""
        return bool(before == after)

    def describe_change(self, before: Any, after: Any) -> dict[str, Any]:
        """What changed between two snapshots, as plain values for the evidence of a verdict (a suite says it in its
        own terms: which pages left which free list; by default nothing beyond the fact)."""
        return {}

    def _deadline(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` under the per-operation timeout; a timeout is a verdict naming ``what`` and the step, and so is
        a ``BaseException`` that is not an ``Exception`` (``SystemExit``: an implementation may not exit). Its time adds
        to ``stats.seconds["implementation"]``."""
        start = time.perf_counter()
        try:
            return call_implementation(what, fn, self.op_timeout, self)
        except OperationTimeout:
            message = self.verdict(f"{what} did not return within {self.op_timeout:g} s (hung); the run stops here")
            self.stats.hung, self.stats.hung_vector = message, list(self.vector)
            self.stats.evidence = self.evidence("hang", {"call": what})
            raise LockstepFailure(message, self.stats.evidence) from None
        except BaseException as err:
            escaped = escape_message(what, err)
            if escaped is None:
                raise
            self.stats.evidence = self.evidence("crash", {"call": what, "implementation": type(err).__name__})
            raise LockstepFailure(self.verdict(escaped), self.stats.evidence) from None
        finally:
            self.stats.seconds["implementation"] += time.perf_counter() - start

    def observe(self, what: str, fn: Callable[[], Any]) -> Any:
        """An observation of the implementation (``snapshot()``, sizes): any exception is a verdict."""
        try:
            return fn()
        except LockstepFailure:
            raise
        except Exception as err:  # noqa: BLE001 - a broken observation is a verdict about the implementation
            self.fail(f"{what} raised {type(err).__name__}: {err}")

    def query(self, what: str, fn: Callable[[Any], Any]) -> Any:
        """``fn(implementation)``: several queries of the implementation (``QUERIES``: methods that change nothing and
        take no tensor of the caller's) as one observation under one deadline; anything they raise, a timeout
        included, is a verdict naming ``what``. Cheaper than a watched call per query (no custody, one timer), which
        is what the per-step comparison makes several of."""
        return self.observe(what, lambda: self._deadline(what, lambda: fn(self.target)))

    def snapshot(self, target: Any = None) -> Any:
        """The implementation's ``snapshot()`` (or that of ``target``, another watched object), of the
        declared type, or a verdict. The implementation's own is taken once between two of its calls: the harness
        asks for it several times a step (the comparison, staging a misuse case, a hook), and nothing but a call
        changes an implementation the harness drives from one thread."""
        if target is None and self._snap is not None and self._snap[0] == self.impl_calls:
            return self._snap[1]  # nothing but a query (reference.contract.QUERIES) was called since
        snap = self.observe("snapshot()", (self.impl if target is None else target).snapshot)
        want = self.snapshot_type
        if want is not None and not isinstance(snap, want):
            self.fail(f"snapshot() returned a {type(snap).__name__}, not a {want.__name__}")
        if target is None:
            self._snap = (self.impl_calls, snap)
        return snap

    def require_indices(self, op: str, value: Any, n: int) -> None:
        """The implementation returned ``n`` int64 indices on its device, or a verdict names what is wrong."""
        problem = index_problem(value, n, self.impl.device)
        if problem:
            self.fail(f"{op} returned {problem}")
