"""Isolation and custody (issue #11): an implementation can neither pick the verdict nor hide a misdeed.

* obs. 2: ``sys.exit(0)`` / ``sys.exit(3)`` / ``os._exit(7)`` / a segfault inside an operation
  is a verdict naming the operation and the step; ``kvproof conform`` exits 1 with its
  table and JSON report, and the next config still runs;
* obs. 3: a factory or constructor that blocks, an operation that swallows ``BaseException``
  in a retry loop, and a memory hog over ``--memory-limit`` are verdicts too;
* obs. 6: writes into input tensors (``seq_lens``, ``last_loc``, ``free_index``) and into a
  tensor the implementation returned earlier are verdicts naming the operation, the argument
  and the step.

No process is left running: every CLI run carries a marker in its environment, and after
it no process with that marker may exist; ``run_check`` leaves the test process no child.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from kvproof.conformance import isolation
from kvproof.conformance.check import replay_vector, run_check
from kvproof.conformance.configs import CONFORMANCE_CONFIGS
from kvproof.conformance.isolation import Crash, run_isolated
from kvproof.gpu_runtime.swa_allocator import SWATokenToKVPoolAllocator

from . import isolation_impls as impls

HERE = Path(__file__).parent
KVPROOF = Path(sys.executable).parent / "kvproof"
CONFIG = CONFORMANCE_CONFIGS[2]
LABELS = [c.label() for c in CONFORMANCE_CONFIGS[:2]]
#: the ``marked`` fixture (tests/conftest.py): live processes carrying a marker
Marked = Callable[[str], list[int]]


def _children() -> list[int]:
    """This process's live children (not zombies)."""
    out = []
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            out += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def conform(tmp_path: Path, marked: Marked, impl: str, *extra: str, timeout: float = 120
            ) -> tuple[subprocess.CompletedProcess[str], dict]:
    marker = f"KVPROOF_ISOLATION_TEST={uuid.uuid4().hex}"
    report = tmp_path / "report.json"
    args = [str(KVPROOF), "conform", "--component", "swa_allocator", "--impl", f"isolation_impls:{impl}",
            "--profile", "dev", "--op-timeout", "1", "--json-report", str(report), *extra]
    for label in LABELS:
        args += ["--config", label]
    key, value = marker.split("=")
    env = {**os.environ, "PYTHONPATH": str(HERE), "COLUMNS": "200", key: value}
    out = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=timeout, check=False, env=env)
    assert marked(marker) == [], "a process of the run is still running"
    doc = json.loads(report.read_text()) if report.exists() else {}
    return out, doc


# (implementation, extra CLI arguments, what the verdict says)
CRASHES = {
    "sys.exit(0)": ("Exit0", (), "alloc_extend raised SystemExit(0): an implementation may not exit the process"),
    "sys.exit(3)": ("Exit3", (), "alloc_extend raised SystemExit(3): an implementation may not exit the process"),
    "os._exit(7)": ("HardExit7", (), "the implementation process exited with code 7 during alloc_extend"),
    "segfault": ("Segfault", (), "the implementation process was killed by signal SIGSEGV during alloc_extend"),
    "factory blocks": ("factory_blocks", (), "the factory"),
    "constructor swallows the alarm": ("ConstructorBlocks", (), "the factory did not return within 1 s (hung; the "
                                                                "implementation process was killed)"),
    "op swallows BaseException": ("SwallowsBaseException", (), "alloc_extend did not return within 1 s (hung; the "
                                                               "implementation process was killed)"),
    "memory hog": ("MemoryHog", ("--memory-limit", "256", "--op-timeout", "30"), "over the limit of 256 MiB "
                                                                                 "(--memory-limit); it was killed"),
}


@pytest.mark.parametrize("case", list(CRASHES))
def test_cli_an_implementation_cannot_pick_the_verdict(tmp_path: Path, case: str, marked: Marked) -> None:
    """Exit 1 with the table, the verdict and the JSON report, both configs run (obs. 2, 3)."""
    impl, extra, says = CRASHES[case]
    out, doc = conform(tmp_path, marked, impl, *extra)
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert "kvproof conform" in out.stdout and all(label in out.stdout for label in LABELS), text
    assert says in text, text
    results = doc["results"]
    assert [r["config"] for r in results] == LABELS
    assert all(r["status"] == "failed" for r in results), results


