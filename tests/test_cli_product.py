"""Issue 11, observations 5, 7 and 9: valid reports from every verb, bad CLI values refused, readable output.

Reports are validated by parsing them (``json``, ``xml.etree``); output is rendered piped at
``COLUMNS=100`` and searched for the full identifiers.
"""

from __future__ import annotations

import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvproof import spec
from kvproof.cli import main
from kvproof.conformance.check import run_check
from kvproof.conformance.hisparse_host import HOST_CONFIGS
from kvproof.gpu_runtime.hisparse_host import HiSparseHostPool

MUTANT = "kvproof.conformance.mutants.hisparse_host:ReleaseReversed"
HOST = ["--component", "hisparse_host", "--config", "P4-H8-R4-C14"]
CONFIG = next(c for c in HOST_CONFIGS if c.label() == "P4-H8-R4-C14")

ANSI_IMPL = '''
from kvproof.gpu_runtime.hisparse_host import HiSparseHostPool


class Colourful(HiSparseHostPool):
    def request_finished(self, *args, **kwargs):
        raise RuntimeError("\\x1b[1;31mred alert\\x1b[0m \\x00 nul \\x07 bell \\x1b]8;;link\\x1b\\\\")


def factory(config):
    return Colourful(config)


factory.components = ("hisparse_host",)
'''


