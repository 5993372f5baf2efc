"""The lockstep framework on a toy component: one declaration gates, records, counts and watches each rule.

The toy is a counter pool (``take`` / ``give`` pages, misuse: giving back more than was
taken). It is not a kvproof component; it shows that the framework carries a model that
was not written with SGLang's names, and tests the framework's own promises.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test

from kvproof.conformance.errors import HarnessBug, LockstepFailure
from kvproof.conformance.lockstep import (
    Binding,
    Lockstep,
    MisuseCall,
    RunStats,
    check_after_each_step,
    misuse,
    operation,
    scenario,
)
from kvproof.conformance.profiles import get_profile
from kvproof.conformance.vector import ReplayData, replay
from kvproof.reference.contract import Capability
from kvproof.reference.errors import InvalidOperation, OutOfMemory

C = Capability


class Config:
    def __init__(self, pages: int) -> None:
        self.pages = pages

    def label(self) -> str:
        return f"toy{self.pages}"


def take(free: int, n: int) -> int:
    """The toy reference: ``take`` n pages out of ``free``."""
    if n > free:
        raise OutOfMemory("take", "toy", n, free)
    return free - n


def give(free: int, n: int, pages: int) -> int:
    if free + n > pages:
        raise InvalidOperation("give", "n", f"{n} pages were never taken")
    return free + n


class Pool:
    """A correct toy implementation."""

    capabilities = frozenset({C.ALLOC, C.REJECTS_MISUSE})

    def __init__(self, config: Config) -> None:
        self.pages, self.free = config.pages, config.pages

    def take(self, n: int) -> None:
        self.free = take(self.free, n)

    def give(self, n: int) -> None:
        self.free = give(self.free, n, self.pages)

    def snapshot(self) -> int:
        return self.free


class Leaky(Pool):
    def give(self, n: int) -> None:
        super().give(max(0, n - 1))


class NoMisuse(Pool):
    capabilities = frozenset({C.ALLOC})


class Sleepy(Pool):
    def give(self, n: int) -> None:
        time.sleep(5)


class Toy(Lockstep[Config, Pool]):
    def __init__(self, binding: Binding[Config]) -> None:
        super().__init__(binding)
        self.free = self.config.pages

    @operation(needs={C.ALLOC}, n=st.integers(0, 3))
    def take(self, n: int) -> None:
        out = self.call("take", f"{n}", lambda: take(self.free, n), lambda: self.impl.take(n))
        if out:
            self.free = out[0]

    @operation(when=lambda self: self.free < self.config.pages, data=st.data())
    def give(self, data: Any) -> None:
        n = data.choose(list(range(1, self.config.pages - self.free + 1)), "n")
        out = self.call("give", f"{n}", lambda: give(self.free, n, self.config.pages), lambda: self.impl.give(n))
        if out:
            self.free = out[0]

    @scenario(needs={C.BACKUP_RESTORE})
    def checkpoint(self) -> None:
        """Needs a capability no toy declares: always reported not applicable."""

    @misuse("give", "never_taken", when=lambda self: self.free == self.config.pages)
    def _give_unowned(self, data: Any) -> MisuseCall:
        return MisuseCall("1 page, none taken", lambda: give(self.free, 1, self.config.pages),
                          lambda: self.impl.give(1))

    @check_after_each_step
    def same_free_pages(self) -> None:
        self.stats.steps += 1
        if self.snapshot() != self.free:
            self.fail(f"implementation has {self.snapshot()} free pages, reference {self.free}")
        self.trace.next_step()


def _run(factory: Any, *, op_timeout: float | None = None, examples: int = 30, stats: RunStats | None = None,
         machine: type[Toy] = Toy, config: Config | None = None) -> RunStats:
    stats = stats or RunStats(digest=hashlib.sha256())
    binding = Binding(factory, config or Config(4), impl_name=factory.__name__, op_timeout=op_timeout, stats=stats)
    run_state_machine_as_test(lambda: machine(binding), settings=settings(get_profile("dev"), max_examples=examples,
                                                                report_multiple_bugs=False))
    return stats


def test_declarations_are_collected_once_per_class() -> None:
    assert set(Toy.operations) == {"take", "give", "checkpoint"}
    assert Toy.operations["checkpoint"].is_operation is False
    assert set(Toy.misuse_cases) == {"give:never_taken"}
    assert Toy.checks == ("measured", "same_free_pages")  # the base class's (custody, structure), then its own
    assert Toy.needs(Config(4)) == {"checkpoint": {C.BACKUP_RESTORE}, "give": frozenset(), "take": {C.ALLOC},
                                    "misuse": {C.REJECTS_MISUSE}}


class Roomy(Toy):
    """``give_all`` acts only on pools of more than 4 pages; its precondition alone would hold on any."""

    @operation(on=lambda config: config.pages > 4, when=lambda self: self.free < self.config.pages)
    def give_all(self) -> None:
        n = self.config.pages - self.free
        out = self.call("give", f"{n}", lambda: give(self.free, n, self.config.pages), lambda: self.impl.give(n))
        if out:
            self.free = out[0]


def test_a_rule_off_a_config_is_no_rule_there() -> None:
    """``on``: off its configs a rule is not declared, not "not applicable", and never enabled even where its
    precondition holds (so never "never run"); the misuse cases of its operation stay. On its configs it is a rule."""
    assert "give_all" not in Roomy.needs(Config(4)) and "give_all" in Roomy.needs(Config(6))
    assert Roomy.not_applicable(frozenset({C.REJECTS_MISUSE}), Config(4)) == ("checkpoint", "take")
    assert Roomy.not_applicable(frozenset({C.REJECTS_MISUSE}), Config(6)) == ("checkpoint", "take")
    off, on = (_run(Pool, machine=Roomy, config=Config(pages)) for pages in (4, 6))
    assert off.rules["give_all"] == 0 and off.rules["take"] and off.rules["misuse:give:never_taken"]
    assert on.rules["give_all"] > 0


def test_a_call_staged_as_misuse_does_not_run_its_rule() -> None:
    """``never_run`` counts a rule as run when it executed, or when its operation was called outside a misuse case
    (by another rule or the harness): a rule reached only as misuse never ran (an implementation that rejects no
    misuse would not have called it at all)."""
    from kvproof.conformance.check import legal_calls

    stats = RunStats()
    stats.calls.update({"give": 3, "take": 1})
    stats.rules.update({"misuse": 3, "misuse:give:never_taken": 2, "misuse:give:too_many": 1})
    assert legal_calls(stats) == {"take"}
    stats.calls["give"] += 1  # one more call, from a rule
    assert legal_calls(stats) == {"give", "take"}


def test_a_correct_implementation_passes_and_every_rule_is_counted() -> None:
    stats = _run(Pool)
    assert stats.rules["take"] and stats.rules["give"] and stats.rules["misuse:give:never_taken"]
    assert stats.calls["take"] >= stats.rules["take"] and stats.outcomes["InvalidOperation"] > 0
    assert stats.rules["checkpoint"] == 0  # gated: BACKUP_RESTORE is not declared


def test_not_applicable_rules_come_from_the_declarations() -> None:
    assert Toy.not_applicable(Pool.capabilities, Config(4)) == ("checkpoint",)
    assert Toy.not_applicable(NoMisuse.capabilities, Config(4)) == ("checkpoint", "misuse")
    stats = _run(NoMisuse)
    assert not any(name.startswith("misuse") for name in stats.rules)


def test_a_leak_is_a_verdict_with_the_trace() -> None:
    with pytest.raises(LockstepFailure, match=r"(?s)Leaky diverged from the reference \[toy4\].*give.*"
                                              r"operations so far:\n  1\. give\("):
        _run(Leaky)


def test_every_implementation_call_runs_under_the_deadline() -> None:
    """A hung call is a verdict naming it; later examples stop at once (run_check reports the hang itself)."""
    stats = RunStats(digest=hashlib.sha256())
    start = time.perf_counter()
    with pytest.raises(Exception):  # noqa: B017, PT011 - Hypothesis re-raises the hang or calls the run flaky
        _run(Sleepy, op_timeout=0.2, stats=stats)
    assert time.perf_counter() - start < 4
    assert "give did not return within 0.2 s (hung)" in stats.hung and stats.hung_vector


def test_a_recorded_run_replays_without_hypothesis() -> None:
    binding = Binding(Leaky, Config(4), stats=RunStats())
    machine = Toy(binding)
    machine.take(n=2)
    machine.give(data=ReplayData([{"pick": 1}], "give"))
    vector = {"component": "toy", "config": {"label": "toy4"}, "steps": machine.vector}
    assert vector["steps"] == [{"rule": "take", "args": {"n": 2}, "draws": []},
                               {"rule": "give", "args": {}, "draws": [{"pick": 1}]}]
    again = replay(vector, Toy(Binding(Leaky, Config(4), stats=RunStats())))
    assert again.failure and "free pages" in again.failure
    assert replay(vector, Toy(Binding(Pool, Config(4), stats=RunStats()))).passed


def test_a_misuse_case_of_an_undeclared_operation_is_a_harness_bug() -> None:
    with pytest.raises(HarnessBug, match="undeclared operations"):
        class Broken(Toy):
            @misuse("no_such_op", "case")
            def _bad(self, data: Any) -> MisuseCall:
                raise AssertionError


def test_machines_share_no_state_across_runs() -> None:
    """Each run has its own binding and counters: a second run of the same class starts from zero."""
    first, second = _run(Pool, examples=10), _run(Pool, examples=10)
    assert first is not second and first.examples == second.examples
    assert first.rules == second.rules and first.digest.digest() == second.digest.digest()
    assert not any(isinstance(value, RunStats) for value in vars(Toy).values())


def test_a_lazily_armed_deadline_catches_a_hang_at_its_own_deadline_and_only_inside_a_call() -> None:
    """Inside a ``deadline_scope`` the timer is armed by some earlier call and may fire between calls or early in a
    later one: it must then do nothing, or re-arm for what is left of that call, and raise exactly when a call
    outlives its own timeout."""
    from kvproof.conformance.lockstep import OperationTimeout, call_with_timeout, deadline_scope

    t = 1.0  # the timeout; every margin below is a fifth of it or more
    with deadline_scope():
        call_with_timeout(lambda: None, t)  # arms the timer: it fires t from now
        time.sleep(1.4 * t)  # it fires here, between calls: nothing is raised
        assert call_with_timeout(lambda: 7, t) == 7  # arms it again
        time.sleep(0.4 * t)
        # it fires 0.6 t into this call, which has 0.4 t left: not late yet, so the timer is re-armed, not raised
        assert call_with_timeout(lambda: time.sleep(0.8 * t) or 8, t) == 8
        time.sleep(0.4 * t)  # the timer re-armed above fires here, between calls
        call_with_timeout(lambda: None, t)  # arms it again: it fires t from now
        time.sleep(0.4 * t)
        start = time.monotonic()
        with pytest.raises(OperationTimeout):  # it fires 0.6 t into this hang, is re-armed, and fires at its deadline
            call_with_timeout(lambda: time.sleep(5 * t), t)
        assert 0.9 * t < time.monotonic() - start < 3 * t
        time.sleep(1.2 * t)  # nothing left armed fires into the harness
