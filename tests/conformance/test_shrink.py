"""``kvproof.conformance.shrink`` on synthetic replays: what a breadth-mode failure is made small by."""

from __future__ import annotations

from typing import Any

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