def run(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(main, list(args), env={"COLUMNS": "100", **(env or {})})


@pytest.fixture
def colourful(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "colourful.py").write_text(ANSI_IMPL)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    sys.modules.pop("colourful", None)
    return "colourful:factory"


# ---------------------------------------------------------------- observation 5: valid reports


def test_conform_reports_parse_with_ansi_and_nul_in_the_failure_and_carry_the_diagnosis(tmp_path: Path,
                                                                                       colourful: str) -> None:
    result = run("conform", *HOST, "--profile", "dev", "--impl", colourful, "--json-report", "r.json",
                 "--junit-xml", "r.xml")
    assert result.exit_code == 1, result.output
    root = ET.parse(tmp_path / "r.xml").getroot()  # well-formed: the control characters are escaped
    failure = root.find("testsuite/testcase/failure")
    assert failure is not None
    message = failure.get("message", "")
    assert message.startswith("request_finished crashed with RuntimeError: \\x1b[1;31mred alert")  # the diagnosis
    assert "diverged from the reference" not in message  # not the header line
    assert "\\x00 nul" in message and "\\x07 bell" in (failure.text or "")
    doc = json.loads((tmp_path / "r.json").read_text())
    (row,) = doc["results"]
    assert row["diagnosis"] == "request_finished crashed with RuntimeError: \x1b[1;31mred alert\x1b[0m \x00 nul " \
                               "\x07 bell \x1b]8;;link\x1b\\; the reference succeeded"
    assert doc["seed"] is None and doc["derandomized"] is True and doc["complete"] is True


def test_seed_has_one_type_an_int_or_null_with_derandomized(tmp_path: Path) -> None:
    for profile, seed, derandomized in (("ci", None, True), ("smoke", 42, False)):
        extra = ["--seed", "42"] if seed else []
        result = run("conform", *HOST, "--profile", profile, *extra, "--json-report", str(tmp_path / "r.json"))
        assert result.exit_code == 0, result.output
        doc = json.loads((tmp_path / "r.json").read_text())
        assert doc["seed"] == seed and doc["derandomized"] is derandomized


def test_prove_mutants_and_check_write_json_and_junit(tmp_path: Path) -> None:
    prove = run("prove", "-k", "swa_tail_len", "--json-report", str(tmp_path / "p.json"),
                "--junit-xml", str(tmp_path / "p.xml"))
    assert prove.exit_code == 0, prove.output
    doc = json.loads((tmp_path / "p.json").read_text())
    assert doc["format"] == "kvproof-prove-report/1" and doc["complete"] is True and doc["summary"]["failed"] == 0
    assert all(r["ok"] for r in doc["results"]) and len(doc["results"]) == doc["summary"]["obligations"] > 0
    cases = ET.parse(tmp_path / "p.xml").getroot().findall("testsuite/testcase")
    assert len(cases) == len(doc["results"])

    mutants = run("mutants", "--component", "hisparse_host", "--profile", "dev", "--json-report",
                  str(tmp_path / "m.json"), "--junit-xml", str(tmp_path / "m.xml"))
    assert mutants.exit_code == 0, mutants.output
    doc = json.loads((tmp_path / "m.json").read_text())
    assert doc["format"] == "kvproof-mutants-report/1" and doc["status"] == "complete"
    assert doc["summary"]["killed"] == doc["summary"]["mutants"] == len(doc["results"]) > 0
    assert all(re.search(rf"\b{re.escape(r['mutant'])}\b", mutants.output) for r in doc["results"])  # names whole
    suite = ET.parse(tmp_path / "m.xml").getroot().find("testsuite")
    assert suite is not None and suite.get("failures") == "0" and suite.get("tests") == str(len(doc["results"]))

    check = run("check", "--component", "hisparse_host", "--profile", "dev", "--json-report",
                str(tmp_path / "c.json"), "--junit-xml", str(tmp_path / "c.xml"))
    assert check.exit_code == 0, check.output
    doc = json.loads((tmp_path / "c.json").read_text())
    assert doc["format"] == "kvproof-check-report/1" and doc["complete"] is True
    assert {doc[p]["status"] for p in ("prove", "conform", "mutants")} == {"complete"}
    names = [s.get("name") for s in ET.parse(tmp_path / "c.xml").getroot()]
    assert names == ["kvproof.prove", "kvproof.conformance", "kvproof.mutants"]


# ---------------------------------------------------------------- observation 7: bad CLI values


@pytest.mark.parametrize("value", ["-1", "0", "nan", "inf"])
def test_op_timeout_must_be_positive_seconds(value: str) -> None:
    result = run("conform", *HOST, "--profile", "dev", "--op-timeout", value)
    assert result.exit_code == 2 and "--op-timeout" in result.output, result.output


def test_seed_with_a_derandomized_profile_is_refused() -> None:
    result = run("conform", *HOST, "--profile", "ci", "--seed", "7")
    assert result.exit_code == 2 and "--seed 7" in result.output and "derandomized" in result.output


def test_replay_of_a_missing_file_says_so() -> None:
    result = run("replay", "no/such/vector.json")
    assert result.exit_code == 2 and "no such file" in result.output and "not JSON" not in result.output


def test_replay_without_impl_uses_the_vectors_implementation(tmp_path: Path) -> None:
    failing = run("conform", *HOST, "--profile", "dev", "--impl", MUTANT, "--json-report", str(tmp_path / "r.json"))
    assert failing.exit_code == 1
    vector = tmp_path / "v.json"
    vector.write_text(json.dumps(json.loads((tmp_path / "r.json").read_text())["results"][0]["vector"]))
    replayed = run("replay", str(vector))
    assert replayed.exit_code == 1, replayed.output  # it used to replay on kvproof's runtime and pass
    assert f"replaying on {MUTANT}" in replayed.output and "FAIL" in replayed.output
    anonymous = tmp_path / "anon.json"
    anonymous.write_text(json.dumps({**json.loads(vector.read_text()), "impl": "impl"}))
    refused = run("replay", str(anonymous))
    assert refused.exit_code == 2 and "--impl" in refused.output


def test_an_intermittently_failing_factory_is_named_in_the_verdict() -> None:
    calls = []

    def flaky_factory(config):
        calls.append(1)
        if len(calls) == 4:
            raise OSError("device busy")
        return HiSparseHostPool(config)

    report = run_check("hisparse_host", flaky_factory, CONFIG, profile="dev", impl_name="mymod:flaky_factory",
                       failures_dir=None)
    assert not report.passed
    assert "the factory mymod:flaky_factory raised OSError: device busy" in (report.failure or "")
    assert "intermittent" in (report.failure or "")


# ---------------------------------------------------------------- observation 9: output


def test_full_identifiers_at_100_columns_piped() -> None:
    names = [ob.name for ob in spec.obligations("hisparse_host", "slots_distinct_in_own_pages_in_order")]
    result = run("prove", "--component", "hisparse_host", "-k", "slots_distinct_in_own_pages_in_order")
    assert result.exit_code == 0, result.output
    assert names and all(re.search(rf"\s{re.escape(n)}$", result.output, re.M) for n in names), result.output
    assert "…" not in result.output
    conform = run("conform", "--profile", "dev", "--config", "P4-W6-F48-S24", "--component", "decode_prealloc")
    assert conform.exit_code == 0, conform.output
    assert re.search(r"decode_prealloc\s+P4-W6-F48-S24\s+pass", conform.output) and "…" not in conform.output
    table = [line for line in conform.output.splitlines() if "P4-W6-F48-S24" in line and "pass" in line]
    assert table and all(len(line) <= 100 for line in table)  # COLUMNS honoured when piped


def test_columns_is_honoured_when_piped() -> None:
    wide = run("prove", "-k", "swa_tail_len", env={"COLUMNS": "200"})
    narrow = run("prove", "-k", "swa_tail_len", env={"COLUMNS": "60"})
    assert "┏" in wide.output and max(map(len, wide.output.splitlines())) > 100  # the table, 200 columns wide
    assert "┏" not in narrow.output and "kvproof prove  (verdict, result, seconds, obligation)" in narrow.output


def test_no_reproduce_failure_advice_in_cli_output(colourful: str) -> None:
    result = run("conform", *HOST, "--profile", "ci", "--impl", colourful)
    assert result.exit_code == 1
    assert "reproduce_failure" not in result.output and "replay: kvproof conform" in result.output


def test_progress_of_a_slow_phase_goes_to_stderr() -> None:
    result = CliRunner().invoke(main, ["prove", "-k", "no_stale_read.without_alloc"],
                                env={"KVPROOF_PROGRESS_SECONDS": "0.2", "COLUMNS": "100"})
    assert result.exit_code == 0
    assert re.search(r"prove: obligation \d+/\d+: loc_cache.no_stale_read.without_alloc", result.stderr)
    assert "prove: obligation" not in result.stdout  # the log of stdout stays clean


EXITING_IMPL = '''
import sys
from kvproof.gpu_runtime.hisparse_host import HiSparseHostPool


class Exits(HiSparseHostPool):
    def request_finished(self, *args, **kwargs):
        sys.exit(3)


def factory(config):
    return Exits(config)


factory.components = ("hisparse_host",)
'''


def test_reports_are_finalised_when_the_run_ends_abnormally(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An implementation that calls sys.exit: whatever ends the run (in process: the exit; isolated: a verdict),
    the reports parse and say how the run ended, naming the test under way (observation 4)."""
    (tmp_path / "exits.py").write_text(EXITING_IMPL)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    run("conform", *HOST, "--profile", "dev", "--impl", "exits:factory", "--json-report", "r.json",
        "--junit-xml", "r.xml")
    doc = json.loads((tmp_path / "r.json").read_text())
    props = {p.get("name"): p.get("value") for p in ET.parse(tmp_path / "r.xml").getroot().iter("property")}
    assert doc["status"] == props["status"] and doc["status"] in ("aborted", "complete")
    if doc["status"] == "aborted":  # in process: the exit went through the harness
        assert doc["running"] == "hisparse_host/P4-H8-R4-C14" and doc["complete"] is False
    else:  # an isolated implementation: the exit is a verdict
        assert doc["results"][0]["status"] == "failed"


def test_a_misspelt_component_is_a_usage_error_naming_the_option() -> None:
    for verb in ("prove", "conform", "mutants"):
        result = run(verb, "--component", "swa_alocator")
        assert result.exit_code == 2 and "--component" in result.output and "swa_allocator" in result.output
