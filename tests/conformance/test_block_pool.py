"""The block_pool lockstep suite (vLLM 0.33.0's v1 KV cache manager, docs/block_pool.md): the reference and the
torch runtime pass every config, every misuse case is reachable, and the suite is not vacuous: it reaches prefix
hits, full pools, out-of-window null blocks, evictions and resets."""

from __future__ import annotations

import pytest
import torch

from kvproof.conformance.block_pool import BLOCK_POOL_CONFIGS, SUITE
from kvproof.conformance.check import kill_mutants, run_check
from kvproof.conformance.mutants.block_pool import MUTANTS
from kvproof.conformance.reference_impl import ReferenceBlockPool
from kvproof.gpu_runtime.block_pool import BlockPoolRuntime
from kvproof.reference import block_pool as bp

IDS = [c.label() for c in BLOCK_POOL_CONFIGS]


@pytest.mark.parametrize("config", BLOCK_POOL_CONFIGS, ids=IDS)
def test_reference_conforms_and_reaches_the_interesting_states(config: bp.BlockPoolConfig) -> None:
    report = run_check("block_pool", ReferenceBlockPool, config, profile="ci", impl_name="reference",
                       failures_dir=None)
    assert report.passed, report.failure
    assert report.outcomes["ok"] > 0 and report.outcomes["OutOfMemory"] > 0
    assert report.outcomes["InvalidOperation"] > 0  # misuse cases, rejected alike
    ops = {name for name in report.rules if not name.startswith("misuse")}
    assert ops == set(SUITE.needs(config)) - {"misuse"}, report.rules  # every rule ran
    assert report.structure["pool exhausted"] == 1
    assert report.structure["prefix-cache hit blocks"] >= 1
    if config.sliding_window is not None:
        assert report.structure["null blocks of one request"] >= 1


def test_misuse_cases_are_all_reachable() -> None:
    seen: set[str] = set()
    for config in BLOCK_POOL_CONFIGS:
        report = run_check("block_pool", ReferenceBlockPool, config, profile="ci", failures_dir=None)
        assert report.passed, report.failure
        seen |= {name.split(":", 1)[1] for name, count in report.rules.items() if name.startswith("misuse:") and count}
    assert seen == set(SUITE.misuse_cases)


# ---------------------------------------------------------------- kvproof's runtime and its mutants


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="no CUDA device on this machine"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", BLOCK_POOL_CONFIGS, ids=IDS)
def test_runtime_conforms(config: bp.BlockPoolConfig, device: str) -> None:
    report = run_check("block_pool", lambda cfg: BlockPoolRuntime(cfg, device=device), config, profile="ci",
                       impl_name=f"runtime[{device}]", failures_dir=None)
    assert report.passed, report.failure
    assert report.outcomes["OutOfMemory"] > 0 and report.rules["misuse"] > 0
    assert report.never_run == ()


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutant_is_killed(name: str) -> None:
    (verdict,) = kill_mutants({name: MUTANTS[name]}, component="block_pool", profile="ci")
    assert verdict.killed, f"mutant {name} survived the ci profile on every block_pool config"
    assert "HarnessError" not in verdict.evidence, verdict.evidence


def test_at_least_eight_mutants() -> None:
    assert len(MUTANTS) >= 8


W3 = bp.BlockPoolConfig(block_size=1, num_blocks=9, sliding_window=3, max_model_len=8)


def test_null_block_freed_differs() -> None:
    for cls, queued in ((BlockPoolRuntime, False), (MUTANTS["null_block_freed"], True)):
        pool = cls(W3)
        pool.allocate_slots(1, [1, 2, 3, 4], 0, 4, pool.get_computed_blocks([1, 2, 3, 4]))
        pool.remove_skipped_blocks(1, 4)
        pool.free(1)
        assert (bp.NULL_BLOCK in pool.snapshot().free) is queued


def test_duplicate_free_accepted_differs() -> None:
    for cls, count in ((BlockPoolRuntime, 0), (MUTANTS["duplicate_free_accepted"], -1)):
        pool = cls(bp.BlockPoolConfig(block_size=4, num_blocks=6, max_model_len=16))
        pool.allocate_slots(1, [1, 2, 3], 0, 3)
        pool.free(1)
        pool.free(1)
        assert pool.snapshot().ref_cnt[1] == count


def test_stale_lookup_differs() -> None:
    config = bp.BlockPoolConfig(block_size=2, num_blocks=6, max_model_len=8)
    for cls, hit in ((BlockPoolRuntime, 0), (MUTANTS["stale_lookup"], 2)):
        pool = cls(config)
        pool.allocate_slots(1, [1, 2, 3], 0, 3)
        pool.evict_blocks([1])
        assert pool.get_computed_blocks([1, 2, 3]).num_tokens == hit
