"""Test-suite set-up: load kvproof's Hypothesis profile explicitly.

CI sets CI=true, which would silently activate Hypothesis' built-in ``ci`` profile;
kvproof registers its own ``ci`` / ``nightly`` / ``dev`` and loads one by name
(``KVPROOF_PROFILE``, default ``ci``).
"""

import os

from hypothesis import settings

import kvproof.conformance.profiles  # noqa: F401  (registers the profiles)

settings.load_profile(os.environ.get("KVPROOF_PROFILE", "ci"))