def test_cli_in_process_is_still_a_verdict_for_sys_exit(tmp_path: Path, marked: Marked) -> None:
    """--in-process trades isolation for speed, but sys.exit in an operation is still a verdict (obs. 2)."""
    out, doc = conform(tmp_path, marked, "Exit0", "--in-process")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "alloc_extend raised SystemExit(0)" in out.stdout
    assert [r["status"] for r in doc["results"]] == ["failed", "failed"]


def test_cli_usage_of_the_isolation_options(tmp_path: Path) -> None:
    out = subprocess.run([str(KVPROOF), "conform", "--memory-limit", "-1"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 2 and "--memory-limit" in out.stderr


def _gone(marked: Marked, marker: str, within: float = 10) -> bool:
    deadline = time.monotonic() + within
    while marked(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    return marked(marker) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_killing_kvproof_kills_the_implementation_process(tmp_path: Path, sig: signal.Signals, marked: Marked) -> None:
    """Ctrl-C (SIGINT) or SIGKILL to kvproof while an implementation hangs: nothing is left running."""
    marker = uuid.uuid4().hex
    args = [str(KVPROOF), "conform", "--component", "swa_allocator", "--impl", "isolation_impls:SwallowsBaseException",
            "--profile", "dev", "--op-timeout", "60", "--config", LABELS[0]]
    env = {**os.environ, "PYTHONPATH": str(HERE), "KVPROOF_ISOLATION_TEST": marker}
    proc = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while len(marked(marker)) < 2 and time.monotonic() < deadline:  # kvproof and its child
            time.sleep(0.1)
        assert len(marked(marker)) == 2
        time.sleep(0.5)
        proc.send_signal(sig)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert _gone(marked, marker)


# ---------------------------------------------------------------- through run_check


@pytest.mark.parametrize("isolation", ["process", "in-process"])
def test_run_check_sys_exit_is_a_verdict(isolation: str) -> None:
    report = run_check("swa_allocator", impls.Exit0, CONFIG, profile="dev", failures_dir=None, isolation=isolation)
    assert not report.passed
    assert re.search(r"at step \d+:\n  alloc_extend raised SystemExit\(0\): an implementation may not exit the process",
                     report.failure or ""), report.failure
    assert _children() == []


def test_run_check_in_process_a_ctrl_c_is_not_a_verdict() -> None:
    with pytest.raises(KeyboardInterrupt):
        run_check("swa_allocator", impls.RaisesKeyboardInterrupt, CONFIG, profile="dev", failures_dir=None,
                  isolation="in-process")


def test_run_check_crash_report_has_the_operations_and_a_replayable_vector() -> None:
    report = run_check("swa_allocator", impls.HardExit7, CONFIG, profile="dev", failures_dir=None, op_timeout=2)
    failure = report.failure or ""
    assert not report.passed and "the implementation process exited with code 7 during alloc_extend" in failure
    assert "operations so far:\n  1. " in failure and "alloc_extend(" in failure.split("operations so far:")[1]
    assert report.vector and report.vector["steps"] and report.examples >= 1
    again = replay_vector(report.vector, impls.HardExit7, op_timeout=2)
    assert again.failure and "exited with code 7 during alloc_extend" in again.failure
    assert replay_vector(report.vector, SWATokenToKVPoolAllocator).passed
    assert _children() == []


@pytest.mark.parametrize("log_bytes", [isolation.LOG_BYTES, 400, 24], ids=["default", "overflows", "no_record_fits"])
def test_a_crash_report_is_whole_whatever_the_event_log_holds(monkeypatch: pytest.MonkeyPatch, log_bytes: int
                                                              ) -> None:
    """The child's trace and vector reach the parent through its event log; an example that outgrows the log has its
    older records sent over the pipe first, and a record larger than the whole log goes over the pipe alone: the
    crash report (operations, vector, examples) is the same as with the default log."""
    def crash() -> tuple[str, dict | None, int]:
        report = run_check("swa_allocator", impls.ExitsOnThirdExtend, CONFIG, profile="dev", failures_dir=None,
                           op_timeout=2)
        assert not report.passed and "exited with code 7 during alloc_extend" in (report.failure or "")
        return report.failure or "", report.vector, report.examples

    whole = crash()
    monkeypatch.setattr(isolation, "LOG_BYTES", log_bytes)
    assert crash() == whole
    operations = whole[0].split("operations so far:")[1]
    assert operations.count("alloc_extend(") >= 3, operations
    again = replay_vector(whole[1], impls.ExitsOnThirdExtend, op_timeout=2)
    assert again.failure and "exited with code 7 during alloc_extend" in again.failure
    assert _children() == []


def test_run_check_a_blocking_factory_is_a_verdict_in_process_too() -> None:
    """The factory probe runs under the deadline (before #11 it blocked the run for ever)."""
    start = time.monotonic()
    report = run_check("swa_allocator", impls.factory_blocks, CONFIG, profile="dev", failures_dir=None,
                       op_timeout=0.5, isolation="in-process")
    assert time.monotonic() - start < 10
    assert "the factory could not build an implementation for P4-W6-F48-S24: it did not return within 0.5 s" in (
        report.failure or "")


def test_run_check_swallowed_alarm_is_killed_by_the_parent() -> None:
    start = time.monotonic()
    report = run_check("swa_allocator", impls.SwallowsBaseException, CONFIG, profile="dev", failures_dir=None,
                       op_timeout=0.5)
    assert time.monotonic() - start < 15
    assert "alloc_extend did not return within 0.5 s (hung; the implementation process was killed)" in (
        report.failure or "")
    assert _children() == []


def test_isolated_result_and_errors_come_back() -> None:
    assert run_isolated(lambda: {"answer": 42}, op_timeout=1) == {"answer": 42}
    with pytest.raises(KeyError):
        run_isolated(lambda: {}["missing"], op_timeout=1)
    crash = run_isolated(lambda: sys.exit(5), op_timeout=1)
    assert isinstance(crash, Crash) and "raised SystemExit(5) outside any implementation call" in crash.message
    assert _children() == []


def test_isolation_keeps_the_verdicts_and_the_examples() -> None:
    """The runtime passes in both modes with the same examples (the same fingerprint)."""
    reports = [run_check("swa_allocator", SWATokenToKVPoolAllocator, CONFIG, profile="dev", failures_dir=None,
                         isolation=mode) for mode in ("in-process", "process")]
    assert all(r.passed for r in reports)
    assert reports[0].fingerprint == reports[1].fingerprint and reports[0].steps == reports[1].steps


def test_an_unknown_isolation_mode_is_a_usage_error() -> None:
    from kvproof.conformance.errors import UsageError

    with pytest.raises(UsageError, match="isolation='thread'"):
        run_check("swa_allocator", SWATokenToKVPoolAllocator, CONFIG, isolation="thread")


# ---------------------------------------------------------------- custody (obs. 6)

WRITES = {
    "seq_lens": (impls.WritesSeqLens, "alloc_extend wrote into its input seq_lens (before ["),
    "last_loc": (impls.WritesLastLoc, "alloc_extend wrote into its input last_loc (before ["),
    "free_index": (impls.WritesFreeIndex, "free wrote into its input free_index (before ["),
    "returned tensor": (impls.WritesReturned, "(the last: free) wrote into the tensor alloc_extend returned at step "),
}


@pytest.mark.parametrize("case", list(WRITES))
def test_writes_into_the_callers_tensors_are_verdicts(case: str) -> None:
    impl, says = WRITES[case]
    report = run_check("swa_allocator", impl, CONFIG, profile="dev", failures_dir=None, isolation="in-process")
    assert not report.passed
    assert says in (report.failure or ""), report.failure
    assert "at step " in (report.failure or "")
