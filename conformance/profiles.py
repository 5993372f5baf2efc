"""Hypothesis profiles for kvproof's lockstep runs: ``ci``, ``nightly``, ``dev`` and ``smoke``.

They are registered under those names and always passed explicitly, never picked
up implicitly: Hypothesis activates its own built-in ``ci`` profile whenever the
``CI`` environment variable is set, and CI runs here with ``CI=true``. kvproof's
``ci`` is derandomized (the same command finds the same failures), keeps no
example database and prints the reproduction blob; ``nightly`` is randomized,
longer, and keeps every failing example in ``.kvproof/hypothesis`` so nothing
found is lost between runs. ``dev`` is a short derandomized run; ``smoke`` a short
randomized one (its seed is chosen and reported, ``--seed`` replays it).

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
