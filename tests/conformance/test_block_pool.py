"""The block_pool lockstep suite (vLLM 0.33.0's v1 KV cache manager, docs/block_pool.md): the reference and the
torch runtime pass every config, every misuse case is reachable, and the suite is not vacuous: it reaches prefix
hits, full pools, out-of-window null blocks, evictions and resets."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from kvproof.conformance.block_pool import BLOCK_POOL_CONFIGS, SUITE
from kvproof.conformance.check import kill_mutants, run_check
from kvproof.conformance.mutants.block_pool import MUTANTS
from kvproof.conformance.reference_impl import ReferenceBlockPool
from kvproof.gpu_runtime.block_pool import BlockPoolRuntime
from kvproof.reference import block_pool as bp
from kvproof.reference.contract import Capability
from kvproof.reference.errors import OutOfMemory

from ..devices import DEVICES
from .runtime_runs import group, runtime_run

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


@group("block_pool")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", BLOCK_POOL_CONFIGS, ids=IDS)
def test_runtime_conforms(config: bp.BlockPoolConfig, device: str) -> None:
    report = runtime_run("block_pool", config, device)
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


#: mutants that only change which free block is handed out next: vLLM's order, a policy without EXACT_PAGE_ORDER
REUSE_ORDER_ONLY = {"uncached_appended", "free_in_order"}


def _unordered(cls: type[BlockPoolRuntime]) -> type[BlockPoolRuntime]:
    """``cls`` without ``EXACT_PAGE_ORDER``: the suite follows its reuse order."""
    return type(f"{cls.__name__}Unordered", (cls,),
                {"capabilities": cls.capabilities - {Capability.EXACT_PAGE_ORDER}})


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_without_exact_order_every_mutant_but_a_reuse_order_is_killed(name: str) -> None:
    """The suite followed (no EXACT_PAGE_ORDER) still kills every mutant that breaks more than the reuse order, and
    accepts the two that change only the order, on every config: another legal reuse policy."""
    (verdict,) = kill_mutants({name: _unordered(MUTANTS[name])}, component="block_pool", profile="ci")
    assert "HarnessError" not in verdict.evidence, verdict.evidence
    assert verdict.killed is (name not in REUSE_ORDER_ONLY), verdict.evidence


@pytest.mark.parametrize("config", BLOCK_POOL_CONFIGS, ids=IDS)
def test_without_exact_order_the_runtime_conforms(config: bp.BlockPoolConfig) -> None:
    report = run_check("block_pool", _unordered(BlockPoolRuntime), config, profile="ci", impl_name="runtime-unordered",
                       failures_dir=None)
    assert report.passed, report.failure
    assert report.outcomes["OutOfMemory"] > 0 and report.never_run == ()


class _TakesAHeldBlock(BlockPoolRuntime):
    """Hands out, as a request's last new block, a block another request holds (no EXACT_PAGE_ORDER: the suite
    follows which block it takes, and must refuse one that is not free)."""

    capabilities = frozenset({Capability.REJECTS_MISUSE})

    def allocate_slots(self, *args: Any, **kwargs: Any) -> tuple[tuple[int, ...], ...]:
        new = super().allocate_slots(*args, **kwargs)
        held = [x for x in range(1, self.config.num_blocks) if int(self.ref_cnt[x]) > 0]
        if new[0] and held and held[0] not in new[0]:
            return (new[0][:-1] + (held[0],), *new[1:])
        return new


class _OtherKeysHit(BlockPoolRuntime):
    """A lookup that answers, for its last full-attention block, a cached block of another key whose tokens happen
    to be the same (no EXACT_PAGE_ORDER): the suite's ghost KV cannot tell, its key check must."""

    capabilities = frozenset({Capability.REJECTS_MISUSE})

    def get_computed_blocks(self, tokens: Sequence[int], max_cache_hit_length: int | None = None) -> bp.Hit:
        hit = super().get_computed_blocks(tokens, max_cache_hit_length)
        snap = self.snapshot()
        if not hit.blocks[0]:
            return hit
        last = hit.blocks[0][-1]
        b, mine = self.config.block_size, snap.block_key[last]
        same = [x for x, key in enumerate(snap.block_key)
                if key is not None and mine is not None and key != mine and key[0] == bp.FULL
                and key[1][-b:] == mine[1][-b:]]
        if not same:
            return hit
        blocks = (hit.blocks[0][:-1] + (same[0],), *hit.blocks[1:])
        return bp.Hit(blocks=blocks, num_tokens=hit.num_tokens)


