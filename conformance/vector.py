"""Replayable vectors: a lockstep run as a JSON list of operations, replayed without Hypothesis.

Every rule declared with ``operation`` / ``scenario`` / ``misuse``
(:mod:`kvproof.conformance.lockstep`) is logged when it runs, as ``{"rule": name,
"args": {...}, "draws": [...]}``: the rule's plain arguments and every value it drew from
its ``data`` object, in order. Rules draw plain values with ``data.draw(strategy)``
(recorded as they are), pick among objects with ``data.choose(options)`` /
``data.choose_many(options)`` (recorded as indices). Nothing here reads Hypothesis internals.

A failing run's vector is saved with its report; :func:`replay` rebuilds the component's
machine for any implementation and runs the same steps, handing out the recorded values
(:class:`ReplayData`), checking each rule's declared precondition and the per-step
comparison exactly as the run did. Nothing found by a fuzzing run is lost: the vector
replays on a machine without Hypothesis' database.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from hypothesis import strategies as st

from kvproof.conformance.errors import HarnessBug, VectorError
from kvproof.conformance.generation import draw

__all__ = ["VECTOR_FORMAT", "RecordingData", "ReplayData", "ReplayResult", "VectorError", "begin_step", "load_vector",
           "replay"]

VECTOR_FORMAT = "kvproof-vector/1"
T = TypeVar("T")


def _jsonable(value: Any) -> Any:
    """``value`` as JSON, or :class:`HarnessBug` (a rule drew an object: it must use ``choose``)."""
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if hasattr(value, "value") and isinstance(value.value, str | int):  # enums
        return value.value
    raise HarnessBug(f"a rule drew a value that cannot be recorded, {type(value).__name__}: {value!r} "
                     "(draw plain values, pick objects with data.choose)")


class RecordingData:
    """Wraps Hypothesis' ``data`` object and logs every value drawn through it."""

    def __init__(self, data: Any, log: list[Any]) -> None:
        self._data, self._log = data, log

    def draw(self, strategy: st.SearchStrategy[T], label: str | None = None) -> T:
        value = draw(self._data, strategy)
        self._log.append(_jsonable(value))
        return value

    def choose(self, options: Sequence[T], label: str | None = None) -> T:
        """One of ``options`` (Hypothesis' ``sampled_from``), recorded as its index."""
        index = draw(self._data, _indices(len(options)))
        self._log.append({"pick": index})
        return options[index]

    def choose_many(self, options: Sequence[T], label: str | None = None, *, min_size: int = 0) -> list[T]:
        """Distinct elements of ``options`` in drawn order, recorded as indices."""
        picks = draw(self._data, st.lists(_indices(len(options)), min_size=min_size, unique=True))
        self._log.append({"picks": picks})
        return [options[i] for i in picks]


@functools.lru_cache(maxsize=128)
def _indices(n: int) -> st.SearchStrategy[int]:
    """``sampled_from(range(n))``, built once per ``n``."""
    return st.sampled_from(range(n))


class ReplayData:
    """Hands out recorded values in order instead of drawing."""

    def __init__(self, values: list[Any], where: str) -> None:
        self._values, self._at, self._where = list(values), 0, where

    @property
    def values(self) -> list[Any]:
        return list(self._values)

    def _next(self, label: str | None) -> Any:
        if self._at >= len(self._values):
            raise VectorError(f"{self._where}: the rule draws more values than recorded ({label or 'unlabelled'})")
        value = self._values[self._at]
        self._at += 1
        return value

    def draw(self, strategy: Any, label: str | None = None) -> Any:
        value = self._next(label)
        if isinstance(value, dict) and ("pick" in value or "picks" in value):
            raise VectorError(f"{self._where}: {label or 'a draw'} was recorded as a pick, the rule now draws a value")
        return value

    def choose(self, options: Sequence[T], label: str | None = None) -> T:
        value = self._next(label)
        if not isinstance(value, dict) or not isinstance(value.get("pick"), int):
            raise VectorError(f"{self._where}: {label or 'a draw'} was not recorded as a pick: {value!r}")
        if not 0 <= value["pick"] < len(options):
            raise VectorError(f"{self._where}: cannot pick element {value['pick']} of {len(options)} for "
                              f"{label or 'a draw'} here")
        return options[value["pick"]]

    def choose_many(self, options: Sequence[T], label: str | None = None, *, min_size: int = 0) -> list[T]:
        value = self._next(label)
        picks = value.get("picks") if isinstance(value, dict) else None
        if not isinstance(picks, list) or not all(isinstance(i, int) and 0 <= i < len(options) for i in picks):
            raise VectorError(f"{self._where}: cannot pick {value!r} of {len(options)} for {label or 'a draw'} here")
        return [options[i] for i in picks]


