"""Issue 11, observation 4 ("nothing lost"): real ``kvproof conform`` processes killed with SIGKILL and SIGINT.

The implementation fails quickly (from its 40th call on) and shrinks slowly (every call
takes 30 ms), so the run is killed while Hypothesis shrinks. What must be on disk then:
the failure text (marked "first seen") and its vector, which ``kvproof replay`` replays
(on the vector's own implementation, without ``--impl``), a JSON report that parses and
says where the run was, JUnit XML that parses. The seed is printed before the first
config runs, and progress ("shrinking…") appears on stderr. The saved failure is then
replayed first by the next run of the same test (kvproof's example database).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from kvproof.conformance.check import run_check
from kvproof.conformance.hisparse_host import HOST_CONFIGS
from kvproof.conformance.mutants.hisparse_host import MUTANTS
from kvproof.conformance.saved import FIRST_SEEN
from kvproof.gpu_runtime.hisparse_host import HiSparseHostPool

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")

BIN = Path(sys.executable).parent
TEST_ID = "hisparse_host/P4-H8-R4-C14"
SLOW_TO_SHRINK = '''
import time
from kvproof.gpu_runtime.hisparse_host import HiSparseHostPool


class SlowToShrink:
    """Crashes from its 40th call on; every call takes 30 ms, so shrinking takes long."""

    def __init__(self, config):
        self._pool, self._calls = HiSparseHostPool(config), 0

    def __getattr__(self, name):
        value = getattr(self._pool, name)
        if not callable(value) or name == "snapshot":
            return value

        def call(*args, **kwargs):
            self._calls += 1
            time.sleep(0.03)
            if self._calls >= 40:
                raise RuntimeError("\\x1b[31mboom\\x1b[0m after 40 calls \\x00")
            return value(*args, **kwargs)

        return call


def factory(config):
    return SlowToShrink(config)


factory.components = ("hisparse_host",)
'''


def _start(tmp_path: Path, *extra: str) -> subprocess.Popen[bytes]:
    (tmp_path / "slowshrink.py").write_text(SLOW_TO_SHRINK)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "KVPROOF_PROGRESS_SECONDS": "1", "COLUMNS": "120"}
    args = [str(BIN / "kvproof"), "conform", "--impl", "slowshrink:factory", "--config", "P4-H8-R4-C14",
            "--profile", "smoke", "--seed", "5", "--json-report", "r.json", "--junit-xml", "r.xml", *extra]
    with open(tmp_path / "out.txt", "wb") as out, open(tmp_path / "err.txt", "wb") as err:
        return subprocess.Popen(args, cwd=tmp_path, env=env, stdout=out, stderr=err)


def _wait_for_first_seen(tmp_path: Path, proc: subprocess.Popen[bytes], timeout: float = 120) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = sorted((tmp_path / ".kvproof" / "failures").glob("*.txt"))
        if found:
            return found[0]
        if proc.poll() is not None:
            pytest.fail(f"kvproof ended (rc {proc.returncode}) before a failure was seen: "
                        f"{(tmp_path / 'out.txt').read_text()[-2000:]}")
        time.sleep(0.2)
    proc.kill()
    proc.wait(30)
    pytest.fail("no failure seen within the time limit")


def _interrupt_while_shrinking(tmp_path: Path, proc: subprocess.Popen[bytes], after: float) -> Path:
    """Ctrl-C to ``proc`` ``after`` seconds past its first-seen failure (while it shrinks); that failure's file."""
    try:
        text = _wait_for_first_seen(tmp_path, proc)
        time.sleep(after)
        assert proc.poll() is None, "the run ended before it could be interrupted while shrinking"
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    return text


