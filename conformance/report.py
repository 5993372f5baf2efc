"""Conformance runs as a product: skip / expected-failure files, seeds, JSON and JUnit XML reports.

* **Selection files** (``--skip-file``, ``--xfail-file``): one entry per line,
  ``component/config  # reason``; ``*`` and ``?`` match (``swa_allocator/P1-*``). A
  skipped entry is not run and is reported as skipped with its reason (counted, never
  silent); an expected failure is run, and passing is reported (``xpassed``) and fails
  the run, so stale entries do not linger. An entry that matches no test is a warning.
* **Seed**: a run has a seed. Derandomized profiles (``ci``, ``dev``) derive it from the
  test itself; otherwise kvproof picks one (or takes ``--seed``) and forces it, so a
  reported seed reproduces the run (:mod:`kvproof.conformance.generation`).
* **Reports**: JSON (``kvproof-report/1``) and JUnit XML carry the suite version, the
  implementation's name and version, the seed and, for each failure, its replayable
  vector (:mod:`kvproof.conformance.vector`).

The lockstep suites themselves cite sglang_semantics.md per component.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import importlib.metadata
import json
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hypothesis

from kvproof.conformance.errors import UsageError

if TYPE_CHECKING:
    from kvproof.conformance.check import CheckReport

__all__ = ["REPORT_FORMAT", "Entry", "Outcome", "RunInfo", "Selection", "impl_version", "load_selection",
           "suite_version", "write_json", "write_junit"]

REPORT_FORMAT = "kvproof-report/1"


@dataclass(frozen=True)
class Entry:
    pattern: str
    reason: str
    source: str  # file:line


@dataclass
class Selection:
    """Skip and expected-failure entries; ``used`` tracks which entries matched a test."""

    skip: list[Entry] = field(default_factory=list)
    xfail: list[Entry] = field(default_factory=list)
    used: set[Entry] = field(default_factory=set)

    def match(self, test_id: str) -> tuple[str, str] | None:
        """``("skip" | "xfail", reason)`` for a test id ``component/config``, or ``None``."""
        for kind, entries in (("skip", self.skip), ("xfail", self.xfail)):
            for entry in entries:
                if fnmatchcase(test_id, entry.pattern):
                    self.used.add(entry)
                    return kind, entry.reason
        return None

    def unmatched(self) -> list[str]:
        """Warnings for entries that matched nothing (a typo, or a test that no longer exists)."""
        return [f"{e.source}: entry {e.pattern!r} matches no test" for e in self.skip + self.xfail
                if e not in self.used]


def _entries(path: str | Path) -> list[Entry]:
    entries = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        text, _, reason = line.partition("#")
        pattern = text.strip()
        if not pattern:
            continue
        if "/" not in pattern:
            raise UsageError(f"{path}:{i}: entries look like 'component/config', got {pattern!r}")
        entries.append(Entry(pattern, reason.strip() or "no reason given", f"{path}:{i}"))
    return entries


def load_selection(skip_file: str | Path | None = None, xfail_file: str | Path | None = None) -> Selection:
    return Selection(skip=_entries(skip_file) if skip_file else [], xfail=_entries(xfail_file) if xfail_file else [])


@dataclass
class Outcome:
    """One test (component x config): its status and, when it ran, the report."""

    component: str
    config: str
    status: str  # passed | failed | skipped | xfailed | xpassed
    reason: str = ""
    report: CheckReport | None = None  # kvproof.conformance.check.CheckReport

    @property
    def ok(self) -> bool:
        return self.status in ("passed", "skipped", "xfailed")


@dataclass(frozen=True)
class RunInfo:
    """What every report states about the run."""

    impl: str
    impl_version: str
    seed: int | str
    profile: str
    warnings: tuple[str, ...] = ()


def suite_version() -> str:
    try:
        return importlib.metadata.version("kvproof")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def impl_version(impl: Any, factory: Any) -> str:
    """The implementation's declared ``version``, else its top-level package's distribution version."""
    declared = getattr(impl, "version", None) or getattr(factory, "version", None)
    if isinstance(declared, str) and declared:
        return declared
    package = (getattr(factory, "__module__", "") or "").split(".")[0]
    with contextlib.suppress(importlib.metadata.PackageNotFoundError, ValueError):
        return f"{package} {importlib.metadata.version(package)}"
    return "unknown"


def _result(o: Outcome) -> dict[str, Any]:
    r = o.report
    out: dict[str, Any] = {"component": o.component, "config": o.config, "status": o.status, "reason": o.reason}
    if r is not None:
        out.update({"examples": r.examples, "steps": r.steps, "seconds": round(r.seconds, 3), "rules": r.rules,
                    "calls": r.calls, "fingerprint": r.fingerprint, "capabilities": sorted(r.capabilities),
                    "outcomes": r.outcomes, "not_applicable": list(r.not_applicable),
                    "never_run": list(r.never_run), "failure": r.failure, "failure_file": r.failure_file,
                    "vector": r.vector})
    return out


def _summary(outcomes: list[Outcome]) -> dict[str, int]:
    counts = {s: 0 for s in ("passed", "failed", "skipped", "xfailed", "xpassed")}
    for o in outcomes:
        counts[o.status] += 1
    counts["not_applicable_rules"] = sum(len(o.report.not_applicable) for o in outcomes if o.report)
    return counts


def write_json(path: str | Path, outcomes: list[Outcome], info: RunInfo) -> None:
    doc = {"format": REPORT_FORMAT, "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
           "suite": {"name": "kvproof", "version": suite_version(), "hypothesis": hypothesis.__version__},
           "implementation": {"name": info.impl, "version": info.impl_version},
           "seed": info.seed, "profile": info.profile, "summary": _summary(outcomes),
           "warnings": list(info.warnings), "results": [_result(o) for o in outcomes]}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=1))


def write_junit(path: str | Path, outcomes: list[Outcome], info: RunInfo) -> None:
    counts = _summary(outcomes)
    suites = ET.Element("testsuites")
    suite = ET.SubElement(suites, "testsuite", name="kvproof.conformance", tests=str(len(outcomes)),
                          failures=str(counts["failed"] + counts["xpassed"]), skipped=str(counts["skipped"]),
                          errors="0", time=f"{sum(o.report.seconds for o in outcomes if o.report):.3f}")
    props = ET.SubElement(suite, "properties")
    for name, value in (("kvproof.version", suite_version()), ("hypothesis.version", hypothesis.__version__),
                        ("implementation", info.impl), ("implementation.version", info.impl_version),
                        ("seed", str(info.seed)), ("profile", info.profile)):
        ET.SubElement(props, "property", name=name, value=value)
    for o in outcomes:
        case = ET.SubElement(suite, "testcase", classname=f"kvproof.{o.component}", name=o.config,
                             time=f"{o.report.seconds:.3f}" if o.report else "0")
        if o.status == "skipped":
            ET.SubElement(case, "skipped", message=o.reason)
        elif o.status == "xfailed":
            ET.SubElement(case, "skipped", message=f"expected failure: {o.reason}")
        elif o.status in ("failed", "xpassed"):
            r = o.report
            text = (r.failure or "") if r else ""
            if o.status == "xpassed":
                text = f"passed, but listed as an expected failure ({o.reason}): remove the entry"
            failure = ET.SubElement(case, "failure", message=text.strip().splitlines()[0] if text.strip() else "")
            vector = json.dumps(r.vector) if r and r.vector else ""
            failure.text = text + (f"\n\nreplayable vector:\n{vector}" if vector else "")
    if info.warnings:
        ET.SubElement(suite, "system-err").text = "\n".join(info.warnings)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    ET.ElementTree(suites).write(path, encoding="utf-8", xml_declaration=True)
