"""The breadth driver (``kvproof fuzz --mode breadth``, :mod:`kvproof.conformance.breadth`): every suite's rules run
under it, its rule choice follows the swarm's weights over the enabled rules only, the same seed gives the same run,
and a planted bug is found and its vector shrunk and replayed."""

from __future__ import annotations

import collections
import itertools
import random
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st

from kvproof.conformance.breadth import EDGES, KEEP, SIMPLE, Swarm, _choose, swarm
from kvproof.conformance.check import get_suite, replay_vector, run_check
from kvproof.conformance.errors import HarnessBug
from kvproof.conformance.generation import sample
from kvproof.conformance.mutants.swa_allocator import MUTANTS
from kvproof.conformance.plan import load_impls, plan
from kvproof.gpu_runtime.swa_allocator import SWATokenToKVPoolAllocator
from kvproof.reference.registry import Component, Layer, info

SUITES = [c for c in Component if info(c).has(Layer.SUITE)]


def _small(examples: int, steps: int) -> settings:
    return settings(max_examples=examples, stateful_step_count=steps, deadline=None, database=None)


@pytest.mark.parametrize("component", [c.value for c in SUITES])
def test_every_declared_strategy_is_sampled_within_its_bounds(component: str) -> None:
    """Each rule's declared argument strategies, sampled at every edge and simple-draw probability: values Hypothesis
    could draw (an integer within its bounds, an element of a ``sampled_from``); a strategy ``sample`` does not know
    is a HarnessBug, never a silent default."""
    machine = get_suite(component).machine
    rng = random.Random(0)
    declared = [(op.name, name, strategy) for op in machine.operations.values() for name, strategy in op.strategies
                if name != "data"]
    for rule, name, strategy in declared:
        for edge, simple in itertools.product(EDGES, SIMPLE):
            for _ in range(20):
                value = sample(strategy, rng, edge, simple)
                assert _could_draw(strategy, value), (rule, name, strategy, value)


def _could_draw(strategy: Any, value: Any) -> bool:
    s = strategy
    while type(s).__name__ == "LazyStrategy":
        s = s.wrapped_strategy
    kind = type(s).__name__
    if kind == "IntegersStrategy":
        return isinstance(value, int) and s.start <= value <= s.end
    if kind == "BooleansStrategy":
        return isinstance(value, bool)
    if kind == "SampledFromStrategy" and not s._transformations:
        return value in list(s.elements)
    return True  # mapped / filtered / composite shapes: sample() applies their own functions


def test_sample_refuses_a_strategy_it_does_not_know() -> None:
    with pytest.raises(HarnessBug, match="breadth sampling does not know"):
        sample(st.text(), random.Random(0))
    with pytest.raises(HarnessBug, match="bounded integers"):
        sample(st.integers(min_value=0), random.Random(0))


def test_edges_are_drawn_at_the_rate_asked() -> None:
    """With edge probability 1 an integer is one of its bounds (or next to them); with 0 it spreads over the range."""
    rng = random.Random(1)
    assert {sample(st.integers(10, 1000), rng, 1.0) for _ in range(200)} <= {10, 11, 999, 1000}
    assert len({sample(st.integers(10, 1000), rng, 0.0) for _ in range(200)}) > 100


def test_simple_draws_lean_where_hypothesis_does() -> None:
    """With simple-draw probability 1 an integer leans to its lower bound (``lo + n * u**3``: half of them in the
    lowest eighth of the range) and a ``sampled_from`` gives the first element its filter keeps; with 0 neither."""
    rng = random.Random(2)
    low = [sample(st.integers(0, 799), rng, 0.0, 1.0) for _ in range(400)]
    assert all(0 <= v <= 799 for v in low) and sum(v < 100 for v in low) > 160
    assert sum(sample(st.integers(0, 799), rng, 0.0, 0.0) < 100 for _ in range(400)) < 80
    assert {sample(st.sampled_from([3, 1, 2]).filter(lambda v: v != 3), rng, 0.0, 1.0) for _ in range(50)} == {1}
    assert len({sample(st.sampled_from([3, 1, 2]), rng, 0.0, 0.0) for _ in range(50)}) == 3


