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
  implementation's name and version, the seed (``seed``: an int, or null with
  ``derandomized: true``) and, for each failure, its diagnosis and replayable vector
  (:mod:`kvproof.conformance.vector`). Both are rewritten atomically after every test
  (``status: running``) and finalised at the end (``complete``), on Ctrl-C
  (``interrupted``, naming the interrupted test) and when the run itself crashes
  (``aborted``). Every character XML forbids (ANSI escapes, NUL) is escaped in JUnit XML.

The lockstep suites themselves cite sglang_semantics.md per component.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import importlib.metadata
import json
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hypothesis

from kvproof.conformance.errors import UsageError

if TYPE_CHECKING:
    from kvproof.conformance.check import CheckReport

__all__ = ["REPORT_FORMAT", "RUN_STATES", "Case", "Entry", "JUnitSuite", "Outcome", "RunInfo", "Selection",
           "conform_json", "conform_junit", "diagnosis", "header", "impl_version", "junit_tree", "load_selection",
           "suite_version", "write_document", "write_json", "write_junit", "write_junit_suites", "xml_safe"]

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
    status: str  # passed | failed | skipped | xfailed | xpassed | interrupted
    reason: str = ""
    report: CheckReport | None = None  # kvproof.conformance.check.CheckReport

    @property
    def ok(self) -> bool:
        return self.status in ("passed", "skipped", "xfailed")


#: a run's states in its reports: ``running`` while tests remain (the report is rewritten after each),
#: ``complete`` at a normal end, ``interrupted`` (Ctrl-C) or ``aborted`` (the run itself crashed)
RUN_STATES = ("running", "complete", "interrupted", "aborted")


@dataclass(frozen=True)
class RunInfo:
    """What every report states about the run.

    ``seed`` is the run's seed (an int) or ``None`` when the profile is ``derandomized``
    (each test's seed derives from its name); ``status`` is one of :data:`RUN_STATES`,
    ``running`` names the test under way, ``pending`` those not started yet.
    """

    impl: str
    impl_version: str
    seed: int | None
    profile: str
    warnings: tuple[str, ...] = ()
    derandomized: bool = False
    status: str = "complete"
    running: str | None = None
    pending: tuple[str, ...] = ()

    def seed_text(self) -> str:
        return "derandomized (derived from each test's name)" if self.seed is None else str(self.seed)


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


def diagnosis(failure: str | None) -> str:
    """The line that says what diverged (the one after the lockstep header), or the first line."""
    lines = [line.strip() for line in (failure or "").splitlines() if line.strip()]
    if not lines:
        return ""
    return lines[1] if len(lines) > 1 and lines[0].startswith("LockstepFailure") else lines[0]


_XML_ILLEGAL = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def xml_safe(text: str) -> str:
    """``text`` with every character XML 1.0 forbids (ANSI escapes, NUL, other controls) written as ``\\xNN``."""
    return _XML_ILLEGAL.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 256
                            else f"\\u{ord(m.group()):04x}", text)


def _result(o: Outcome) -> dict[str, Any]:
    r = o.report
    out: dict[str, Any] = {"component": o.component, "config": o.config, "status": o.status, "reason": o.reason}
    if r is not None:
        out.update({"examples": r.examples, "steps": r.steps, "seconds": round(r.seconds, 3), "rules": r.rules,
                    "calls": r.calls, "fingerprint": r.fingerprint, "capabilities": sorted(r.capabilities),
                    "outcomes": r.outcomes, "not_applicable": list(r.not_applicable),
                    "never_run": list(r.never_run), "failure": r.failure, "diagnosis": diagnosis(r.failure) or None,
                    "failure_file": r.failure_file, "vector": r.vector, "structure": r.structure,
                    "structure_targets": r.structure_targets,
                    "structure_missed": {k: list(v) for k, v in r.structure_missed().items()},
                    "finding": r.finding or None, "evidence": r.evidence, "accepted": r.accepted,
                    "harm": r.harm})
    return out


def _summary(outcomes: list[Outcome]) -> dict[str, int]:
    counts = {s: 0 for s in ("passed", "failed", "skipped", "xfailed", "xpassed", "interrupted")}
    for o in outcomes:
        counts[o.status] += 1
    counts["not_applicable_rules"] = sum(len(o.report.not_applicable) for o in outcomes if o.report)
    return counts


def header(info: RunInfo | None = None) -> dict[str, Any]:
    """The fields every kvproof JSON report starts with (the run's state and, for a conformance run, its seed)."""
    doc: dict[str, Any] = {"created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
                           "suite": {"name": "kvproof", "version": suite_version(),
                                     "hypothesis": hypothesis.__version__}}
    if info is not None:
        doc.update({"status": info.status, "complete": info.status == "complete", "running": info.running,
                    "pending": list(info.pending)})
    return doc


def conform_json(outcomes: list[Outcome], info: RunInfo) -> dict[str, Any]:
    """The JSON report of a conformance run (``kvproof-report/1``; see :func:`write_json`)."""
    return {"format": REPORT_FORMAT, **header(info),
            "implementation": {"name": info.impl, "version": info.impl_version},
            "seed": info.seed, "derandomized": info.derandomized, "profile": info.profile,
            "summary": _summary(outcomes), "warnings": list(info.warnings), "results": [_result(o) for o in outcomes]}


