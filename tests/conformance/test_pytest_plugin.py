"""The pytest plugin: --kvproof-impl / $KVPROOF_IMPL, one test per component x config, skip and xfail files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

PYTEST = str(Path(sys.executable).parent / "pytest")
MUTANT = "kvproof.conformance.mutants.hisparse_host:ReleaseReversed"


def run(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """A separate pytest session over the shipped suite module (the plugin loads from its entry point)."""
    return subprocess.run([PYTEST, "-q", "-p", "no:cacheprovider", "--pyargs", "kvproof.conformance.suite",
                           "--kvproof-component", "hisparse_host", "--kvproof-profile", "dev", *args],
                          cwd=tmp_path, capture_output=True, text=True, env={**os.environ, **(env or {})},
                          timeout=600)


def test_the_default_runtime_passes_and_ids_name_component_and_config(tmp_path: Path) -> None:
    out = run(tmp_path, "-vv")
    assert out.returncode == 0, out.stdout[-3000:]
    assert "test_conformance[hisparse_host/P4-H8-R4-C14] PASSED" in out.stdout


def test_a_broken_implementation_fails_with_the_verdict_and_selection_files_apply(tmp_path: Path) -> None:
    (tmp_path / "skip").write_text("hisparse_host/P1-*  # not today\nhisparse_host/P7-*  # a typo\n")
    (tmp_path / "xfail").write_text("hisparse_host/P4-H8-R4-C14  # known\n")
    out = run(tmp_path, "-rsx", "--kvproof-skip-file", "skip", "--kvproof-xfail-file", "xfail",
              env={"KVPROOF_IMPL": MUTANT})
    assert out.returncode == 1
    assert "3 failed, 1 skipped, 1 xfailed" in out.stdout, out.stdout[-3000:]
    assert "operations so far" in out.stdout and "not today" in out.stdout
    assert "entry 'hisparse_host/P7-*' matches no test" in out.stdout