def test_an_extreme_is_decided_before_a_simple_value_for_every_kind() -> None:
    """The same order for an integer and a ``sampled_from``: an extreme with probability ``edge``, otherwise a simple
    value with probability ``simple``. So a ``sampled_from`` gives its last element as often as an integer its upper
    bound, whatever ``simple`` is."""
    rng = random.Random(4)
    picks = collections.Counter(sample(st.sampled_from([0, 1, 2, 3, 4]), rng, 1.0, 1.0) for _ in range(400))
    assert set(picks) == {0, 4} and picks[4] > 150
    assert {sample(st.sampled_from([0, 1, 2, 3, 4]).filter(lambda v: v != 4), rng, 1.0, 1.0) for _ in range(50)} == {0}
    # edge 0.5 and simple 1: half the draws are extremes. The last of a sampled_from is one of 2 extremes (about 500
    # of 2,000), an integer's upper bound one of 4 (about 250); the other half is simple: the first, or near lo
    for strategy, extremes in ((st.sampled_from(range(800)), 2), (st.integers(0, 799), 4)):
        tops = sum(sample(strategy, rng, 0.5, 1.0) == 799 for _ in range(2000))
        assert abs(tops - 1000 / extremes) < 80, (strategy, tops)


class _Rules:
    """A stand-in machine for the rule choice: ``enabled`` says which rules' preconditions hold."""

    def __init__(self, enabled: set[str]) -> None:
        self.enabled = enabled
        self.asked: collections.Counter[str] = collections.Counter()

    def _enabled(self, op: Any) -> bool:
        self.asked[op] += 1
        return op in self.enabled