def write_json(path: str | Path, outcomes: list[Outcome], info: RunInfo) -> None:
    """Write the JSON report atomically (it is rewritten after every test; ``status`` says whether it is final).

    Schema: ``format``, ``created``, ``suite``, ``status`` (:data:`RUN_STATES`), ``complete`` (bool),
    ``running`` (test id or null), ``pending`` (test ids), ``implementation``, ``seed`` (int, or null
    when ``derandomized`` is true), ``derandomized`` (bool), ``profile``, ``summary``, ``warnings``,
    ``results`` (one per test run so far; ``diagnosis`` is the line that says what diverged).
    """
    write_document(path, conform_json(outcomes, info))


def write_document(path: str | Path, doc: dict[str, Any]) -> None:
    from kvproof.conformance.saved import write_atomic

    write_atomic(path, json.dumps(doc, indent=1))


@dataclass(frozen=True)
class Case:
    """One JUnit test case: ``status`` is passed, failed, skipped or error; ``message`` one line, ``text`` all."""

    classname: str
    name: str
    seconds: float
    status: str
    message: str = ""
    text: str = ""


@dataclass(frozen=True)
class JUnitSuite:
    name: str
    cases: list[Case]
    properties: list[tuple[str, str]] = field(default_factory=list)
    system_err: str = ""


def junit_tree(suites: list[JUnitSuite]) -> ET.Element:
    """``<testsuites>``; every attribute and text made XML-safe (:func:`xml_safe`)."""
    root = ET.Element("testsuites")
    for s in suites:
        count = {k: sum(c.status == k for c in s.cases) for k in ("failed", "skipped", "error")}
        suite = ET.SubElement(root, "testsuite", name=xml_safe(s.name), tests=str(len(s.cases)),
                              failures=str(count["failed"]), skipped=str(count["skipped"]), errors=str(count["error"]),
                              time=f"{sum(c.seconds for c in s.cases):.3f}")
        props = ET.SubElement(suite, "properties")
        for name, value in s.properties:
            ET.SubElement(props, "property", name=xml_safe(name), value=xml_safe(value))
        for c in s.cases:
            case = ET.SubElement(suite, "testcase", classname=xml_safe(c.classname), name=xml_safe(c.name),
                                 time=f"{c.seconds:.3f}")
            if c.status in ("failed", "skipped", "error"):
                tag = {"failed": "failure", "skipped": "skipped", "error": "error"}[c.status]
                element = ET.SubElement(case, tag, message=xml_safe(c.message))
                if c.text:
                    element.text = xml_safe(c.text)
        if s.system_err:
            ET.SubElement(suite, "system-err").text = xml_safe(s.system_err)
    return root


def write_junit_suites(path: str | Path, suites: list[JUnitSuite]) -> None:
    """Write JUnit XML atomically (rewritten after every test)."""
    from kvproof.conformance.saved import write_atomic

    body = ET.tostring(junit_tree(suites), encoding="unicode")
    write_atomic(path, f"<?xml version='1.0' encoding='utf-8'?>\n{body}\n")


def conform_junit(outcomes: list[Outcome], info: RunInfo) -> JUnitSuite:
    """The conformance run as one JUnit suite: a failure's ``message`` is its diagnosis, the text all of it."""
    cases = []
    for o in outcomes:
        r, seconds = o.report, o.report.seconds if o.report else 0.0
        classname = f"kvproof.{o.component}"
        if o.status == "skipped":
            cases.append(Case(classname, o.config, seconds, "skipped", o.reason))
        elif o.status == "xfailed":
            cases.append(Case(classname, o.config, seconds, "skipped", f"expected failure: {o.reason}"))
        elif o.status == "xpassed":
            text = f"passed, but listed as an expected failure ({o.reason}): remove the entry"
            cases.append(Case(classname, o.config, seconds, "failed", text, text))
        elif o.status == "interrupted":
            found = f"; found before the interrupt: {diagnosis(r.failure)}" if r and r.failure else ""
            cases.append(Case(classname, o.config, seconds, "error", f"interrupted{found}",
                              (r.failure or "") if r else ""))
        elif o.status == "failed":
            text = (r.failure or "") if r else ""
            vector = json.dumps(r.vector) if r and r.vector else ""
            cases.append(Case(classname, o.config, seconds, "failed", diagnosis(text),
                              text + (f"\n\nreplayable vector:\n{vector}" if vector else "")))
        else:
            cases.append(Case(classname, o.config, seconds, "passed"))
    props = [("kvproof.version", suite_version()), ("hypothesis.version", hypothesis.__version__),
             ("implementation", info.impl), ("implementation.version", info.impl_version),
             ("derandomized", str(info.derandomized).lower()), ("profile", info.profile), ("status", info.status)]
    if info.seed is not None:
        props.append(("seed", str(info.seed)))
    return JUnitSuite("kvproof.conformance", cases, props, "\n".join(info.warnings))


def write_junit(path: str | Path, outcomes: list[Outcome], info: RunInfo) -> None:
    """Write the conformance run's JUnit XML (atomically; ``status`` property: running / complete / ...)."""
    write_junit_suites(path, [conform_junit(outcomes, info)])
