"""Lockstep plumbing shared by every component's state machine (habit 6: failures that explain themselves).

A component machine drives the pure reference and an implementation under test with
the same operations and requires the same outcome class (success, ``OutOfMemory``,
``InvalidOperation``; sglang_semantics.md §7 G4: a failed operation changes nothing).
This module holds what does not depend on the component: the trace of operations by
step, the run counters, the two error classes, and :class:`LockstepCore` with
``_run`` (one call on both sides), ``_expect_failure`` and ``_fail`` (the op, the step,
the trace and a replay command). The implementation must provide ``snapshot()`` and
``capabilities``; the config must provide ``label()``.
"""

from __future__ import annotations

import collections
import queue
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hypothesis.stateful import RuleBasedStateMachine

from kvproof.reference.errors import InvalidOperation, OutOfMemory, PoolError

__all__ = ["LockstepFailure", "HarnessError", "OperationTimeout", "Trace", "Stats", "LockstepCore", "index_problem"]


class LockstepFailure(AssertionError):
    """The implementation diverged; the message has the op, the step, the values and a replay hint."""


class HarnessError(RuntimeError):
    """The harness itself generated a call the reference rejects: a bug in kvproof, not in the implementation."""


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
            except BaseException as err:  # noqa: BLE001 - handed back to the caller
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


def _alarm(signum: int, frame: Any) -> None:
    raise OperationTimeout("no return within the per-operation timeout")


def _call_with_timeout(fn: Callable[[], Any], timeout: float | None) -> Any:
    """``fn()`` under a deadline.

    On the main thread of a POSIX process the deadline is a ``SIGALRM`` timer (a few
    microseconds per call): it interrupts Python code, sleeps and lock waits. Elsewhere
    the call runs on a daemon worker thread, abandoned (never joined) when it hangs;
    handing every call to a thread costs about 2x in lockstep steps/s (``kvproof bench``).
    """
    global _worker, _watched
    if timeout is None or _watched:
        return fn()
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
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


class Trace:
    """The operations of one test case, grouped by state-machine step (a rule and what it did)."""

    def __init__(self) -> None:
        self.steps: list[list[str]] = [[]]
        self._heads: list[int | None] = [None]

    def op(self, text: str, *, aside: str | None = None) -> None:
        """Record an operation; an ``aside`` (e.g. a harness read around the step's operation) is annotated."""
        if aside is None and self._heads[-1] is None:
            self._heads[-1] = len(self.steps[-1])
        self.steps[-1].append(f"{text}" if aside is None else f"({aside}) {text}")

    def outcome(self, text: str) -> None:
        self.steps[-1][-1] += text

    def next_step(self) -> None:
        if self.steps[-1]:
            self.steps.append([])
            self._heads.append(None)

    def __len__(self) -> int:
        return sum(1 for step in self.steps if step)

    def render(self) -> str:
        """Numbered steps, each headed by its own operation; asides and further operations indented, in order."""
        lines = []
        steps = [(s, h) for s, h in zip(self.steps, self._heads, strict=True) if s]
        for i, (step, head) in enumerate(steps, 1):
            first = head if head is not None else 0
            lines.append(f"  {i}. {step[first]}")
            lines += [f"       {'then ' if j > first else 'before: '}{op}" for j, op in enumerate(step) if j != first]
        return "\n".join(lines) or "  (no operation yet)"


@dataclass
class Stats:
    """Per-run counters: rule executions, outcomes, steps, examples (reported by ``run_check``)."""

    rules: collections.Counter[str] = field(default_factory=collections.Counter)
    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)
    steps: int = 0
    examples: int = 0
    last_vector: list[dict[str, Any]] = field(default_factory=list)  # the latest example's steps (the failing one)
    hung: str = ""  # the verdict of a call that timed out (later examples stop at once)
    hung_vector: list[dict[str, Any]] = field(default_factory=list)


