"""Replayable vectors: a lockstep run as a JSON list of operations, replayed without Hypothesis.

Every rule of every component machine is decorated with :func:`recorded` (under
``@rule``), so each step of a run is logged as ``{"rule": name, "args": {...},
"draws": [...]}``: the rule's plain arguments and every value it drew from its
``data`` object, in order. A failing run's vector is saved in the reports; :func:`replay`
rebuilds the component's machine for any implementation and runs the same steps,
drawing the recorded values (``ReplayData``), checking preconditions and invariants
exactly as the run did (sglang_semantics.md is cited by each machine). Nothing found by
a fuzzing run is lost: the vector replays on a machine without Hypothesis' database.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypothesis.stateful import INVARIANT_MARKER, RULE_MARKER

__all__ = ["recorded", "RecordingData", "ReplayData", "VectorError", "ReplayResult", "replay", "load_vector",
           "VECTOR_FORMAT"]

VECTOR_FORMAT = "kvproof-vector/1"


class VectorError(ValueError):
    """A vector that cannot be replayed here: malformed, another suite, or a step whose rule does not apply."""


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if hasattr(value, "value") and isinstance(value.value, str | int):  # enums
        return value.value
    raise VectorError(f"cannot record a drawn value of type {type(value).__name__}: {value!r}")


def _elements(strategy: Any) -> Any:
    """The element sequence of a (lazy) ``sampled_from`` strategy, or ``None``."""
    inner = getattr(strategy, "wrapped_strategy", strategy)
    return getattr(inner, "elements", None)


def _encode_pick(strategy: Any, value: Any) -> dict[str, Any]:
    """A value drawn from objects: its index in ``sampled_from`` (or indices, for ``lists(sampled_from)``)."""
    elements = _elements(strategy)
    index = next((i for i, e in enumerate(elements or ()) if e is value), None)
    if index is not None:
        return {"pick": index}
    inner = _elements(getattr(getattr(strategy, "wrapped_strategy", strategy), "element_strategy", None))
    if inner is not None and isinstance(value, list):
        picks = [next((i for i, e in enumerate(inner) if e is v), None) for v in value]
        if None not in picks:
            return {"picks": picks}
    return {"unreplayable": repr(value)[:200]}


class RecordingData:
    """Wraps Hypothesis' ``data`` object and logs every drawn value.

    JSON-able values are logged as they are; a value picked by ``sampled_from`` from
    objects (a request record, say) is logged as ``{"pick": index}``. Anything else is
    logged as unreplayable; recording never fails the rule it watches.
    """

    def __init__(self, data: Any, log: list[Any]) -> None:
        self._data, self._log = data, log

    def draw(self, strategy: Any, label: str | None = None) -> Any:
        value = self._data.draw(strategy, label=label)
        try:
            self._log.append(_jsonable(value))
        except VectorError:
            self._log.append(_encode_pick(strategy, value))
        return value


class ReplayData:
    """Hands out recorded values in order instead of drawing."""

    def __init__(self, values: list[Any], where: str) -> None:
        self._values, self._at, self._where = list(values), 0, where

    def draw(self, strategy: Any, label: str | None = None) -> Any:
        if self._at >= len(self._values):
            raise VectorError(f"{self._where}: the rule draws more values than recorded ({label or 'unlabelled'})")
        value = self._values[self._at]
        self._at += 1
        if isinstance(value, dict) and ("pick" in value or "picks" in value):
            elements = _elements(strategy) if "pick" in value else _elements(getattr(
                getattr(strategy, "wrapped_strategy", strategy), "element_strategy", None))
            wanted = [value["pick"]] if "pick" in value else value["picks"]
            if elements is None or not all(0 <= i < len(elements) for i in wanted):
                raise VectorError(f"{self._where}: cannot pick elements {wanted} for {label or 'a draw'} here")
            return elements[value["pick"]] if "pick" in value else [elements[i] for i in wanted]
        if isinstance(value, dict) and "unreplayable" in value:
            raise VectorError(f"{self._where}: {label or 'a draw'} was not recorded ({value['unreplayable']})")
        return value


def recorded(function: Callable[..., None]) -> Callable[..., None]:
    """Log each call of a rule into ``self.vector`` (put it directly under ``@rule``)."""

    @functools.wraps(function)
    def wrapper(self: Any, **kwargs: Any) -> None:
        step: dict[str, Any] = {"rule": function.__name__,
                                "args": {k: _jsonable(v) for k, v in kwargs.items() if k != "data"}, "draws": []}
        self.vector.append(step)
        if "data" in kwargs and not isinstance(kwargs["data"], ReplayData):
            kwargs["data"] = RecordingData(kwargs["data"], step["draws"])
        elif "data" in kwargs:
            step["draws"] = kwargs["data"]._values
        function(self, **kwargs)

    return wrapper


@dataclass(frozen=True)
class ReplayResult:
    """What a replay found: ``failure`` is ``None`` when every step and invariant passed."""

    component: str
    config: str
    steps: int
    failure: str | None

    @property
    def passed(self) -> bool:
        return self.failure is None


def load_vector(path_or_text: str | Path) -> dict[str, Any]:
    """A vector from a file (``.json``: the vector itself, or a report whose failures carry vectors) or JSON text."""
    text = Path(path_or_text).read_text() if Path(str(path_or_text)).exists() else str(path_or_text)
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


def _members(cls: type, marker: str) -> list[Any]:
    """Hypothesis' rule / invariant objects of a machine class, in its order (sorted by attribute name)."""
    return [getattr(f, marker) for _, f in inspect.getmembers(cls) if getattr(f, marker, None) is not None]


def replay(vector: dict[str, Any], machine_cls: type) -> ReplayResult:
    """Run ``vector``'s steps on a fresh ``machine_cls()`` (built by the suite's ``machine_for``)."""
    rules = {r.function.__name__: r for r in _members(machine_cls, RULE_MARKER)}
    invariants = _members(machine_cls, INVARIANT_MARKER)
    label, component = str(vector["config"].get("label", "?")), str(vector["component"])
    done = 0
    try:
        machine = machine_cls()
        _check(machine, invariants)
        for i, step in enumerate(vector["steps"], 1):
            rule = rules.get(step["rule"])
            if rule is None:
                raise VectorError(f"step {i}: {component} has no rule {step['rule']!r}")
            if not all(pre(machine) for pre in rule.preconditions):
                raise VectorError(f"step {i}: rule {step['rule']} is not applicable here (precondition false; "
                                  "the implementation declares other capabilities?)")
            kwargs = dict(step.get("args", {}))
            if "data" in rule.arguments:
                kwargs["data"] = ReplayData(step.get("draws", []), f"step {i} ({step['rule']})")
            rule.function(machine, **kwargs)
            done = i
            _check(machine, invariants)
        machine.teardown()
    except VectorError:
        raise
    except Exception as err:  # noqa: BLE001 - the verdict is data
        return ReplayResult(component, label, done, f"{type(err).__name__}: {err}")
    return ReplayResult(component, label, done, None)


def _check(machine: Any, invariants: list[Any]) -> None:
    for inv in invariants:
        if all(pre(machine) for pre in inv.preconditions):
            inv.function(machine)
