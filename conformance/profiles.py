"""Hypothesis profiles for kvproof's lockstep runs: ``ci``, ``nightly``, ``dev`` and ``smoke``.

They are registered under those names and always passed explicitly, never picked
up implicitly: Hypothesis activates its own built-in ``ci`` profile whenever the
``CI`` environment variable is set, and CI runs here with ``CI=true``. kvproof's
``ci`` is derandomized (the same command finds the same failures) and keeps no
Hypothesis database; ``nightly`` is randomized and longer. Nothing a run finds is
lost between runs whatever the profile: kvproof's own example database is the
failure vectors saved under ``.kvproof/failures/`` (written when a failure is first
seen), which ``kvproof conform`` replays first in later runs of the same test
(:mod:`kvproof.conformance.saved`). Hypothesis' database cannot serve: it is off
whenever the seed is forced (``--seed``, and every randomized CLI run) or the
profile is derandomized. ``nightly`` still names ``.kvproof/hypothesis`` for
Hypothesis used directly (a test of your own under this profile, no forced seed).
``kvproof.conformance.check.run_check`` turns ``print_blob`` off: the
``@reproduce_failure`` advice names a test built inside the stateful runner, which
nobody can decorate; the seed and the replay command reproduce a failure instead.
``dev`` is a short derandomized run; ``smoke`` a short randomized one (its seed is
chosen and printed at the start, ``--seed`` replays it).

Each profile derives from Hypothesis' pristine ``default`` profile, not from whatever
profile the process had loaded when kvproof was imported, so a user's conftest or the
``CI`` variable cannot change what a kvproof profile means.
"""

from __future__ import annotations

from hypothesis import HealthCheck, Phase, settings
from hypothesis.database import DirectoryBasedExampleDatabase

from kvproof.conformance.errors import UsageError

__all__ = ["DATABASE_DIR", "PROFILES", "get_profile"]

DATABASE_DIR = ".kvproof/hypothesis"
_SLOW_OK = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]
_NO_EXPLAIN = (Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink)

_BASE = settings.get_profile("default")

PROFILES: dict[str, settings] = {
    "ci": settings(_BASE, max_examples=60, stateful_step_count=30, derandomize=True, database=None,
                   deadline=None, print_blob=True, suppress_health_check=_SLOW_OK, phases=_NO_EXPLAIN),
    "nightly": settings(_BASE, max_examples=2000, stateful_step_count=80, derandomize=False,
                        database=DirectoryBasedExampleDatabase(DATABASE_DIR), deadline=None,
                        print_blob=True, suppress_health_check=_SLOW_OK),
    "dev": settings(_BASE, max_examples=15, stateful_step_count=20, derandomize=True, database=None,
                    deadline=None, print_blob=True, suppress_health_check=_SLOW_OK, phases=_NO_EXPLAIN),
    "smoke": settings(_BASE, max_examples=15, stateful_step_count=20, derandomize=False, database=None,
                      deadline=None, print_blob=True, suppress_health_check=_SLOW_OK, phases=_NO_EXPLAIN),
}
for _name, _settings in PROFILES.items():
    settings.register_profile(_name, _settings)


def get_profile(name: str) -> settings:
    """The named profile; :class:`UsageError` naming the choices for an unknown name."""
    try:
        return PROFILES[name]
    except KeyError:
        raise UsageError(f"unknown Hypothesis profile {name!r}; choose one of {sorted(PROFILES)}") from None
