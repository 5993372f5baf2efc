"""Replayable vectors: every suite's failure replays without Hypothesis, from JSON, on any implementation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvproof.cli import main
from kvproof.conformance.check import replay_vector, run_check
from kvproof.conformance.configs import CONFORMANCE_CONFIGS
from kvproof.conformance.decode_prealloc import DEFAULT_DECODE_CONFIG
from kvproof.conformance.hisparse_host import HOST_CONFIGS
from kvproof.conformance.mutants.hisparse_host import MUTANTS as HOST_MUTANTS
from kvproof.conformance.mutants.loc_cache import MUTANTS as CACHE_MUTANTS
from kvproof.conformance.mutants.swa_allocator import MUTANTS as ALLOCATOR_MUTANTS
from kvproof.conformance.vector import VectorError, load_vector
from kvproof.gpu_runtime.hisparse_host import HiSparseHostPool
from kvproof.gpu_runtime.swa_allocator import SWATokenToKVPoolAllocator
from kvproof.reference.decode_prealloc import PreallocPolicy

P4W6 = next(c for c in CONFORMANCE_CONFIGS if c.label() == "P4-W6-F48-S24")
CASES = {
    "swa_allocator": (ALLOCATOR_MUTANTS["stale_tail_mapping"], SWATokenToKVPoolAllocator, CONFORMANCE_CONFIGS),
    "loc_cache": (CACHE_MUTANTS["no_invalidate_register_mapping"], SWATokenToKVPoolAllocator, CONFORMANCE_CONFIGS),
    "hisparse_host": (HOST_MUTANTS["release_reversed"], HiSparseHostPool, HOST_CONFIGS[3:4]),
}


def _roundtrip(vector: dict | None) -> dict:
    assert vector is not None
    return json.loads(json.dumps(vector))


@pytest.mark.parametrize("component", sorted(CASES))
def test_failure_vector_replays_on_the_mutant_and_passes_on_the_runtime(component: str) -> None:
    mutant, runtime, configs = CASES[component]
    for config in configs:  # the first config the suite kills the mutant on
        report = run_check(component, mutant, config, profile="ci", impl_name="mutant", failures_dir=None)
        if not report.passed:
            break
    assert not report.passed
    vector = _roundtrip(report.vector)
    assert vector["steps"] and vector["config"]["label"] == config.label()
    again = replay_vector(vector, mutant)
    assert not again.passed and again.steps <= len(vector["steps"])
    assert vector["verdict"] in (again.failure or "")  # the same divergence, without Hypothesis
    assert replay_vector(vector, runtime).passed


def test_decode_vector_keeps_its_policy() -> None:
    """The machine options (the upstream admission policy) travel with the vector."""
    upstream = DEFAULT_DECODE_CONFIG.model_copy(update={"policy": PreallocPolicy.UPSTREAM})
    report = run_check("decode_prealloc", SWATokenToKVPoolAllocator, P4W6, profile="ci", failures_dir=None,
                       decode_config=upstream)
    vector = _roundtrip(report.vector)
    assert vector["machine_options"]["decode_config"]["policy"] == "upstream"
    again = replay_vector(vector, SWATokenToKVPoolAllocator)
    assert not again.passed and "D1 violated" in (again.failure or "")


def test_cli_replay_and_bad_vectors(tmp_path) -> None:
    report = run_check("hisparse_host", HOST_MUTANTS["release_reversed"], HOST_CONFIGS[3], profile="ci",
                       failures_dir=tmp_path)
    path = report.failure_file.rsplit(".", 1)[0] + ".json"
    runner = CliRunner()
    bad = runner.invoke(main, ["replay", path, "--impl", "kvproof.conformance.mutants.hisparse_host:ReleaseReversed"])
    assert bad.exit_code == 1 and "FAIL" in bad.output
    good = runner.invoke(main, ["replay", path, "--impl", "kvproof.gpu_runtime.hisparse_host:HiSparseHostPool"])
    assert good.exit_code == 0, good.output
    recorded = runner.invoke(main, ["replay", path])  # the vector names its implementation: replayed on it
    assert recorded.exit_code == 1 and "FAIL" in recorded.output
    assert "replaying on kvproof.conformance.mutants.hisparse_host:ReleaseReversed" in recorded.output
    vector = json.loads(Path(path).read_text())
    Path(path).write_text(json.dumps({**vector, "impl": "impl"}))  # recorded under a name that imports nothing
    unnamed = runner.invoke(main, ["replay", path])
    assert unnamed.exit_code == 2 and "--impl" in unnamed.output
    (tmp_path / "junk.json").write_text('{"format": "something-else"}')
    assert runner.invoke(main, ["replay", str(tmp_path / "junk.json")]).exit_code == 2
    with pytest.raises(VectorError, match="not JSON"):
        load_vector("{not json")


def test_a_step_that_no_longer_applies_is_reported() -> None:
    report = run_check("hisparse_host", HOST_MUTANTS["release_reversed"], HOST_CONFIGS[3], profile="ci",
                       failures_dir=None)
    vector = _roundtrip(report.vector)
    vector["steps"].insert(0, {"rule": "request_finished", "args": {}, "draws": [0]})  # nothing is running yet
    with pytest.raises(VectorError, match="step 1: rule request_finished is not applicable"):
        replay_vector(vector, HiSparseHostPool)
