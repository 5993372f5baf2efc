"""The conformance suites as pytest tests (``pytest --pyargs kvproof.conformance.suite``).

Collected through the plugin :mod:`kvproof.conformance.pytest_plugin` (registered by the
package): one test per component x config of the run plan, id ``component/config``. A
failure shows the lockstep verdict (operation, step, trace, replay command). The suites
cite sglang_semantics.md per component.
"""

from __future__ import annotations

import pytest

from kvproof.conformance.check import failure_text
from kvproof.conformance.errors import ConformanceFailure
from kvproof.conformance.plan import PlannedTest
from kvproof.conformance.pytest_plugin import kvproof_test_run


def test_conformance(kvproof_test: PlannedTest, request: pytest.FixtureRequest) -> None:
    outcome = kvproof_test_run(request, kvproof_test)
    report = outcome.report
    if report is None:
        raise ConformanceFailure(f"{kvproof_test.impl.spec} [{kvproof_test.test_id}]: {outcome.reason}")
    if not report.passed:
        raise ConformanceFailure(failure_text(report))
    if outcome.status == "skipped":  # it passed without calling the implementation once: nothing was checked
        pytest.skip(outcome.reason)