def _replay(tmp_path: Path, vector: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    return subprocess.run([str(BIN / "kvproof"), "replay", str(vector)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120, check=False)


def test_sigkill_while_shrinking_leaves_the_failure_the_reports_and_the_seed(tmp_path: Path) -> None:
    proc = _start(tmp_path)
    try:
        text = _wait_for_first_seen(tmp_path, proc)
        time.sleep(1.5)  # well into shrinking (a progress line per second)
        assert proc.poll() is None, "the run ended before it could be killed while shrinking"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    saved = text.read_text()
    assert saved.startswith(FIRST_SEEN) and "slowshrink:factory diverged from the reference" in saved
    vector = json.loads(text.with_suffix(".json").read_text())
    assert vector["first_seen"] is True and vector["impl"] == "slowshrink:factory" and vector["steps"]
    replayed = _replay(tmp_path, text.with_suffix(".json"))  # no --impl: the vector's implementation
    assert replayed.returncode == 1, replayed.stdout + replayed.stderr
    assert "replaying on slowshrink:factory" in replayed.stdout and "FAIL" in replayed.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["status"] == "running" and report["complete"] is False and report["running"] == TEST_ID
    assert report["seed"] == 5 and report["derandomized"] is False
    suite = ET.parse(tmp_path / "r.xml").getroot().find("testsuite")
    assert suite is not None and {p.get("name"): p.get("value") for p in suite.iter("property")}["status"] == "running"
    out = (tmp_path / "out.txt").read_text()
    assert "seed 5 (replay this run: --seed 5)" in out.splitlines()[0]  # printed before the first config ran
    assert "failure found, shrinking…" in (tmp_path / "err.txt").read_text()  # live progress (observation 9)

    # kvproof's example database: the next run replays the saved failure first and fails at once
    again = subprocess.run([str(BIN / "kvproof"), "conform", "--impl", "slowshrink:factory", "--config",
                            "P4-H8-R4-C14", "--profile", "smoke", "--seed", "5"], cwd=tmp_path,
                           env={**os.environ, "PYTHONPATH": str(tmp_path)}, capture_output=True, text=True,
                           timeout=120, check=False)
    assert again.returncode == 1, again.stdout[-2000:]
    assert "a failure saved by an earlier run" in again.stdout and text.with_suffix(".json").name in again.stdout


def test_sigint_while_shrinking_finalises_the_reports(tmp_path: Path) -> None:
    proc = _start(tmp_path)
    text = _interrupt_while_shrinking(tmp_path, proc, 1.0)
    out = (tmp_path / "out.txt").read_text()
    assert proc.returncode == 130, out[-2000:] + (tmp_path / "err.txt").read_text()[-2000:]
    assert "interrupted (Ctrl-C) during hisparse_host/P4-H8-R4-C14" in out
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["status"] == "interrupted" and report["complete"] is False and report["running"] == TEST_ID
    (result,) = report["results"]
    assert result["status"] == "interrupted" and result["failure_file"] == str(text.relative_to(tmp_path))
    assert "RuntimeError" in result["diagnosis"] and result["vector"]["steps"]
    # the run's counts as of the child's last progress note (sent when shrinking starts), not zero
    assert result["examples"] >= 1 and result["steps"] >= 1, result
    root = ET.parse(tmp_path / "r.xml").getroot()  # well-formed although the failure text holds ESC and NUL
    error = root.find("testsuite/testcase/error")
    assert error is not None and "RuntimeError" in error.get("message", "")
    assert "\\x1b[31mboom" in error.get("message", "")  # the control characters escaped, visibly
    assert _replay(tmp_path, text.with_suffix(".json")).returncode == 1


CONFIG = next(c for c in HOST_CONFIGS if c.label() == "P4-H8-R4-C14")


def test_saved_failures_are_replayed_first_and_a_passing_one_changes_nothing(tmp_path: Path) -> None:
    """The database: a saved failure that still fails is the verdict at once; one that passes (fixed)
    leaves the generated run exactly as on a fresh checkout (same fingerprint)."""
    found = run_check("hisparse_host", MUTANTS["release_reversed"], CONFIG, profile="dev", impl_name="mine:factory",
                      failures_dir=tmp_path)
    assert not found.passed and found.failure_file and Path(found.failure_file).with_suffix(".json").exists()
    assert not Path(found.failure_file).read_text().startswith(FIRST_SEEN)  # replaced by the shrunk failure
    again = run_check("hisparse_host", MUTANTS["release_reversed"], CONFIG, profile="dev", impl_name="mine:factory",
                      failures_dir=tmp_path, replay_saved=True)
    assert not again.passed and again.examples == 0 and "a failure saved by an earlier run" in (again.failure or "")
    fixed = run_check("hisparse_host", HiSparseHostPool, CONFIG, profile="dev", impl_name="mine:factory",
                      failures_dir=tmp_path, replay_saved=True)
    fresh = run_check("hisparse_host", HiSparseHostPool, CONFIG, profile="dev", impl_name="mine:factory",
                      failures_dir=None)
    assert fixed.passed and fresh.passed and fixed.fingerprint == fresh.fingerprint


def test_sigint_while_the_breadth_driver_shrinks_keeps_the_failure_and_the_runs_counts(tmp_path: Path) -> None:
    """``kvproof fuzz --mode breadth``: Ctrl-C while the breadth driver shrinks (replaying the vector in the run's
    child process) stops the campaign with its summary (exit 130); the failure is on disk, unshrunk, and replays; the
    interrupted run's examples and steps (as of the note the child sends when shrinking starts) are in the summary,
    not zeros."""
    (tmp_path / "slowshrink.py").write_text(SLOW_TO_SHRINK)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "KVPROOF_PROGRESS_SECONDS": "1", "COLUMNS": "250"}
    args = [str(BIN / "kvproof"), "fuzz", "--component", "hisparse_host", "--impl", "slowshrink:factory", "--config",
            "P4-H8-R4-C14", "--mode", "breadth", "--time", "60s", "--workers", "1"]
    with open(tmp_path / "out.txt", "wb") as out, open(tmp_path / "err.txt", "wb") as err:
        proc = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=out, stderr=err)
    text = _interrupt_while_shrinking(tmp_path, proc, 1.5)  # into the shrink: every replayed call takes 30 ms
    out_text = (tmp_path / "out.txt").read_text(errors="replace")
    assert proc.returncode == 130, out_text[-2000:] + (tmp_path / "err.txt").read_text(errors="replace")[-2000:]
    assert text.read_text().startswith(FIRST_SEEN)
    assert _replay(tmp_path, text.with_suffix(".json")).returncode == 1
    (row,) = [line for line in out_text.splitlines() if line.startswith("│ hisparse_host ")]
    cells = [c.strip() for c in row.strip("│").split("│")]  # component, slices, runs, examples, steps, ...
    assert int(cells[3].replace(",", "")) >= 1 and int(cells[4].replace(",", "")) >= 1, row
