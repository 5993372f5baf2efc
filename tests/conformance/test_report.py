"""Conformance as a product: --impl / $KVPROOF_IMPL, skip and xfail files, seeds, JSON and JUnit XML reports."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest
from click.testing import CliRunner

from kvproof.cli import main
from kvproof.conformance.plan import plan, run_plan
from kvproof.conformance.report import load_selection

MUTANT = "kvproof.conformance.mutants.hisparse_host:ReleaseReversed"
ARGS = ["conform", "--component", "hisparse_host", "--profile", "dev"]


def test_reports_skip_xfail_and_warnings(tmp_path) -> None:
    (tmp_path / "skip").write_text("hisparse_host/P1-*  # slow here\nhisparse_host/P9-*  # a typo\n")
    (tmp_path / "xfail").write_text("hisparse_host/P4-H8-R4-C14  # known bug\n")
    result = CliRunner().invoke(main, [*ARGS, "--impl", MUTANT, "--skip-file", str(tmp_path / "skip"),
                                       "--xfail-file", str(tmp_path / "xfail"), "--json-report",
                                       str(tmp_path / "r.json"), "--junit-xml", str(tmp_path / "r.xml")])
    assert result.exit_code == 1  # the other configs fail
    assert "entry 'hisparse_host/P9-*' matches no test" in result.output
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["format"] == "kvproof-report/1" and doc["suite"]["name"] == "kvproof"
    assert doc["implementation"]["name"] == MUTANT and doc["implementation"]["version"].startswith("kvproof ")
    assert doc["seed"] is None and doc["derandomized"] is True  # one type per field (observation 5)
    assert doc["status"] == "complete" and doc["complete"] is True and doc["pending"] == []
    status = {r["config"]: r["status"] for r in doc["results"]}
    assert status["P1-H20-R3-C9"] == "skipped" and status["P4-H8-R4-C14"] == "xfailed"
    failed = [r for r in doc["results"] if r["status"] == "failed"]
    assert failed and all(r["vector"]["format"] == "kvproof-vector/1" and r["vector"]["steps"] for r in failed)
    assert doc["summary"]["skipped"] == 1 and doc["summary"]["failed"] == len(failed)
    suite = ET.parse(tmp_path / "r.xml").getroot().find("testsuite")
    assert suite is not None and suite.get("failures") == str(len(failed))
    assert suite.get("skipped") == "2" == str(len(suite.findall("testcase/skipped")))  # the skip and the xfail
    props = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert props["implementation"] == MUTANT and props["kvproof.version"]
    assert props["derandomized"] == "true" and "seed" not in props and props["status"] == "complete"
    case = next(c for c in suite.iter("testcase") if c.find("failure") is not None)
    assert "replayable vector" in (case.find("failure").text or "")


def test_an_expected_failure_that_passes_fails_the_run(tmp_path) -> None:
    (tmp_path / "xfail").write_text("hisparse_host/P4-H8-R4-C14  # was broken once\n")
    result = CliRunner().invoke(main, [*ARGS, "--config", "P4-H8-R4-C14", "--xfail-file", str(tmp_path / "xfail")])
    assert result.exit_code == 1 and "xpassed" in result.output


def test_impl_from_environment(tmp_path) -> None:
    result = CliRunner().invoke(main, [*ARGS, "--config", "P4-H8-R4-C14"], env={"KVPROOF_IMPL": MUTANT})
    assert result.exit_code == 1 and f"implementation {MUTANT}" in result.output


def test_a_forced_seed_is_reported_and_reproduces() -> None:
    runs = [run_plan(plan(["hisparse_host"], labels=["P4-H8-R4-C14"]), profile="smoke", seed=1234)
            for _ in range(2)]
    assert all(info.seed == 1234 for _, info in runs)
    (a,), (b,) = (outcomes for outcomes, _ in runs)
    assert a.report and b.report and a.report.steps == b.report.steps and a.report.rules == b.report.rules
    assert a.report.fingerprint == b.report.fingerprint


def test_malformed_selection_file_is_an_error(tmp_path) -> None:
    (tmp_path / "bad").write_text("P4-H8-R4-C14\n")
    with pytest.raises(ValueError, match="component/config"):
        load_selection(tmp_path / "bad")
