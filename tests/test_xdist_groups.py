"""``make test``'s ``--dist loadgroup`` does send the tests of one ``xdist_group`` to one worker.

The suite relies on it: the tests that start rank processes (group ``ranks``) run one at a time on the 2-core
machine, and a component's conformance test and ``test_structure`` read one shared run per worker
(``tests/conformance/runtime_runs.py``). pytest 9.2 keeps a node's id where pytest-xdist 3.8 does not write the group
(``item._nodeid``), so under it the marks were silently ignored: every grouped test went wherever the load put it,
and shared runs were made twice. pyproject.toml pins pytest below 9.2; this test runs a grouped set on two workers and
fails if the pytest installed ever ignores the marks again.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

SAMPLE = '''
import os, time, pytest

def _record(name):
    with open(f"ran-{name}", "w") as out:
        out.write(os.environ["PYTEST_XDIST_WORKER"])
    time.sleep(0.2)

@pytest.mark.xdist_group("together")
@pytest.mark.parametrize("i", range(4))
def test_grouped(i):
    _record(f"grouped-{i}")

@pytest.mark.parametrize("i", range(6))
def test_free(i):
    _record(f"free-{i}")
'''


def test_the_tests_of_one_group_run_on_one_worker(tmp_path: Path) -> None:
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist",
                          "loadgroup", "test_sample.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ran = {p.name.removeprefix("ran-"): p.read_text() for p in tmp_path.glob("ran-*")}
    assert len(ran) == 10, ran
    grouped = Counter(worker for name, worker in ran.items() if name.startswith("grouped"))
    assert len(grouped) == 1, f"the four tests of one xdist_group ran on several workers: {grouped}"
    assert len(set(ran.values())) == 2, f"the run did not use both workers: {ran}"  # so one worker is a finding
