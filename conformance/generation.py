"""What makes a lockstep run reproducible: its seed, and nothing else.

The two places kvproof reaches into Hypothesis internals live here, each guarded by a
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

Derandomized profiles (``ci``, ``dev``) derive each test's seed from the test's identity:
``kvproof.conformance.check`` names the machine factory ``kvproof:<component>/<config>``,
and Hypothesis digests that name.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import hypothesis
import hypothesis.core

from kvproof.conformance.errors import HarnessBug, UsageError

__all__ = ["forced_seed", "stable_generation"]

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
