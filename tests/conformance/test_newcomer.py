"""Issue 11, observation 8: the path a newcomer takes, from the README's adapter to a replayed failure.

Each test is a step that went wrong for a user writing an adapter next to their own code:
the console script could not import it, the pytest plugin ran suites the adapter does
not implement without saying why, a failure named a non-importable implementation and
gave no replay command, a bad plugin option printed a traceback, and the README's
numbers did not match what runs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvproof.conformance.check import factory_spec, mutants_of, run_check
from kvproof.conformance.configs import CONFORMANCE_CONFIGS
from kvproof.conformance.errors import ConformanceFailure
from kvproof.conformance.mutants.hisparse_host import ReleaseReversed
from kvproof.conformance.profiles import PROFILES
from kvproof.reference.registry import Component

BIN = Path(sys.executable).parent
README = Path(__file__).resolve().parents[2] / "README.md"
MUTANT = "kvproof.conformance.mutants.hisparse_host:ReleaseReversed"
ADAPTER = ("from kvproof.gpu_runtime.hisparse_host import HiSparseHostPool\n"
           "from kvproof.reference.registry import Component\n\n\n"
           "class MyHost(HiSparseHostPool):\n"
           "{components}")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # exactly what a user's shell has: nothing pointing at their package
    return env


def _adapter(tmp_path: Path, components: str) -> None:
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "adapter.py").write_text(ADAPTER.format(components=components))


def test_the_console_script_finds_an_adapter_in_the_working_directory(tmp_path: Path) -> None:
    """`kvproof conform --impl mypkg.adapter:X` from the directory holding mypkg (it said 'No module named')."""
    _adapter(tmp_path, "    components = frozenset({Component.HISPARSE_HOST})\n")
    out = subprocess.run([str(BIN / "kvproof"), "conform", "--impl", "mypkg.adapter:MyHost", "--config",
                          "P4-H8-R4-C14", "--profile", "dev"], cwd=tmp_path, env=_env(), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "hisparse_host" in out.stdout and "pass" in out.stdout


def test_an_adapter_that_cannot_be_imported_gets_a_hint(tmp_path: Path) -> None:
    out = subprocess.run([str(BIN / "kvproof"), "conform", "--impl", "nosuchpkg.adapter:X"], cwd=tmp_path,
                         env=_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert "No module named 'nosuchpkg'" in out.stdout and "PYTHONPATH" in out.stdout


def _plugin(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "pytest"), "-q", "-p", "no:cacheprovider", "--pyargs", "kvproof.conformance.suite",
                           "--kvproof-profile", "dev", *args], cwd=tmp_path, capture_output=True, text=True,
                          env={**_env(), **(env or {})}, timeout=600)


def test_the_plugin_runs_the_declared_components_only_and_warns_about_an_undeclared_adapter(tmp_path: Path) -> None:
    _adapter(tmp_path, "    components = frozenset({Component.HISPARSE_HOST})\n")
    out = _plugin(tmp_path, "--kvproof-impl", "mypkg.adapter:MyHost", "--kvproof-config", "P4-H8-R4-C14")
    assert out.returncode == 0, out.stdout[-3000:]
    assert "1 passed" in out.stdout and "error" not in out.stdout.lower()
    (tmp_path / "mypkg" / "plain.py").write_text(  # a function factory: it declares nothing
        "from kvproof.gpu_runtime.hisparse_host import HiSparseHostPool\n\n\n"
        "def host(config):\n    return HiSparseHostPool(config)\n")
    out = _plugin(tmp_path, "--kvproof-impl", "mypkg.plain:host", "--kvproof-config", "P4-H8-R4-C14")
    assert "mypkg.plain:host declares no `components`, so it runs every suite" in out.stdout, out.stdout[-3000:]


def test_a_plugin_failure_names_the_impl_spec_and_prints_the_replay_command(tmp_path: Path) -> None:
    out = _plugin(tmp_path, "--kvproof-component", "hisparse_host", "--kvproof-config", "P4-H8-R4-C14",
                  env={"KVPROOF_IMPL": MUTANT})
    assert out.returncode == 1, out.stdout[-3000:]
    assert f"{MUTANT} [hisparse_host/P4-H8-R4-C14]" in out.stdout
    replay = re.search(r"replay without Hypothesis: kvproof replay (\S+\.json) --impl (\S+)", out.stdout)
    assert replay is not None, out.stdout[-3000:]
    assert replay.group(2) == MUTANT
    done = subprocess.run([str(BIN / "kvproof"), "replay", replay.group(1), "--impl", replay.group(2)],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "FAIL" in done.stdout, done.stdout[-2000:]


def test_bad_plugin_input_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    out = _plugin(tmp_path, "--kvproof-component", "hisparse_host", "--kvproof-config", "P1-H6-R3")
    assert out.returncode != 0
    assert "kvproof: unknown config(s) ['P1-H6-R3']; choose from" in out.stdout
    assert "Traceback" not in out.stdout and "pytest_plugin.py:" not in out.stdout, out.stdout[-3000:]


def test_a_plugin_seed_with_a_derandomized_profile_is_refused(tmp_path: Path) -> None:
    """As `kvproof conform --seed` with `ci` or `dev`: refused, never silently ignored."""
    out = _plugin(tmp_path, "--kvproof-component", "hisparse_host", "--kvproof-seed", "7")
    assert out.returncode != 0
    assert "kvproof: --kvproof-seed 7: profile dev is derandomized" in out.stdout, out.stdout[-3000:]


def test_the_plugin_can_also_be_named_with_dash_p(tmp_path: Path) -> None:
    """`-p kvproof.conformance.pytest_plugin` (the module's name) is the registered plugin, not a clash."""
    out = _plugin(tmp_path, "-p", "kvproof.conformance.pytest_plugin", "--kvproof-component", "hisparse_host",
                  "--kvproof-config", "P4-H8-R4-C14")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "1 passed" in out.stdout


class Leaky:  # an importable factory: a free list that loses the last page on every free
    components = frozenset({Component.HISPARSE_HOST})

    def __new__(cls, config: object) -> object:
        return ReleaseReversed(config)


def test_the_python_api_names_the_factory_by_its_impl_spec_and_says_how_to_replay(tmp_path: Path) -> None:
    from kvproof.conformance.check import check
    from kvproof.conformance.hisparse_host import SUITE

    assert factory_spec(Leaky) == f"{__name__}:Leaky"
    with pytest.raises(ConformanceFailure) as caught:
        check("hisparse_host", Leaky, SUITE.configs[3], profile="dev", failures_dir=tmp_path)
    text = str(caught.value)
    assert text.startswith(f"{__name__}:Leaky [hisparse_host/{SUITE.configs[3].label()}]")
    assert f"--impl {__name__}:Leaky" in text

    def local(config: object) -> object:
        return Leaky(config)

    assert "(not importable: replay it with replay_vector)" in factory_spec(local)
    report = run_check("hisparse_host", local, SUITE.configs[3], profile="dev", failures_dir=tmp_path)
    vector = json.loads(Path(str(report.failure_file)).with_suffix(".json").read_text())
    assert "not importable" in vector["impl"]


def test_the_readme_counts_match_what_runs() -> None:
    """Mutant counts, profile sizes: the README says what `kvproof mutants` and the profiles do."""
    text = " ".join(README.read_text().split())
    total = sum(len(mutants_of(c)) for c in Component)
    assert f"runs the suites against {total} deliberately broken runtimes" in text
    kinds = "allocator|cache|decode-node|host-pool|admission|prefetch|block-pool"
    for count, what in re.findall(rf"(\d+) ({kinds}) mutants", text):
        component = {"allocator": "swa_allocator", "cache": "loc_cache", "decode-node": "decode_prealloc",
                     "host-pool": "hisparse_host", "admission": "admission", "prefetch": "tp_prefetch",
                     "block-pool": "block_pool"}[what]
        assert int(count) == len(mutants_of(component)), (what, count)
    for name, profile in PROFILES.items():
        size = f"{profile.max_examples} examples × {profile.stateful_step_count} steps"
        assert re.search(rf"`{name}` \([^)]*{size}", text), (name, size)


def test_examples_and_calls_add_up_as_the_readme_says() -> None:
    """`examples` counts every test case run (at least the profile's valid ones); outcome columns sum to `calls`."""
    from kvproof.gpu_runtime import SWATokenToKVPoolAllocator

    report = run_check("swa_allocator", SWATokenToKVPoolAllocator, CONFORMANCE_CONFIGS[0], profile="ci",
                       failures_dir=None)
    assert report.passed
    assert report.examples >= PROFILES["ci"].max_examples
    assert sum(report.outcomes.values()) == sum(report.calls.values())