class LockstepCore(RuleBasedStateMachine):
    """The implementation, the trace, the counters, and one call on both sides; no rules of its own."""

    factory: ClassVar[Callable[[Any], Any]]
    config: ClassVar[Any]
    impl_name: ClassVar[str] = "impl"
    replay_hint: ClassVar[str] = ""
    stats: ClassVar[Stats]
    op_timeout: ClassVar[float | None] = None  # seconds per implementation call; None: no watchdog thread
    snapshot_type: ClassVar[type | None] = None  # what snapshot() must return

    def __init__(self) -> None:
        super().__init__()
        if self.stats.hung:  # an earlier example hung: never call the implementation again in this run
            raise LockstepFailure(self.stats.hung)
        self.impl = type(self).factory(self.config)
        self.caps = frozenset(self.impl.capabilities)
        self.trace = Trace()
        self.last_op = ""
        self.vector: list[dict[str, Any]] = []  # the steps so far, replayable (kvproof.conformance.vector)
        self.stats.examples += 1
        self.stats.last_vector = self.vector

    def _has(self, cap: Any) -> bool:
        return cap in self.caps

    def _verdict(self, message: str) -> str:
        """The op, the step, the values, the trace and a replay command."""
        return (f"{self.impl_name} diverged from the reference [{self.config.label()}] at step {len(self.trace)}:\n"
                f"  {message}\n\noperations so far:\n{self.trace.render()}\n\n{self.replay_hint}")

    def _fail(self, message: str) -> None:
        raise LockstepFailure(self._verdict(message))

    def _run(self, op: str, args: str, ref_call: Callable[[], Any], impl_call: Callable[[], Any],
             *, expect_misuse: bool = False) -> tuple[Any, Any] | None:
        """Run ``op`` on both sides; same outcome class or a divergence. ``None`` if both failed."""
        self.stats.rules[op] += 1
        self.trace.op(f"{op}({args})")
        self.last_op = op
        try:
            ref_result = ref_call()
        except (OutOfMemory, InvalidOperation) as err:
            if isinstance(err, InvalidOperation) and not expect_misuse:
                raise HarnessError(f"harness generated an invalid call {op}({args}): {err}") from err
            self._expect_failure(op, err, impl_call)
            return None
        if expect_misuse:
            raise HarnessError(f"misuse case {op}({args}) was accepted by the reference")
        try:
            impl_result = self._call(op, impl_call)
        except PoolError as err:
            self._fail(f"{op} raised {type(err).__name__}: {err}; the reference succeeded")
        except Exception as err:  # noqa: BLE001 - any crash of the implementation is a verdict
            self._fail(f"{op} crashed with {type(err).__name__}: {err}; the reference succeeded")
        self.trace.outcome(" -> ok")
        self.stats.outcomes["ok"] += 1
        return ref_result, impl_result

    def _expect_failure(self, op: str, ref_err: PoolError, impl_call: Callable[[], Any]) -> None:
        """The reference failed: the implementation must fail the same way and change nothing."""
        kind = type(ref_err)
        before = self._snapshot()
        self.trace.outcome(f" -> {kind.__name__}")
        self.stats.outcomes[kind.__name__] += 1
        try:
            self._call(op, impl_call)
        except kind:
            pass
        except PoolError as err:
            self._fail(f"{op} raised {type(err).__name__} ({err}); the reference raised {kind.__name__} ({ref_err})")
        except Exception as err:  # noqa: BLE001
            self._fail(f"{op} crashed with {type(err).__name__}: {err}; expected {kind.__name__} ({ref_err})")
        else:
            self._fail(f"{op} succeeded; the reference raised {kind.__name__}: {ref_err}")
        if self._snapshot() != before:
            self._fail(f"{op} failed with {kind.__name__} but changed the allocator (a failed operation must "
                       "leave the state unchanged)")

    # ------------------------------------------------------------ calls into the implementation

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` under the per-operation timeout; a timeout is a verdict naming ``what`` and the step."""
        try:
            return _call_with_timeout(fn, self.op_timeout)
        except OperationTimeout:
            message = self._verdict(f"{what} did not return within {self.op_timeout:g} s (hung); the run stops here")
            self.stats.hung, self.stats.hung_vector = message, list(self.vector)
            raise LockstepFailure(message) from None

    def _observe(self, what: str, fn: Callable[[], Any]) -> Any:
        """An observation of the implementation (``snapshot()``, sizes): any exception is a verdict."""
        try:
            return self._call(what, fn)
        except LockstepFailure:
            raise
        except Exception as err:  # noqa: BLE001
            self._fail(f"{what} raised {type(err).__name__}: {err}")

    def _snapshot(self) -> Any:
        snap = self._observe("snapshot()", self.impl.snapshot)
        want = self.snapshot_type
        if want is not None and not isinstance(snap, want):
            self._fail(f"snapshot() returned a {type(snap).__name__}, not a {want.__name__}")
        return snap

    def _require_indices(self, op: str, value: Any, n: int) -> None:
        """The implementation returned ``n`` int64 indices on its device, or a verdict names what is wrong."""
        problem = index_problem(value, n, self.impl.device)
        if problem:
            self._fail(f"{op} returned {problem}")
