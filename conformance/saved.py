"""Failures on disk: written the moment they are first seen, rewritten when shrinking ends, replayed first later.

A failure of a run is two files under ``.kvproof/failures/``: the verdict text
(``<component>-<impl>-<config>-<stamp>.txt``) and its replayable vector (same name,
``.json``, :mod:`kvproof.conformance.vector`). :func:`kvproof.conformance.check.run_check`
writes them at the *first* verdict of the run, before Hypothesis starts shrinking (the
text then starts with :data:`FIRST_SEEN`, the vector has ``"first_seen": true``), and
replaces both with the shrunk verdict when the run ends. A run killed while shrinking
(SIGKILL, Ctrl-C, a crash) therefore leaves the unshrunk failure on disk, and it replays.
Files are written atomically (a temporary file, then ``os.replace``): a kill never leaves
half a file.

The saved vectors are kvproof's example database: ``kvproof conform`` replays the saved
vectors of a test (same component, config, implementation and options) *before*
generating (:func:`first_failing`), shrunk ones first, newest first. A saved failure that
still fails is the test's verdict at once; one that passes (the bug is fixed) changes
nothing, so the generated run is the same as on a fresh checkout (same seed, same
examples, same fingerprint). ``--fresh`` skips the replay.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from kvproof.conformance.errors import VectorError
from kvproof.conformance.vector import VECTOR_FORMAT, ReplayResult

__all__ = ["FIRST_SEEN", "FailureFile", "first_failing", "saved_vectors", "write_atomic"]

FIRST_SEEN = ("first seen; it is being shrunk (by Hypothesis, or in breadth mode by replaying its vector: "
              "kvproof.conformance.shrink); this file is replaced by the shrunk failure when the run ends; if the "
              "run was stopped, this is the unshrunk failure, and its vector replays\n\n")
#: saved vectors replayed per test at most (newest first)
MAX_REPLAYED = 20


def write_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and ``os.replace``: readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _prefix(component: str, impl_name: str, label: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", impl_name)[:60]
    return f"{component}-{safe}-{label}-"


class FailureFile:
    """The two files of one run's failure; the name is fixed at the first write, later writes replace them."""

    def __init__(self, directory: Path, component: str, impl_name: str, label: str) -> None:
        self.directory, self.prefix = Path(directory), _prefix(component, impl_name, label)
        self.path: Path | None = None

    def write(self, text: str, vector: dict[str, Any] | None) -> str | None:
        """Write (or replace) the text and the vector; the text's path, or ``None`` if the disk refused."""
        if self.path is None:
            stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%S%fZ")
            self.path = self.directory / f"{self.prefix}{stamp}.txt"
        try:
            if vector is not None:  # the vector first: a text on disk always has its vector
                write_atomic(self.path.with_suffix(".json"), json.dumps(vector, indent=1))
            write_atomic(self.path, text)
        except OSError:
            return None
        return str(self.path)


def saved_vectors(directory: Path | None, component: str, impl_name: str, config: Any, options: Mapping[str, Any],
                  shared: Iterable[dict[str, Any]] = ()) -> list[tuple[str, dict[str, Any]]]:
    """Every kept vector of this test, as ``(where it is kept, vector)``: the files under ``directory`` (shrunk ones
    first, newest first), then ``shared`` ones not among them (a campaign's example database:
    :mod:`kvproof.conformance.database`, found on any machine of a fleet). The same test is the same component,
    config (its value, not only its label), implementation and machine options."""
    def same_test(vector: Any) -> bool:
        return (isinstance(vector, dict) and vector.get("format") == VECTOR_FORMAT
                and vector.get("component") == component and vector.get("impl") == impl_name
                and vector.get("config", {}).get("value") == config.model_dump(mode="json")
                and vector.get("machine_options", {}) == dict(options))

    candidates = []
    for path in Path(directory).glob(f"{_prefix(component, impl_name, config.label())}*.json") if directory else ():
        try:
            vector = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if same_test(vector):
            candidates.append((bool(vector.get("first_seen")), -path.stat().st_mtime, str(path.with_suffix(".txt")),
                               vector))
    candidates.sort(key=lambda c: c[:2])
    known = {json.dumps(c[3], sort_keys=True) for c in candidates}
    out = [(where, vector) for _, _, where, vector in candidates]
    for vector in shared:
        text = json.dumps(vector, sort_keys=True)
        if same_test(vector) and text not in known:
            known.add(text)
            out.append(("the example database", vector))
    return out


def first_failing(directory: Path | None, component: str, impl_name: str, config: Any, options: Mapping[str, Any],
                  replay: Callable[[dict[str, Any]], ReplayResult], shared: Iterable[dict[str, Any]] = (),
                  ) -> tuple[str, dict[str, Any], ReplayResult] | None:
    """The first kept vector of this test (:func:`saved_vectors`, at most :data:`MAX_REPLAYED`) that still fails under
    ``replay``: ``(where it is kept, vector, result)``; one that no longer applies (the suite changed) is passed
    over."""
    for where, vector in saved_vectors(directory, component, impl_name, config, options, shared)[:MAX_REPLAYED]:
        try:
            result = replay(vector)
        except VectorError:
            continue
        if not result.passed:
            return where, vector, result
    return None