def test_the_rule_choice_follows_the_weights_over_the_enabled_rules_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rejection sampling: the chosen rule is always enabled, in proportion to the weights among the enabled ones,
    and a step usually asks one precondition, not all of them; with nothing enabled the example ends (None)."""
    import kvproof.conformance.breadth as breadth

    monkeypatch.setattr(breadth, "_enabled", lambda machine, rule: machine._enabled(rule))
    config = Swarm({"a": 1.0, "b": 3.0, "c": 6.0, "d": 10.0}, 0.0)
    machine = _Rules({"a", "b", "c"})
    rng = random.Random(3)
    chosen = collections.Counter(_choose(machine, config, rng) for _ in range(20_000))  # type: ignore[arg-type]
    assert set(chosen) == {"a", "b", "c"}
    for rule, weight in (("a", 0.1), ("b", 0.3), ("c", 0.6)):
        assert abs(chosen[rule] / 20_000 - weight) < 0.02, chosen
    assert sum(machine.asked.values()) < 2.1 * 20_000  # "d" (half the weight) is asked about, then dropped
    assert _choose(_Rules(set()), config, rng) is None  # type: ignore[arg-type]


def test_a_swarm_keeps_at_least_one_rule_and_an_edge_probability() -> None:
    rules = ["alloc", "free", "misuse"]
    for seed in range(200):
        config = swarm(random.Random(seed), rules)
        assert config.weights and set(config.weights) <= set(rules)
        assert all(0.1 <= w <= 1.0 for w in config.weights.values()) and config.edge in EDGES


def test_half_the_swarms_keep_every_rule_the_others_each_rule_with_probability_three_quarters() -> None:
    """A bug whose sequence needs most of the rules is not left to the swarms that happen to keep them all: with 3/4
    a rule in every example, eight rules were all kept in 10 % of the examples; now in about 55 %."""
    assert KEEP == (1.0, 0.75)
    rules = [f"r{i}" for i in range(8)]
    sizes = collections.Counter(len(swarm(random.Random(seed), rules).weights) for seed in range(4000))
    everything = sizes[8] / 4000
    assert abs(everything - (0.5 + 0.5 * 0.75 ** 8)) < 0.03, sizes
    # the other half still leaves rules out, a quarter of them on average
    dropped = sum((8 - n) * k for n, k in sizes.items()) / 4000
    assert abs(dropped - 0.5 * 8 * 0.25) < 0.1, sizes


@pytest.mark.parametrize("component", [pytest.param(c.value, marks=[pytest.mark.xdist_group("ranks")] * (
    c is Component.TP_PREFETCH)) for c in SUITES])
def test_every_suite_runs_under_the_breadth_driver(component: str, no_rank_left: None) -> None:
    """The component's default implementation on its first config: a few swarm examples pass, every step checked
    (steps counted by the per-step comparison), the same seed gives the same fingerprint and another seed another."""
    test = plan((component,), load_impls(()), (), None, {}).tests[0]

    def run(seed: int) -> Any:  # isolated: tp_prefetch's rank processes end with the run's child
        return run_check(test.component, test.impl.factory, test.config, settings=_small(4, 12), seed=seed,
                         engine="breadth", failures_dir=None, **test.options)

    first, again, other = run(5), run(5), run(6)
    assert first.passed, first.failure
    assert first.examples == 4 and first.steps > 4  # every example checks its initial state, then each step
    assert first.fingerprint == again.fingerprint and first.rules == again.rules
    assert other.fingerprint != first.fingerprint


def test_a_planted_bug_is_found_shrunk_and_replays() -> None:
    """A mutant of the SWA allocator that accepts bad frees, under the breadth driver: found, its vector shrunk to
    the misuse of ``free`` that shows it and what it needs (which misuse depends on the seed: a slot past the pool
    crashing needs nothing before it, a double free accepted the allocation it frees), which fails again when
    replayed with the same verdict; the runtime itself passes the same run."""
    config = get_suite(Component.SWA_ALLOCATOR).configs[1]
    kwargs: dict[str, Any] = dict(settings=_small(60, 30), seed=0, engine="breadth", isolation="in-process",
                                  failures_dir=None)
    report = run_check(Component.SWA_ALLOCATOR, MUTANTS["double_free_accepted"], config, **kwargs)
    assert report.failure is not None and report.evidence is not None and report.evidence["op"] == "free"
    verdict = report.failure.splitlines()[1].strip()  # the op, what it did, what the reference raised
    assert verdict.startswith("free ") and "InvalidOperation" in verdict and "[misuse: " in report.failure, verdict
    assert report.vector is not None and report.detected_steps is not None
    # shrunk from up to 30 steps: a slot past the pool needs nothing before it, a double free the allocation it frees
    steps = report.vector["steps"]
    assert steps[-1]["rule"] == "misuse" and steps[-1]["draws"][0].startswith("free:")
    assert len(steps) == (2 if steps[-1]["draws"][0] == "free:duplicate_slot" else 1), steps
    # the evidence (the kill matrix's, the known-finding label's) is the shrunk verdict's, as the text is
    assert report.evidence is not None and report.evidence["step"] == len(steps) == len(report.evidence["ops"])
    assert f"at step {len(steps)}:" in report.failure
    replayed = replay_vector(report.vector, MUTANTS["double_free_accepted"], isolation="in-process")
    assert replayed.failure is not None and verdict in replayed.failure
    assert run_check(Component.SWA_ALLOCATOR, SWATokenToKVPoolAllocator, config, **kwargs).passed


class _CrashesThenInterrupted:
    """Crashes at the 40th call of the run; after that every call (the breadth driver's shrink replaying the
    failure) is a Ctrl-C."""

    calls, crashed = 0, False

    def __init__(self, config: Any) -> None:
        from kvproof.gpu_runtime.hisparse_host import HiSparseHostPool

        self._pool = HiSparseHostPool(config)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._pool, name)
        if not callable(value) or name == "snapshot":
            return value
        cls = type(self)

        def call(*args: Any, **kwargs: Any) -> Any:
            if cls.crashed:
                raise KeyboardInterrupt
            cls.calls += 1
            if cls.calls >= 40:
                cls.crashed = True
                raise RuntimeError("boom")
            return value(*args, **kwargs)

        return call


def test_ctrl_c_while_the_breadth_driver_shrinks_reports_the_run_and_its_first_seen_failure() -> None:
    """A Ctrl-C during the vector shrink is the run's interruption (``RunInterrupted``, as one while Hypothesis
    shrinks): the run's counts and the unshrunk first-seen failure with its vector, not a bare KeyboardInterrupt
    that loses them (a campaign then reported the run as 0 examples, 0 steps)."""
    from kvproof.conformance.errors import RunInterrupted
    from kvproof.conformance.hisparse_host import HOST_CONFIGS

    caught: BaseException | None = None
    try:
        run_check("hisparse_host", _CrashesThenInterrupted, HOST_CONFIGS[0], settings=_small(20, 20), seed=0,
                  engine="breadth", failures_dir=None, isolation="in-process", impl_name="crashes")
    except BaseException as err:  # noqa: BLE001 - a bare KeyboardInterrupt must fail this test, not end pytest
        caught = err
    assert _CrashesThenInterrupted.crashed
    assert isinstance(caught, RunInterrupted), repr(caught)
    report = caught.report
    assert "RuntimeError: boom" in report.failure and "interrupted while shrinking" in report.failure
    assert report.examples >= 1 and report.steps >= 1
    assert report.vector is not None and report.vector["first_seen"] and report.vector["steps"]