def begin_step(machine: Any, rule: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Log one rule execution into ``machine.vector``; wrap its ``data`` so every draw is logged too."""
    args = {k: _jsonable(v) for k, v in kwargs.items() if k != "data"}
    step: dict[str, Any] = {"rule": rule, "args": args, "draws": []}
    machine.vector.append(step)
    data = kwargs.get("data")
    if isinstance(data, ReplayData):
        step["draws"] = data.values
    elif data is not None and not isinstance(data, RecordingData):
        kwargs = {**kwargs, "data": RecordingData(data, step["draws"])}
    return kwargs


@dataclass(frozen=True)
class ReplayResult:
    """What a replay found: ``failure`` is ``None`` when every step and per-step check passed."""

    component: str
    config: str
    steps: int
    failure: str | None
    evidence: dict[str, Any] | None = None  # the verdict's evidence (LockstepFailure.evidence), as JSON

    @property
    def passed(self) -> bool:
        return self.failure is None


def load_vector(path_or_text: str | Path) -> dict[str, Any]:
    """A vector from a file (``.json``: the vector itself, or a report whose failures carry vectors) or JSON text."""
    try:
        is_file = Path(str(path_or_text)).exists()
    except OSError:  # JSON text too long to be a path
        is_file = False
    text = Path(path_or_text).read_text() if is_file else str(path_or_text)
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as err:
        raise VectorError(f"not JSON: {err}") from err
    if isinstance(doc, dict) and doc.get("format") != VECTOR_FORMAT and isinstance(doc.get("results"), list):
        vectors = [r["vector"] for r in doc["results"] if r.get("vector")]
        if len(vectors) != 1:
            raise VectorError(f"the report holds {len(vectors)} failure vectors; extract the one to replay")
        doc = vectors[0]
    if not isinstance(doc, dict) or doc.get("format") != VECTOR_FORMAT:
        raise VectorError(f"not a {VECTOR_FORMAT} vector")
    for key in ("component", "config", "steps"):
        if key not in doc:
            raise VectorError(f"vector lacks {key!r}")
    return doc


def replay(vector: dict[str, Any], machine: Any) -> ReplayResult:
    """Run ``vector``'s steps on ``machine`` (a fresh :class:`~kvproof.conformance.lockstep.Lockstep`)."""
    label, component = str(vector["config"].get("label", "?")), str(vector["component"])
    done = 0
    try:
        machine.run_checks()
        for i, step in enumerate(vector["steps"], 1):
            name = str(step.get("rule"))
            where = f"step {i} ({name})"
            if name == "misuse":
                if not machine.misuse_enabled():
                    raise VectorError(f"step {i}: rule misuse is not applicable here (precondition false)")
                method = machine.misuse
            else:
                op = type(machine).operations.get(name)
                if op is None:
                    raise VectorError(f"step {i}: {component} has no rule {name!r}")
                if not machine._enabled(op):
                    raise VectorError(f"step {i}: rule {name} is not applicable here (precondition false; the "
                                      "implementation declares other capabilities?)")
                method = getattr(machine, type(machine).rule_methods[name])
            kwargs = dict(step.get("args", {}))
            if step.get("draws") or name == "misuse" or "data" in _parameters(method):
                kwargs["data"] = ReplayData(step.get("draws", []), where)
            method(**kwargs)
            done = i
            machine.run_checks()
        machine.teardown()
    except VectorError:
        raise
    except Exception as err:  # noqa: BLE001 - the verdict is data here
        evidence: Any = getattr(err, "evidence", None)
        return ReplayResult(component, label, done, f"{type(err).__name__}: {err}",
                            None if evidence is None else evidence.to_json())
    return ReplayResult(component, label, done, None)


def _parameters(method: Any) -> tuple[str, ...]:
    import inspect

    return tuple(inspect.signature(method).parameters)

