"""``kvproof.conformance.shrink`` on synthetic replays: what a breadth-mode failure is made small by (and a default-mode
one, with ``--shrink vector``)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import Phase

from kvproof.conformance.shrink import shrink

FAILURE = "LockstepFailure: toy diverged from the reference [toy] at step {n}:\n  boom: it broke\n"


def _replay(vector: dict[str, Any]) -> tuple[int, str | None]:
    """Fails at its ``boom`` step when every ``a`` step before it has ``n`` at most the number of ``a`` steps."""
    steps = vector["steps"]
    a = [s["args"]["n"] for s in steps if s["rule"] == "a"]
    for i, step in enumerate(steps):
        if step["rule"] == "boom":
            return (i, FAILURE.format(n=i + 1)) if all(n <= len(a) for n in a) else (0, None)
    return 0, None


def _vector(*steps: dict[str, Any]) -> dict[str, Any]:
    return {"format": "toy", "steps": list(steps)}


def test_a_step_that_only_a_simpler_value_lets_go_is_dropped() -> None:
    """Neither ``a`` step can go while the other asks for two of them; once their values are simpler, both can:
    the shrinker goes back to dropping steps after it simplified values, until neither changes the vector."""
    start = _vector({"rule": "a", "args": {"n": 2}}, {"rule": "a", "args": {"n": 2}}, {"rule": "boom", "args": {}},
                    {"rule": "a", "args": {"n": 1}})
    shrunk = shrink(start, _replay)
    assert shrunk is not None
    assert shrunk.vector["steps"] == [{"rule": "boom", "args": {}}], shrunk.vector["steps"]
    assert "boom: it broke" in shrunk.failure


def test_a_vector_that_does_not_fail_is_not_shrunk() -> None:
    assert shrink(_vector({"rule": "a", "args": {"n": 3}}, {"rule": "boom", "args": {}}), _replay) is None


def test_another_failure_is_not_taken_for_this_one() -> None:
    """A candidate that fails another way (another verdict line) is dropped: the shrunk vector fails the same way."""
    def replay(vector: dict[str, Any]) -> tuple[int, str | None]:
        rules = [s["rule"] for s in vector["steps"]]
        if "boom" not in rules:
            return 0, None
        if "guard" not in rules:
            return rules.index("boom"), "LockstepFailure: toy diverged [toy] at step 1:\n  other: it broke elsewhere\n"
        return rules.index("boom"), FAILURE.format(n=rules.index("boom") + 1)

    shrunk = shrink(_vector({"rule": "guard", "args": {}}, {"rule": "x", "args": {}}, {"rule": "boom", "args": {}}),
                    replay)
    assert shrunk is not None and [s["rule"] for s in shrunk.vector["steps"]] == ["guard", "boom"]


def test_a_default_mode_failure_is_shrunk_by_its_vector_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """``shrink_with="vector"``: Hypothesis finds the failure and does not shrink it (no shrink phase); the vector
    shrinker makes it small, and the report's text, vector and evidence are the shrunk failure's. The default
    (Hypothesis' shrinker) never calls the vector shrinker."""
    from kvproof.conformance import check
    from kvproof.conformance.check import run_check
    from kvproof.conformance.configs import CONFORMANCE_CONFIGS
    from kvproof.conformance.mutants.swa_allocator import MUTANTS

    shrunk_by_vector: list[int] = []
    real = check.shrink

    def counted(vector: dict[str, Any], replay: Any, **kwargs: Any) -> Any:
        shrunk_by_vector.append(len(vector["steps"]))
        return real(vector, replay, **kwargs)

    monkeypatch.setattr(check, "shrink", counted)
    phases: list[Any] = []
    real_run = check.run_state_machine_as_test
    def recorded(machines: Any, settings: Any) -> None:
        phases.append(settings.phases)
        real_run(machines, settings=settings)

    monkeypatch.setattr(check, "run_state_machine_as_test", recorded)
    kwargs: dict[str, Any] = dict(profile="ci", failures_dir=None, isolation="in-process")
    report = run_check("swa_allocator", MUTANTS["double_free_accepted"], CONFORMANCE_CONFIGS[1], shrink_with="vector",
                       **kwargs)
    assert report.failure is not None and "free succeeded; the reference raised InvalidOperation" in report.failure
    assert shrunk_by_vector and Phase.shrink not in phases[-1]
    assert report.vector is not None and len(report.vector["steps"]) == 1 and "at step 1:" in report.failure
    assert report.evidence is not None and report.evidence["step"] == 1
    shrunk_by_vector.clear()
    default = run_check("swa_allocator", MUTANTS["double_free_accepted"], CONFORMANCE_CONFIGS[1], **kwargs)
    assert default.failure is not None and not shrunk_by_vector and Phase.shrink in phases[-1]


def test_an_unknown_shrinker_is_refused_by_name() -> None:
    from kvproof.conformance.check import run_check
    from kvproof.conformance.configs import CONFORMANCE_CONFIGS
    from kvproof.conformance.errors import UsageError
    from kvproof.gpu_runtime import SWATokenToKVPoolAllocator

    with pytest.raises(UsageError, match="--shrink 'fast': choose one of"):
        run_check("swa_allocator", SWATokenToKVPoolAllocator, CONFORMANCE_CONFIGS[0], shrink_with="fast")