@pytest.mark.parametrize(("cls", "expected"), [(_TakesAHeldBlock, "which are not free blocks of the pool"),
                                               (_OtherKeysHit, "the reference caches that prefix in blocks")],
                         ids=["takes_a_held_block", "other_keys_hit"])
def test_without_exact_order_a_wrong_choice_is_caught(cls: type[BlockPoolRuntime], expected: str) -> None:
    (verdict,) = kill_mutants({cls.__name__: cls}, component="block_pool", profile="ci")
    assert verdict.killed and "HarnessError" not in verdict.evidence, verdict.evidence
    assert expected in verdict.evidence, verdict.evidence


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


def test_free_hit_uncharged_differs() -> None:
    config = bp.BlockPoolConfig(block_size=2, num_blocks=5, max_model_len=8)
    for cls, refused in ((BlockPoolRuntime, True), (MUTANTS["free_hit_uncharged"], False)):
        pool = cls(config)
        pool.allocate_slots(1, [1, 2, 3, 4, 5], 0, 5)
        pool.free(1)
        pool.allocate_slots(2, [9, 9, 9], 0, 3)
        hit = pool.get_computed_blocks([1, 2, 3, 4, 5, 6, 7])
        assert hit.num_tokens == 4
        if refused:
            with pytest.raises(OutOfMemory):
                pool.allocate_slots(3, [1, 2, 3, 4, 5, 6, 7], 0, 3, hit)
        else:
            (blocks,) = pool.allocate_slots(3, [1, 2, 3, 4, 5, 6, 7], 0, 3, hit)
            assert set(blocks) & set(hit.blocks[0]), blocks  # a block of its own hit handed out again


def test_the_r3_boundary_is_counted_exactly_where_a_count_without_the_charge_diverges() -> None:
    """The structure dimension "admission refused for its hit's free blocks" says the run reached the boundary that
    free_hit_uncharged gets wrong. The mutant behaves as the runtime until that boundary, so under the same examples
    it must be killed on exactly the configs where the runtime's run counts it (a count that also took refusals the
    charge did not decide would name configs where the mutant survives), and on at least one."""
    dim = "admission refused for its hit's free blocks"
    reached, killed = set(), set()
    for config in BLOCK_POOL_CONFIGS:
        runtime = run_check("block_pool", BlockPoolRuntime, config, profile="ci", impl_name="runtime",
                            failures_dir=None, isolation="in-process")
        assert runtime.passed, runtime.failure
        # the same examples; the failure shrunk by its vector (this test asks whether, not how short)
        mutant = run_check("block_pool", MUTANTS["free_hit_uncharged"], config, profile="ci",
                           impl_name="mutant free_hit_uncharged", failures_dir=None, isolation="in-process",
                           shrink_with="vector")
        if runtime.structure.get(dim, 0):
            reached.add(config.label())
        if not mutant.passed:
            assert "LockstepFailure" in (mutant.failure or ""), mutant.failure
            killed.add(config.label())
    assert reached, f"no config reaches {dim!r}"
    assert reached == killed, f"{dim!r} reached on {sorted(reached)}; the mutant killed on {sorted(killed)}"


@pytest.mark.parametrize("config", BLOCK_POOL_CONFIGS, ids=lambda c: c.label())
def test_the_longest_request_declared_is_the_longest_one_request_alone_reaches(config: bp.BlockPoolConfig) -> None:
    """The structure dimension "blocks of one request" declares the most a request can hold on ``config``: what one
    request alone reaches computing one token a step (the fewest window blocks held per full block; the pool's other
    requests and a prefix hit only take blocks away). A declared maximum it cannot reach would report every run
    below it (B1-N9-W3-L8 once declared 6: the window's blocks a request holds include the new token's own)."""
    state, tokens, longest = bp.initial_state(config), list(range(1, config.max_model_len + 1)), 0
    for computed in range(config.max_model_len):
        try:
            state, _ = bp.allocate_slots(state, 0, tokens, computed, 1)
        except OutOfMemory:
            break
        longest = max(longest, len(bp.get_block_ids(state, 0)[bp.FULL]))
    assert SUITE.machine.structure(config)["blocks of one request"] == longest
