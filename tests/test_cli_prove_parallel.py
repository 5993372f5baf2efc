"""``kvproof prove --jobs K``: obligations on K worker processes, the serial run's verdicts in registry order.

Real runs throughout: a small component (``hisparse_host``, about a second of solver time) or
``-k swa_tail_len`` (sound obligations and broken twins, a fraction of a second). The crash tests
register extra obligations whose ``build`` raises or kills its own process; they need the "fork"
start method (the workers see the parent's registry), so they are skipped where there is none.
"""

from __future__ import annotations

import json
import multiprocessing
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
import z3
from click.testing import CliRunner

from kvproof import spec
from kvproof.cli import main
from kvproof.cli.prove import prove
from kvproof.conformance.errors import HarnessError
from kvproof.spec import Obligation

KVPROOF = Path(sys.executable).parent / "kvproof"
WALL_LINE = re.compile(r"^kvproof prove: (\d+) obligations? in (\d+\.\d\d) s wall on (\d+) workers? "
                       r"\((\d+\.\d\d) s of solver time, (\d+\.\d\d)x\)$", re.M)
FORK = "fork" in multiprocessing.get_all_start_methods()


def run(*args: str):
    return CliRunner().invoke(main, list(args))


def _verdicts(results: list[spec.Result]) -> list[tuple[str, str, bool]]:
    return [(r.obligation.name, r.status, r.ok) for r in results]


def test_parallel_and_serial_give_the_same_verdicts_in_registry_order() -> None:
    heard: list[str] = []
    partial: list[list[str]] = []
    parallel = prove(["hisparse_host"], jobs=2, progress=heard.append,
                     done=lambda so_far: partial.append([r.obligation.name for r in so_far]))
    serial = prove(["hisparse_host"], jobs=1)
    registry = spec.obligations("hisparse_host")
    assert len(registry) > 2
    assert _verdicts(parallel) == _verdicts(serial)
    assert [r.obligation.name for r in parallel] == [ob.name for ob in registry]
    assert all(p.obligation is ob for p, ob in zip(parallel, registry, strict=True))  # the parent's own objects
    # a counterexample's text where the serial run has one; its values may differ, as between `-k NAME` and a
    # whole run today: Z3's model depends on what the process solved before
    assert all(bool(p.detail) == bool(s.detail) == (p.status == "counterexample")
               for p, s in zip(parallel, serial, strict=True))
    assert all(p.seconds > 0 for p in parallel)
    # progress: one "obligation i/n: name" per obligation, i counting up; done: the results so far, registry order
    assert [m.split(": ", 2)[1] for m in heard] == [f"obligation {i}/{len(registry)}" for i in
                                                    range(1, len(registry) + 1)]
    assert sorted(m.split(": ", 2)[2] for m in heard) == sorted(ob.name for ob in registry)
    assert len(partial) == len(registry) and partial[-1] == [ob.name for ob in registry]
    order = {ob.name: i for i, ob in enumerate(registry)}
    assert all([order[n] for n in names] == sorted(order[n] for n in names) for names in partial)


def test_broken_twins_still_yield_counterexamples_in_parallel() -> None:
    results = prove(name_filter="swa_tail_len", jobs=2)
    twins = [r for r in results if r.obligation.expect == "counterexample"]
    sound = [r for r in results if r.obligation.expect == "proved"]
    assert twins and sound
    assert all(r.status == "counterexample" and r.ok and r.detail.strip() for r in twins)
    assert all(r.status == "proved" and r.ok and r.detail == "" for r in sound)


def test_cli_prints_the_wall_time_line_and_reports_it(tmp_path: Path) -> None:
    report = tmp_path / "p.json"
    result = run("prove", "-k", "swa_tail_len", "--jobs", "2", "--json-report", str(report))
    assert result.exit_code == 0, result.output
    (line,) = WALL_LINE.findall(result.output)
    count, wall, workers, solver, ratio = line
    doc = json.loads(report.read_text())
    summary = doc["summary"]
    assert int(count) == summary["obligations"] == len(doc["results"]) > 2 and workers == "2"
    assert summary["workers"] == 2 and summary["failed"] == 0 and doc["status"] == "complete"
    assert summary["solver_seconds"] == pytest.approx(sum(r["seconds"] for r in doc["results"]), abs=0.01)
    assert float(solver) == pytest.approx(summary["solver_seconds"], abs=0.01)
    assert summary["wall_seconds"] > 0 and float(wall) == pytest.approx(summary["wall_seconds"], abs=0.05)
    # the printed ratio is of the unrounded times (the printed ones are rounded: a short wall time is off by 3 %)
    assert float(ratio) == pytest.approx(summary["solver_seconds"] / summary["wall_seconds"], abs=0.011)
    assert result.output.rstrip().splitlines()[-1].startswith("kvproof prove: ")  # after the table and summary

    serial = run("prove", "-k", "swa_tail_len", "--jobs", "1")
    assert serial.exit_code == 0 and re.search(r" s wall on 1 worker \(", serial.output), serial.output
    one = run("prove", "-k", "swa_tail_len.upper_bound", "--jobs", "4")  # never more workers than obligations
    (line,) = WALL_LINE.findall(one.output)
    assert one.exit_code == 0 and line[2] == str(min(4, len(spec.obligations(None, "swa_tail_len.upper_bound"))))
    default = run("prove", "-k", "swa_tail_len")
    (line,) = WALL_LINE.findall(default.output)
    assert default.exit_code == 0 and int(line[2]) == min(os.cpu_count() or 1, int(count))


