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


def test_a_run_that_never_calls_the_implementation_is_skipped_with_the_reason(tmp_path: Path) -> None:
    """As conform does: a pass without one call of the implementation checked nothing (decode_prealloc's suite on an
    allocator without alloc_extend), so the test is skipped and says why."""
    (tmp_path / "noextend.py").write_text(
        "from kvproof.gpu_runtime.swa_allocator import SWATokenToKVPoolAllocator\n"
        "from kvproof.reference.contract import Capability\n\n\n"
        "class NoAllocExtend(SWATokenToKVPoolAllocator):\n"
        "    capabilities = SWATokenToKVPoolAllocator.capabilities - {Capability.ALLOC_EXTEND}\n"
        "    components = ('decode_prealloc',)\n")
    out = subprocess.run([PYTEST, "-q", "-rs", "-p", "no:cacheprovider", "--pyargs", "kvproof.conformance.suite",
                          "--kvproof-component", "decode_prealloc", "--kvproof-config", "P2-W3-F24-S12",
                          "--kvproof-profile", "dev", "--kvproof-impl", "noextend:NoAllocExtend"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert out.returncode == 0, out.stdout[-3000:]
    assert "1 skipped" in out.stdout and "nothing checked: " in out.stdout, out.stdout[-3000:]
    assert "not applicable: decode, pop_preallocated, resume_retracted_reqs, retract" in out.stdout


def test_a_broken_implementation_fails_with_the_verdict_and_selection_files_apply(tmp_path: Path) -> None:
    (tmp_path / "skip").write_text("hisparse_host/P1-*  # not today\nhisparse_host/P7-*  # a typo\n")
    (tmp_path / "xfail").write_text("hisparse_host/P4-H8-R4-C14  # known\n")
    out = run(tmp_path, "-rsx", "--kvproof-skip-file", "skip", "--kvproof-xfail-file", "xfail",
              env={"KVPROOF_IMPL": MUTANT})
    assert out.returncode == 1
    assert "3 failed, 1 skipped, 1 xfailed" in out.stdout, out.stdout[-3000:]
    assert "operations so far" in out.stdout and "not today" in out.stdout
    assert "entry 'hisparse_host/P7-*' matches no test" in out.stdout


def test_kvproof_shrink_vector_shrinks_the_failure_by_its_vector(tmp_path: Path) -> None:
    """``--kvproof-shrink vector``: the verdict of a broken implementation, shrunk by replaying its vector (the same
    run planner as ``kvproof conform --shrink vector``); an unknown shrinker is refused by pytest's option parser."""
    (tmp_path / "shrinkspy.py").write_text(  # a plugin noting every call of the vector shrinker in a file
        "from pathlib import Path\n"
        "from kvproof.conformance import check\n\n"
        "_real = check.shrink\n\n\n"
        "def _noted(vector, replay, **kwargs):\n"
        "    with Path('shrunk.txt').open('a') as f:\n"
        "        f.write(f\"{len(vector['steps'])}\\n\")\n"
        "    return _real(vector, replay, **kwargs)\n\n\n"
        "check.shrink = _noted\n")
    env = {"KVPROOF_IMPL": MUTANT, "PYTHONPATH": str(tmp_path)}
    args = ("-p", "shrinkspy", "--kvproof-config", "P4-H8-R4-C14", "--kvproof-profile", "ci")
    default = run(tmp_path, *args, env=env)
    assert default.returncode == 1 and "1 failed" in default.stdout, default.stdout[-3000:]
    assert not (tmp_path / "shrunk.txt").exists()  # Hypothesis shrank it
    out = run(tmp_path, *args, "--kvproof-shrink", "vector", env=env)
    assert out.returncode == 1 and "1 failed" in out.stdout and "operations so far" in out.stdout, out.stdout[-3000:]
    assert (tmp_path / "shrunk.txt").read_text().strip()  # the vector shrinker did
    bad = run(tmp_path, "--kvproof-shrink", "fast")
    assert bad.returncode == 4 and "invalid choice: 'fast'" in bad.stderr, bad.stderr[-2000:]


def test_report_header_and_summary_name_the_implementation_and_unexercised_rules(tmp_path: Path) -> None:
    """After collection: implementation, version, capabilities, profile, seed; at the end: n/a and never-run rules."""
    (tmp_path / "myhost.py").write_text(
        "from kvproof.gpu_runtime.hisparse_host import HiSparseHostPool\n"
        "from kvproof.reference.contract import Capability\n\n\n"
        "class Lenient(HiSparseHostPool):\n"
        "    capabilities = frozenset({Capability.EXACT_PAGE_ORDER, Capability.ATOMIC_BACKUP_BATCH})\n"
        "    version = 'myhost 1.2'\n")
    out = run(tmp_path, "--kvproof-config", "P4-H8-R4-C14", "--kvproof-impl", "myhost:Lenient",
              env={"PYTHONPATH": str(tmp_path)})
    assert out.returncode == 0, out.stdout[-3000:]
    assert "kvproof: profile dev, seed derandomized (derived from each test)" in out.stdout
    assert ("kvproof: hisparse_host: myhost:Lenient (myhost 1.2); capabilities: atomic_backup_batch, "
            "exact_page_order") in out.stdout
    assert "hisparse_host/P4-H8-R4-C14: passed" in out.stdout
    assert "not applicable (capabilities not declared): misuse" in out.stdout
