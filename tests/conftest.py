"""Test-suite set-up: kvproof's Hypothesis profile, and tests that do not depend on the tests before them.

CI sets CI=true, which would silently activate Hypothesis' built-in ``ci`` profile;
kvproof registers its own ``ci`` / ``nightly`` / ``dev`` and loads one by name
(``KVPROOF_PROFILE``, default ``ci``).

``make test`` runs the suite on two pytest-xdist workers, so which tests ran earlier in a
test's process is a matter of scheduling. Each test therefore starts from the same state:

* its own empty working directory (its ``tmp_path``): what kvproof writes relative to the
  working directory (failures saved under ``.kvproof/failures/``, replayed first by later
  ``kvproof conform`` runs; the working directory that ``--impl`` falls back to importing
  from) neither lands in the checkout nor reaches a test on another worker;
* Hypothesis draws no constants from the local modules loaded so far
  (:func:`kvproof.conformance.generation.stable_generation`, which ``run_check`` already
  applies to lockstep runs): a derandomized ``@given`` test draws the same examples whichever
  tests ran before it, serially or on either worker.

The process environment is the one the tests' own ``os.environ`` shows, in the main process
and on the workers alike: ``COLUMNS`` and ``LINES`` that GNU readline (imported by pytest)
exported without ``os.environ`` knowing are removed, or a worker (a child of the main
process) would inherit them and render the CLI at 80 columns, not at the 150 of a log. A
test process started with SIGINT ignored (``nohup``, a background job of a script) would
pass that on to the ``kvproof`` processes the tests interrupt with SIGINT; the default
handler is restored so that those children get Ctrl-C as a user's run does.

Nothing the tests start may outlive them: every process started under this session carries
``KVPROOF_TEST_SESSION`` in its environment, and at the end the main process looks for rank
processes (``kvproof.gpu_runtime._ranks``, the ``tp_prefetch`` groups) still carrying it; any it
finds after a grace period is killed and fails the session, named in the summary.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis.database import DirectoryBasedExampleDatabase

import kvproof.conformance.profiles  # noqa: F401  (registers the profiles)
from kvproof.conformance.generation import stable_generation

PROFILE = os.environ.get("KVPROOF_PROFILE", "ci")
_profile = settings.get_profile(PROFILE)
if isinstance(_profile.database, DirectoryBasedExampleDatabase) and not _profile.database.path.is_absolute():
    # nightly's .kvproof/hypothesis is relative to the working directory, which is each test's own (below):
    # anchored where pytest started, as before, and shared by the workers (Hypothesis' directory database takes
    # concurrent writers)
    PROFILE = f"{PROFILE}-anchored"
    settings.register_profile(PROFILE, settings(_profile, database=DirectoryBasedExampleDatabase(
        _profile.database.path.absolute())))
settings.load_profile(PROFILE)
SESSION = os.environ.setdefault("KVPROOF_TEST_SESSION", uuid.uuid4().hex)  # set by the main process, inherited
os.environ["KVPROOF_TEST_PROCESS"] = str(os.getpid())  # this process (main or worker), inherited by what it starts

if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

for _name in ("COLUMNS", "LINES"):
    if _name not in os.environ:
        # set behind os.environ's back by GNU readline, which pytest imports (the size of a terminal it did not
        # find, or of the one it found): the kvproof CLI honours COLUMNS, and the xdist workers would inherit it
        os.unsetenv(_name)


@pytest.fixture(autouse=True)
def _independent_of_earlier_tests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.chdir(tmp_path)
    with stable_generation():
        yield


def leftover_ranks(*, this_process: bool = False) -> list[int]:
    """Live rank processes started under this test session (any parent: an orphan too), or, with
    ``this_process``, by this pytest process (main or worker) and what it started."""
    marker = (f"KVPROOF_TEST_PROCESS={os.getpid()}" if this_process else f"KVPROOF_TEST_SESSION={SESSION}").encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            if b"kvproof.gpu_runtime._ranks" not in cmdline:
                continue
            if marker not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            if (entry / "stat").read_text().split()[2] == "Z":
                continue
        except OSError:
            continue
        found.append(int(entry.name))
    return found


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """In the main process: no rank process of this session may be left (killed and a failure if one is)."""
    if hasattr(session.config, "workerinput") or not Path("/proc").is_dir():
        return
    deadline = time.monotonic() + 15
    left = leftover_ranks()
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = leftover_ranks()
    session.config.stash[_LEFT] = left
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    if left:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


_LEFT = pytest.StashKey[list[int]]()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    left = terminalreporter.config.stash.get(_LEFT, None)
    if left is None:
        return
    if left:
        terminalreporter.write_line(f"FAILED: {len(left)} rank process(es) outlived the tests (killed): {left}",
                                    red=True)
    else:
        terminalreporter.write_line("rank processes left behind: 0")


def processes_marked(marker: str) -> list[int]:
    """Live processes whose environment carries ``marker`` (zombies have none): a test's children and theirs."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker.encode() in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.fixture
def marked() -> Callable[[str], list[int]]:
    """:func:`processes_marked`: the live processes that carry a marker the test put in their environment."""
    return processes_marked


@pytest.fixture
def no_rank_left() -> Iterator[None]:
    """After the test: no rank process this pytest process started is still running (a grace period to exit)."""
    yield
    from kvproof.gpu_runtime import _ranks

    _ranks.release_all()
    deadline = time.monotonic() + 15
    while leftover_ranks(this_process=True) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not leftover_ranks(this_process=True), "rank processes left behind"
