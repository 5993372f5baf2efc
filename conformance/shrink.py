"""Shrinking a failure's vector without Hypothesis: what the breadth driver finds is made small here.

A vector (:mod:`kvproof.conformance.vector`) is the rules a run executed and every value each drew. :func:`shrink`
replays candidates and keeps the smallest that still fails *the same way* (:func:`failure_kind`: the verdict's
line with its numbers blanked, up to its first colon): first the prefix up to the failing step, then delta debugging
over the steps (drop halves, quarters, ... single steps: Zeller's ddmin), then simpler values, step by step (an
integer toward 0, a boolean to ``False``, a shorter list, an earlier pick), and both again until neither changes
the vector (a simpler value often lets a step go: a smaller batch needs fewer steps before it). A candidate whose
rules no longer apply (a step's precondition is false, a draw does not fit) fails to replay and is dropped; one that
fails differently (another verdict, a harness error) is dropped too. Every replay runs every per-step check, as the
run did.
"""

from __future__ import annotations

import copy
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from kvproof.conformance.report import diagnosis

__all__ = ["Shrunk", "failure_kind", "shrink"]


def failure_kind(failure: str) -> str:
    """What a failure is, for "the same failure": its verdict line with numbers blanked, up to the first colon."""
    line = re.sub(r"\d+", "#", diagnosis(failure))
    cut = line.find(":")
    return line[:cut] if 0 < cut <= 80 else line[:60]


@dataclass(frozen=True)
class Shrunk:
    """The smallest failing vector found, its failure, and how many replays it took."""

    vector: dict[str, Any]
    failure: str
    replays: int


def shrink(vector: dict[str, Any], replay: Callable[[dict[str, Any]], tuple[int, str | None]], *,
           seconds: float = 60.0) -> Shrunk | None:
    """The smallest vector that fails like ``vector``; ``None`` if ``vector`` itself does not fail on replay.

    ``replay(v)`` runs ``v`` and returns ``(steps done before it failed, failure text or None)``; it must never
    raise (a vector that no longer applies is ``(0, None)``). Shrinking stops after ``seconds`` with the best so far.
    """
    done, failure = replay(vector)
    if failure is None:
        return None
    kind, deadline, replays = failure_kind(failure), time.monotonic() + seconds, 1
    best = _with_steps(vector, vector["steps"][:done + 1])

    def fails(candidate: dict[str, Any]) -> bool:
        nonlocal best, failure, replays
        replays += 1
        at, text = replay(candidate)
        if text is None or failure_kind(text) != kind:
            return False
        best, failure = _with_steps(candidate, candidate["steps"][:at + 1]), text
        return True

    if len(best["steps"]) < len(vector["steps"]) and not fails(best):  # the prefix itself must still fail
        best = vector
    while time.monotonic() < deadline:  # until neither pass changes it: a simpler value may let a step go
        before = best
        _drop_steps(best_of=lambda: best, fails=fails, deadline=deadline)
        changed = True
        while changed and time.monotonic() < deadline:
            changed = False
            for candidate in _simpler(best):
                if time.monotonic() >= deadline:
                    break
                if fails(candidate):
                    changed = True
                    break
        if best is before:
            break
    return Shrunk(best, failure, replays)


def _drop_steps(best_of: Callable[[], dict[str, Any]], fails: Callable[[dict[str, Any]], bool],
                deadline: float) -> None:
    """Delta debugging over the steps of the best vector so far (``best_of()``; ``fails`` keeps a smaller one)."""
    chunk = max(len(best_of()["steps"]) // 2, 1)
    while chunk >= 1 and time.monotonic() < deadline:
        i, removed = 0, False
        while i < len(best_of()["steps"]) and time.monotonic() < deadline:
            steps = best_of()["steps"]
            if len(steps) > 1 and fails(_with_steps(best_of(), steps[:i] + steps[i + chunk:])):
                removed = True  # the same i now holds the next chunk
            else:
                i += chunk
        if not removed:
            chunk //= 2


def _with_steps(vector: dict[str, Any], steps: list[dict[str, Any]]) -> dict[str, Any]:
    out = dict(vector)
    out["steps"] = [copy.deepcopy(s) for s in steps]
    return out


def _smaller(value: Any) -> Iterator[Any]:
    """Simpler values than ``value``, simplest first (of the same JSON shape)."""
    if isinstance(value, bool):
        if value:
            yield False
    elif isinstance(value, int):
        for v in (0, 1, value // 2, value - 1):
            if 0 <= v < value:
                yield v
    elif isinstance(value, list):
        for k in range(len(value)):
            yield value[:k] + value[k + 1:]
        for k, item in enumerate(value):
            for simpler in _smaller(item):
                yield value[:k] + [simpler] + value[k + 1:]
    elif isinstance(value, dict) and set(value) == {"pick"} and isinstance(value["pick"], int):
        for v in _smaller(value["pick"]):
            yield {"pick": v}
    elif isinstance(value, dict) and set(value) == {"picks"}:
        for v in _smaller(value["picks"]):
            yield {"picks": v}


def _simpler(vector: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every vector with one argument or one drawn value of one step made simpler, last steps first."""
    for i in reversed(range(len(vector["steps"]))):
        step = vector["steps"][i]
        for j, value in enumerate(step.get("draws", [])):
            for simpler in _smaller(value):
                candidate = _with_steps(vector, vector["steps"])
                candidate["steps"][i]["draws"][j] = simpler
                yield candidate
        for name, value in step.get("args", {}).items():
            for simpler in _smaller(value):
                candidate = _with_steps(vector, vector["steps"])
                candidate["steps"][i]["args"][name] = simpler
                yield candidate
