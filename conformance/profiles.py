"""Hypothesis profiles for kvproof's lockstep runs: ``ci``, ``nightly``, ``dev`` and ``smoke``.

They are registered under those names and always passed explicitly, never picked
up implicitly: Hypothesis activates its own built-in ``ci`` profile whenever the
``CI`` environment variable is set, and CI runs here with ``CI=true``. kvproof's
``ci`` is derandomized (the same command finds the same failures), keeps no
example database and prints the reproduction blob; ``nightly`` is randomized,
longer, and keeps every failing example in ``.kvproof/hypothesis`` so nothing
found is lost between runs. ``dev`` is a short derandomized run; ``smoke`` a short
randomized one (its seed is chosen and reported, ``--seed`` replays it).
"""

from __future__ import annotations

from hypothesis import HealthCheck, Phase, settings
from hypothesis.database import DirectoryBasedExampleDatabase

__all__ = ["PROFILES", "get_profile", "DATABASE_DIR"]

DATABASE_DIR = ".kvproof/hypothesis"
_SLOW_OK = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]
_NO_EXPLAIN = (Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink)

PROFILES: dict[str, settings] = {
    "ci": settings(max_examples=60, stateful_step_count=30, derandomize=True, database=None,
                   deadline=None, print_blob=True, suppress_health_check=_SLOW_OK, phases=_NO_EXPLAIN),
    "nightly": settings(max_examples=2000, stateful_step_count=80, derandomize=False,
                        database=DirectoryBasedExampleDatabase(DATABASE_DIR), deadline=None,
                        print_blob=True, suppress_health_check=_SLOW_OK),
    "dev": settings(max_examples=15, stateful_step_count=20, derandomize=True, database=None,
                    deadline=None, print_blob=True, suppress_health_check=_SLOW_OK, phases=_NO_EXPLAIN),
    "smoke": settings(max_examples=15, stateful_step_count=20, derandomize=False, database=None,
                      deadline=None, print_blob=True, suppress_health_check=_SLOW_OK, phases=_NO_EXPLAIN),
}
for _name, _settings in PROFILES.items():
    settings.register_profile(_name, _settings)


def get_profile(name: str) -> settings:
    """The named profile; ``ValueError`` naming the choices for an unknown name."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown Hypothesis profile {name!r}; choose one of {sorted(PROFILES)}") from None