@pytest.mark.parametrize("jobs", ["0", "-2", "many"])
def test_bad_jobs_is_a_usage_error_naming_the_option(jobs: str) -> None:
    result = run("prove", "-k", "swa_tail_len", "--jobs", jobs)
    assert result.exit_code == 2 and "'--jobs'" in result.output, result.output
    assert "kvproof prove:" not in result.output  # nothing was proved


def test_no_worker_process_is_left_after_a_run() -> None:
    before = {p.pid for p in multiprocessing.active_children()}
    prove(name_filter="swa_tail_len", jobs=2)
    assert {p.pid for p in multiprocessing.active_children()} == before


# ---------------------------------------------------------------- workers that raise or die


def _extra(monkeypatch: pytest.MonkeyPatch, claim: str, build) -> str:
    """Register a sound obligation and ``hisparse_host.zz_parallel.<claim>`` with ``build``; the filter for both."""
    def ob(suffix: str, make) -> Obligation:
        return Obligation.of_component("hisparse_host", f"zz_parallel.{suffix}", "test obligation", make,
                                       lambda model: "")
    extra = (ob("sound", lambda: [z3.BoolVal(False)]), ob(claim, build))
    monkeypatch.setattr(spec, "OBLIGATIONS", spec.OBLIGATIONS + extra)
    return "zz_parallel."


def _raise() -> list[z3.BoolRef]:
    raise RuntimeError("boom in build")


def _die() -> list[z3.BoolRef]:
    os.kill(os.getpid(), signal.SIGKILL)
    return []


@pytest.mark.skipif(not FORK, reason="the workers see extra obligations only when forked")
def test_a_worker_that_raises_is_a_harness_error_naming_the_obligation(monkeypatch: pytest.MonkeyPatch) -> None:
    name_filter = _extra(monkeypatch, "raises", _raise)
    before = {p.pid for p in multiprocessing.active_children()}
    with pytest.raises(HarnessError, match=r"proving hisparse_host\.zz_parallel\.raises raised in its worker") as err:
        prove(name_filter=name_filter, jobs=2)
    assert "RuntimeError: boom in build" in str(err.value)
    assert {p.pid for p in multiprocessing.active_children()} == before
    with pytest.raises(RuntimeError, match="boom in build"):  # in kvproof's own process, as before
        prove(name_filter=name_filter, jobs=1)


@pytest.mark.skipif(not FORK, reason="the workers see extra obligations only when forked")
def test_a_worker_that_dies_is_a_harness_error_not_a_hang(monkeypatch: pytest.MonkeyPatch) -> None:
    name_filter = _extra(monkeypatch, "dies", _die)
    before = {p.pid for p in multiprocessing.active_children()}
    start = time.monotonic()
    with pytest.raises(HarnessError, match=r"the worker process proving hisparse_host\.zz_parallel\.dies died "
                                           r"\(killed by SIGKILL\)"):
        prove(name_filter=name_filter, jobs=2)
    assert time.monotonic() - start < 15
    assert {p.pid for p in multiprocessing.active_children()} == before
    result = run("prove", "-k", name_filter, "--jobs", "2")  # the CLI: exit 2, the message
    assert result.exit_code == 2 and "zz_parallel.dies died" in result.output, result.output


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the workers through /proc")
def test_ctrl_c_leaves_no_worker_behind(tmp_path: Path, marked: Callable[[str], list[int]]) -> None:
    marker = uuid.uuid4().hex
    proc = subprocess.Popen([str(KVPROOF), "prove", "--component", "swa_allocator", "--jobs", "2", "--json-report",
                             "r.json"], cwd=tmp_path, env={**os.environ, "KVPROOF_PROVE_TEST": marker},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while len(marked(marker)) < 3 and time.monotonic() < deadline:  # kvproof and its two workers
            time.sleep(0.05)
        assert len(marked(marker)) == 3
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, out[-2000:]
    deadline = time.monotonic() + 10
    while marked(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marked(marker) == []
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["status"] == "interrupted" and doc["summary"]["workers"] == 2
