"""Every registered obligation gets the verdict it expects (kvproof.spec, sglang_semantics.md §7, §9).

Sound obligations must be proved, broken twins must be refuted with a rendered,
concrete counterexample; ``unknown`` (timeout, incompleteness) always fails.
"""

from __future__ import annotations

import re

import pytest

from kvproof.spec import OBLIGATIONS, TEST_BUDGET, Obligation, run


@pytest.mark.parametrize("obligation", OBLIGATIONS, ids=[ob.name for ob in OBLIGATIONS])
def test_obligation_has_expected_verdict(obligation: Obligation) -> None:
    result = run(obligation, **TEST_BUDGET)  # a budget of solver work, the same on every machine
    assert result.status != "unknown", f"{obligation.name}: {result.detail}"
    assert result.status == obligation.expect, (
        f"{obligation.name}: expected {obligation.expect}, got {result.status}\n{result.detail}"
    )
    assert result.ok
    if result.status == "counterexample":
        assert result.detail.strip(), f"{obligation.name}: empty counterexample"
        assert re.search(r"\d", result.detail), f"{obligation.name}: counterexample without numbers: {result.detail}"
        assert "div0" not in result.detail and "mod0" not in result.detail
