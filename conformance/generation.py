"""What makes a lockstep run reproducible: its seed, and nothing else.

The places kvproof reaches into Hypothesis internals live here, each guarded by a
feature check, so a Hypothesis upgrade that moves them fails loudly in one module:

* :func:`forced_seed` sets ``hypothesis.core.global_force_seed`` for randomized profiles
  (``nightly``, ``smoke``): ``run_state_machine_as_test`` takes no seed, and the public
  ``@seed`` decorator needs the test function, which the stateful runner builds
  internally. A reported seed then reproduces the run (``--seed N``).
* :func:`stable_generation` empties Hypothesis' pool of *local constants* for the run.
  Since 6.13x Hypothesis draws, with small probability, integers and strings it found in
  the source of every local (non-site-packages) module imported so far, and the pool
  grows as modules are imported. So a derandomized run's examples depended on what the
  process had imported first (``kvproof.cli`` vs the Python API vs a pytest session) and
  on whether kvproof was installed editable. With the pool pinned empty, the same
  command and seed give the same examples from every entry point
  (``tests/conformance/test_determinism.py``). kvproof's strategies bias sizes to page
  and window edges explicitly, so nothing they need is lost.

* :func:`draw` takes a rule's value from the test case's choice sequence directly
  (``DataObject.conjecture_data``), without the ``data`` object's own bookkeeping around each
  draw: it snapshots the global ``random`` state twice (to warn about strategies that use it;
  kvproof's do not) and formats a "Draw N" note for the falsifying example (kvproof records
  every value itself, in the replayable vector, and prints its own trace). That bookkeeping
  cost about 3x the draw itself: most of Hypothesis' share of a lockstep step.
* :func:`sample` draws from a strategy without the engine at all (the breadth driver).

Derandomized profiles (``ci``, ``dev``) derive each test's seed from the test's identity:
``kvproof.conformance.check`` names the machine factory ``kvproof:<component>/<config>``,
and Hypothesis digests that name.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import hypothesis
import hypothesis.core

from kvproof.conformance.errors import HarnessBug, UsageError

__all__ = ["draw", "forced_seed", "sample", "stable_generation"]

_depth = 0


@contextlib.contextmanager
def stable_generation() -> Iterator[None]:
    """Within the block, Hypothesis draws no constants harvested from loaded local modules."""
    global _depth
    try:
        from hypothesis.internal.conjecture import providers
    except ImportError:  # pragma: no cover - a Hypothesis without the provider layer has no local constants
        yield
        return
    original = getattr(providers, "_get_local_constants", None)
    if original is None or _depth:  # no local constants in this Hypothesis, or already pinned by an outer run
        _depth += 1
        try:
            yield
        finally:
            _depth -= 1
        return
    empty = type(providers._local_constants)()
    providers.CONSTANTS_CACHE.cache.clear()
    providers._get_local_constants = lambda: empty
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        providers._get_local_constants = original
        providers.CONSTANTS_CACHE.cache.clear()


@contextlib.contextmanager
def forced_seed(seed: int | None, derandomized: bool) -> Iterator[int | None]:
    """Force Hypothesis' seed for non-derandomized runs (choosing one if none is given); yield it.

    Derandomized runs yield ``None``: each test's seed derives from its name, and a given
    ``seed`` is refused (:class:`UsageError`), never silently ignored.
    """
    if derandomized:
        if seed is not None:
            raise UsageError(f"--seed {seed}: the profile is derandomized (each test's seed derives from its name, "
                             "so there is no run seed to set); use a randomized profile (nightly, smoke) to seed "
                             "a run")
        yield None
        return
    if not hasattr(hypothesis.core, "global_force_seed"):
        raise HarnessBug(f"hypothesis {hypothesis.__version__} has no global_force_seed; cannot seed the run")
    chosen = random.randrange(2**32) if seed is None else seed
    previous = hypothesis.core.global_force_seed
    hypothesis.core.global_force_seed = chosen  # type: ignore[assignment]  # declared None; the core reads an int
    try:
        yield chosen
    finally:
        hypothesis.core.global_force_seed = previous


# ---------------------------------------------------------------- drawing through the engine, cheaply


def draw(data: Any, strategy: Any) -> Any:
    """``data.draw(strategy)`` straight from the test case's choice sequence (module docstring); the same values,
    the same shrinking. Falls back to ``data.draw`` where ``data`` has no choice sequence (replay, breadth)."""
    choices = getattr(data, "conjecture_data", None)
    if choices is None or not hasattr(choices, "draw"):
        return data.draw(strategy)
    return choices.draw(strategy)


# ---------------------------------------------------------------- sampling a strategy without the engine


def sample(strategy: Any, rng: random.Random, edge: float = 0.0, simple: float = 0.0) -> Any:
    """A value of ``strategy`` drawn with ``rng`` alone, without Hypothesis' engine (the breadth driver,
    :mod:`kvproof.conformance.breadth`); ``edge`` is the probability of an extreme (an integer's bounds, a list's
    shortest or longest, a ``sampled_from``'s first or last element, the first branch of a ``one_of``: the suites put
    their page and window edges there); otherwise ``simple`` is the probability of a value near where Hypothesis'
    draws lean: an integer skewed toward its lower bound (``lo + (hi - lo + 1) * u**3``), a ``sampled_from``'s first
    element its filters keep. The suites order their lists for that lean ("Hypothesis favours the first": the common
    case first, 0 pages last), and a run of small requests is what fills a round or keeps many requests running at
    once.

    It reads the strategy objects Hypothesis builds for the constructors the suites use (``integers``,
    ``booleans``, ``sampled_from`` / ``just`` / ``none`` with ``map`` / ``filter``, ``one_of``, ``lists``
    (unique too), ``permutations``, and ``map`` / ``filter`` on any of them): the third place kvproof reads
    Hypothesis internals, by the attributes of each, checked by ``tests/conformance/test_breadth.py`` on every
    suite's rules. Any other strategy is a :class:`HarnessBug` naming it.
    """
    s = strategy
    while type(s).__name__ == "LazyStrategy":
        s = s.wrapped_strategy
    kind = type(s).__name__
    if kind == "IntegersStrategy":
        lo, hi = s.start, s.end
        if lo is None or hi is None:
            raise HarnessBug(f"breadth sampling needs bounded integers, got {strategy!r}")
        if rng.random() < edge:
            return rng.choice([v for v in (lo, hi, lo + 1, hi - 1) if lo <= v <= hi])
        if simple and rng.random() < simple:
            return lo + int((hi - lo + 1) * rng.random() ** 3)
        return rng.randint(lo, hi)
    if kind == "BooleansStrategy":
        return rng.random() < 0.5
    if kind in ("SampledFromStrategy", "JustStrategy"):
        elements = list(s.elements)
        last = len(elements) - 1
        if rng.random() < edge:  # an extreme: the first or the last element, the other if filtered out
            picks = [0, last] if rng.random() < 0.5 else [last, 0]
        elif simple and rng.random() < simple:  # the first element the filters keep
            picks = list(range(len(elements)))
        else:
            picks = []
        for i in picks:
            ok, value = _transformed(s, elements[i])
            if ok:
                return value
        for _ in range(64):  # filters reject some elements: sample again (as Hypothesis does)
            ok, value = _transformed(s, elements[rng.randrange(len(elements))])
            if ok:
                return value
        raise HarnessBug(f"breadth sampling: {strategy!r} rejected 64 draws in a row")
    if kind == "OneOfStrategy":
        branches = list(s.original_strategies)
        branch = branches[0] if rng.random() < edge else rng.choice(branches)
        return sample(branch, rng, edge, simple)
    if kind == "MappedStrategy":
        return s.pack(sample(s.mapped_strategy, rng, edge, simple))
    if kind == "FilteredStrategy":
        for _ in range(64):
            value = sample(s.filtered_strategy, rng, edge, simple)
            if all(condition(value) for condition in s.flat_conditions):
                return value
        raise HarnessBug(f"breadth sampling: {strategy!r} rejected 64 draws in a row")
    if kind in ("ListStrategy", "UniqueListStrategy", "UniqueSampledListStrategy"):
        return _sample_list(s, rng, edge, simple, unique=kind != "ListStrategy")
    if kind == "PermutationStrategy":
        values = list(s.values)
        rng.shuffle(values)
        return values
    raise HarnessBug(f"breadth sampling does not know {kind} ({strategy!r}); use the suites' constructors "
                     "(kvproof.conformance.generation.sample)")


def _transformed(s: Any, value: Any) -> tuple[bool, Any]:
    """An element of a ``sampled_from`` through its ``map`` / ``filter`` chain: ``(kept, value)``."""
    for name, f, *_ in s._transformations:
        if name == "map":
            value = f(value)
        elif not f(value):
            return False, None
    return True, value


def _sample_list(s: Any, rng: random.Random, edge: float, simple: float, *, unique: bool) -> list[Any]:
    lo = s.min_size or 0
    hi = s.max_size if s.max_size is not None and s.max_size != float("inf") else lo + 8
    n = rng.choice([lo, hi]) if rng.random() < edge else rng.randint(lo, hi)
    out: list[Any] = []
    seen: set[Any] = set()
    for _ in range(n * 8 + 8):
        if len(out) == n:
            break
        value = sample(s.element_strategy, rng, edge, simple)
        key = repr(value)
        if unique and key in seen:
            continue
        seen.add(key)
        out.append(value)
    if len(out) < lo:
        raise HarnessBug(f"breadth sampling: {s!r} could not draw {lo} distinct elements")
    return out
