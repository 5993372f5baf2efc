"""The breadth driver: a suite's rules and checks without Hypothesis' per-step engine, for campaigns.

Hypothesis spends most of a lockstep step in its own engine (choosing a rule, drawing through its choice
sequence, keeping what it needs to shrink); a campaign that wants breadth (many sequences, many machines) pays it
on every step (upstream_0523_vllm_fuzz.md §4.4). This driver runs the same rule alphabet and the same per-step
checks, drawing each rule's arguments from its declared strategies with a seeded ``random.Random``
(:func:`kvproof.conformance.generation.sample`), and leaves shrinking to the failure's vector
(:mod:`kvproof.conformance.shrink`).

**Swarm testing** (Groce et al., ISSTA 2012): each example draws its own configuration first, a random subset of
the rules (every rule in half the examples, each rule with probability 3/4 in the other half; at least one) with
random weights, a probability of drawing extreme
arguments (an integer's bounds, a list's shortest or longest, a ``sampled_from``'s first or last element, the first
branch of a ``one_of``: the suites put their page, window and pool edges there), and, when not extreme, a
probability of drawing simple ones (an integer near its lower bound, a ``sampled_from``'s first element: where
Hypothesis' draws lean, and the suites order their lists for that lean).
Sequences that never free, or that only free, or that sit at the pool's edge, or that run many small requests at
once reach states a uniform mix rarely does. Which rules ran and what they drew is recorded exactly as under
Hypothesis (:mod:`kvproof.conformance.vector`), so a failure replays and shrinks the same way; the same seed gives
the same examples.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvproof.conformance.generation import sample
from kvproof.conformance.lockstep import Lockstep

__all__ = ["BreadthData", "Swarm", "drive", "swarm"]

#: Probabilities of an extreme argument an example may get (0: uniform draws only).
EDGES = (0.0, 0.1, 0.3, 0.6)
#: Probabilities of a simple argument an example may get (0: none). Measured on every default config of the six
#: components but tp_prefetch, 5 seeds of 60 examples of up to 50 steps each: the dimensions a run left below their
#: maximum went from 89 (no simple draws) to 58 (decode_prealloc 23 -> 8, admission 58 -> 41), misuse cases among
#: them from 9 to 12 (short prompts chunk less often); with an extreme decided before a simple value for every kind
#: of argument (2026-11-28), still 58, misuse cases 3.
SIMPLE = (0.0, 0.3, 0.6, 0.9)
#: Probabilities that an example keeps each rule, one drawn per example. Every rule in half the examples: a bug that
#: needs most of a suite's rules in one sequence is otherwise left to the few swarms that happen to keep them all
#: (the shrunk failure of ``admission``'s ``host_hit_not_page_rounded`` runs five of its nine rules; 3/4 each keeps
#: all five in 24 % of the examples). Measured 2026-11-28 on the ``ci`` budget randomized, the breadth mode alone
#: (``bench_bugs.detect``), against 3/4 in every example: ``admission``'s 15 bugs found by 75 of 75 seeds against 67
#: (5 seeds each); the 35 bugs of ``swa_allocator`` and ``loc_cache`` by 105 of 105 both ways (3 seeds), and those of
#: ``decode_prealloc``, ``hisparse_host`` and ``block_pool`` by every seed as before. Its price: fewer examples leave
#: out the rules that finish requests, so ``admission``'s "swa pool exhausted" was reached by one of three ``ci``
#: coverage runs where it was by all three (every other dimension of every component as before, or one short).
KEEP = (1.0, 0.75)


@dataclass(frozen=True)
class Swarm:
    """One example's configuration: the rules it may run (``misuse`` among them) with their weights, and how often
    an argument is drawn at an extreme, and how often a simple one."""

    weights: dict[str, float]
    edge: float
    simple: float = 0.0
    #: the rules, and their weights accumulated (what ``random.choices`` would accumulate at every draw)
    rules: tuple[str, ...] = field(init=False)
    cumulative: tuple[float, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rules", tuple(self.weights))
        object.__setattr__(self, "cumulative", tuple(itertools.accumulate(self.weights.values())))


def swarm(rng: random.Random, rules: Sequence[str]) -> Swarm:
    """A random swarm configuration over ``rules``."""
    keep = rng.choice(KEEP)
    kept = [r for r in rules if rng.random() < keep] or [rng.choice(list(rules))]
    return Swarm({r: rng.uniform(0.1, 1.0) for r in kept}, rng.choice(EDGES), rng.choice(SIMPLE))


class BreadthData:
    """A rule's ``data`` object under the breadth driver: each draw sampled from its strategy with the example's
    generator (the lockstep framework records the values, as it does Hypothesis')."""

    def __init__(self, rng: random.Random, edge: float, simple: float = 0.0) -> None:
        self.rng, self.edge, self.simple = rng, edge, simple

    def draw(self, strategy: Any, label: str | None = None) -> Any:
        return sample(strategy, self.rng, self.edge, self.simple)


def _rules(machine: Lockstep[Any, Any]) -> list[str]:
    names = sorted(type(machine).operations)
    return names + (["misuse"] if type(machine).misuse_cases else [])


def _enabled(machine: Lockstep[Any, Any], rule: str) -> bool:
    if rule == "misuse":
        return machine.misuse_enabled()
    return machine._enabled(type(machine).operations[rule])


def _step(machine: Lockstep[Any, Any], rule: str, rng: random.Random, config: Swarm) -> None:
    """Run ``rule`` with arguments sampled from its declared strategies, as the example's swarm leans them."""
    data = BreadthData(rng, config.edge, config.simple)
    if rule == "misuse":
        machine.misuse(data=data)
        return
    op = type(machine).operations[rule]
    kwargs = {name: data if name == "data" else data.draw(strategy) for name, strategy in op.strategies}
    getattr(machine, type(machine).rule_methods[rule])(**kwargs)


def _choose(machine: Lockstep[Any, Any], config: Swarm, rng: random.Random) -> str | None:
    """A rule of the swarm drawn by weight among those enabled now (``None``: none is), by rejection: draw by weight
    over the rules not yet rejected this step, keep the first whose precondition holds. The same distribution as a
    weighted draw over the enabled rules, at the price of usually one precondition instead of all of them. The first
    draw takes the swarm's accumulated weights (``random.choices`` draws the same rule from them as from the
    weights, without accumulating them again)."""
    i = rng.choices(range(len(config.rules)), cum_weights=config.cumulative)[0]
    if _enabled(machine, config.rules[i]):
        return config.rules[i]
    rules, weights = list(config.rules), list(config.weights.values())
    while True:
        del rules[i], weights[i]
        if not rules:
            return None
        i = rng.choices(range(len(rules)), weights=weights)[0]
        if _enabled(machine, rules[i]):
            return rules[i]


def drive(machine: Callable[[], Lockstep[Any, Any]], *, seed: int, examples: int, steps: int,
          stop: Callable[[], bool] = lambda: False) -> None:
    """``examples`` examples of up to ``steps`` rules each (fewer when no rule of the example's swarm is enabled),
    every per-step check after every rule; what a rule or a check raises (a verdict) propagates. ``stop`` ends the
    run between examples."""
    for i in range(examples):
        if stop():
            return
        rng = random.Random(f"kvproof-breadth:{seed}:{i}")
        m = machine()
        try:
            config = swarm(rng, _rules(m))
            m.run_checks()
            for _ in range(steps):
                rule = _choose(m, config, rng)
                if rule is None:
                    break
                _step(m, rule, rng, config)
                m.run_checks()
        finally:
            m.teardown()
