"""The conformance suites as pytest tests (collected with ``--pyargs kvproof.conformance.suite``).

Needs the plugin :mod:`kvproof.conformance.pytest_plugin` (``-p``, or installed via the
``pytest11`` entry point). One test per component x config; a failure shows the
lockstep verdict (operation, step, trace, replay command). Semantics: the suites cite
sglang_semantics.md per component.
"""

from __future__ import annotations

from typing import Any

from kvproof.conformance.check import run_check


def test_conformance(kvproof_case: tuple[str, Any], kvproof_factory: Any, kvproof_profile: str) -> None:
    component, config = kvproof_case
    report = run_check(component, kvproof_factory, config, profile=kvproof_profile,
                       impl_name=getattr(kvproof_factory, "__qualname__", "impl"))
    assert report.passed, report.failure
