"""The same command and seed give the same examples, whichever entry point runs them and whatever was imported first.

A run's ``fingerprint`` digests every example's recorded steps (rules, arguments, draws).
It must be equal from the Python API, the CLI and the pytest plugin, for a derandomized
profile and for a randomized one with ``--seed``, and must not change when the process
imported other local modules first (Hypothesis harvests constants from them; see
``kvproof.conformance.generation``). The last test shows that hazard is real: without
the pinning, a local module full of integers changes the examples.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from kvproof.conformance.check import run_check
from kvproof.conformance.generation import forced_seed
from kvproof.conformance.hisparse_host import HOST_CONFIGS
from kvproof.gpu_runtime.hisparse_host import HiSparseHostPool

BIN = Path(sys.executable).parent
CONFIG = next(c for c in HOST_CONFIGS if c.label() == "P4-H8-R4-C14")
SCRIPT = """
import sys
{preamble}
from kvproof.conformance.check import run_check
from kvproof.conformance.generation import forced_seed
from kvproof.conformance.hisparse_host import HOST_CONFIGS
from kvproof.gpu_runtime.hisparse_host import HiSparseHostPool
config = next(c for c in HOST_CONFIGS if c.label() == "P4-H8-R4-C14")
with forced_seed({seed}, {derandomized}):
    report = run_check("hisparse_host", HiSparseHostPool, config, profile="{profile}", failures_dir=None)
print(report.fingerprint)
"""
#: a user's local module: integers Hypothesis would harvest as constants
LOCAL_MODULE = "LIMITS = [" + ", ".join(str(n) for n in range(3, 400, 7)) + "]\nNAMES = ['alpha', 'beta']\n"


def _python(tmp_path: Path, profile: str, seed: int | None, preamble: str = "") -> str:
    (tmp_path / "usercode.py").write_text(LOCAL_MODULE)
    code = SCRIPT.format(preamble=preamble, seed=seed, derandomized=seed is None, profile=profile)
    out = subprocess.run([str(BIN / "python"), "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         timeout=600, check=False, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def _cli(tmp_path: Path, profile: str, seed: int | None) -> str:
    report = tmp_path / "cli.json"
    args = [str(BIN / "kvproof"), "conform", "--component", "hisparse_host", "--config", CONFIG.label(),
            "--profile", profile, "--json-report", str(report), *(["--seed", str(seed)] if seed is not None else [])]
    out = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stdout[-2000:]
    (result,) = json.loads(report.read_text())["results"]
    return str(result["fingerprint"])


def _plugin(tmp_path: Path, profile: str, seed: int | None) -> str:
    xml = tmp_path / "plugin.xml"
    args = [str(BIN / "pytest"), "-q", "-p", "no:cacheprovider", "--pyargs", "kvproof.conformance.suite",
            "--kvproof-component", "hisparse_host", "--kvproof-config", CONFIG.label(), "--kvproof-profile", profile,
            f"--junitxml={xml}", *(["--kvproof-seed", str(seed)] if seed is not None else [])]
    out = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stdout[-2000:]
    props = {p.get("name"): p.get("value") for p in ET.parse(xml).getroot().iter("property")}
    return str(props["kvproof.fingerprint"])


def _api(profile: str, seed: int | None) -> str:
    with forced_seed(seed, seed is None):
        return run_check("hisparse_host", HiSparseHostPool, CONFIG, profile=profile, failures_dir=None).fingerprint


@pytest.mark.parametrize(("profile", "seed"), [("dev", None), ("smoke", 1234)], ids=["derandomized", "seeded"])
def test_every_entry_point_gives_the_same_examples(tmp_path: Path, profile: str, seed: int | None) -> None:
    expected = _api(profile, seed)  # this process has imported the whole test suite
    assert len(expected) == 64
    runs = {
        "python, nothing else imported": _python(tmp_path, profile, seed),
        "python, the CLI, the spec and a local module imported first": _python(
            tmp_path, profile, seed, "import kvproof.cli, kvproof.cli.bench, kvproof.spec, usercode"),
        "kvproof conform": _cli(tmp_path, profile, seed),
        "pytest --pyargs kvproof.conformance.suite": _plugin(tmp_path, profile, seed),
    }
    assert runs == dict.fromkeys(runs, expected)


def test_another_seed_gives_other_examples() -> None:
    assert _api("smoke", 1234) != _api("smoke", 4321)


def test_without_the_pinning_a_local_module_changes_the_examples(tmp_path: Path) -> None:
    """The hazard kvproof.conformance.generation removes: Hypothesis draws constants from loaded local modules."""
    unpinned = "import contextlib, kvproof.conformance.check as c; c.stable_generation = contextlib.nullcontext"
    plain = _python(tmp_path, "dev", None, unpinned)
    with_local = _python(tmp_path, "dev", None, unpinned + "\nimport usercode")
    assert plain != with_local


def test_the_heap_is_frozen_during_a_run_only_and_changes_no_example(monkeypatch: pytest.MonkeyPatch) -> None:
    """``run_check`` leaves the objects that exist before it out of the collector's passes while it runs (a default-mode
    run spent about 10 % of its time in full collections) and gives them back after; the examples are the same as a
    run's with the collector untouched."""
    import contextlib
    import gc

    from kvproof.conformance import check

    frozen_at: list[int] = []

    class Recording(HiSparseHostPool):
        def __init__(self, config: object) -> None:
            frozen_at.append(gc.get_freeze_count())
            super().__init__(config)

    before = gc.get_freeze_count()
    frozen = run_check("hisparse_host", Recording, CONFIG, profile="ci", failures_dir=None, isolation="in-process")
    assert frozen.passed and len(frozen_at) > 1 and min(frozen_at[1:]) > before  # [0]: the probe, before the run
    assert gc.get_freeze_count() == before  # given back
    monkeypatch.setattr(check, "_heap_frozen", contextlib.nullcontext)
    plain = run_check("hisparse_host", Recording, CONFIG, profile="ci", failures_dir=None, isolation="in-process")
    assert (plain.fingerprint, plain.steps, plain.examples) == (frozen.fingerprint, frozen.steps, frozen.examples)
