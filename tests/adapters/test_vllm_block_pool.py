"""The vLLM 0.33.0 KV cache manager adapter (``kvproof.conformance.adapters.vllm_block_pool``): importable without
vLLM, and, where vLLM is installed (``.venv-vllm``), the real ``KVCacheManager`` behind the ``block_pool`` protocol:
a hand-driven sequence whose every snapshot equals the reference's, a ``ci`` lockstep run per ``BLOCK_POOL_CONFIGS``
config, a check that those runs reach what the suite is for (hits, full pools, out-of-window null blocks,
evictions, resets), and the documented behaviours of docs/vllm-findings.md.

Tests that need vLLM are skipped with one reason when it is not importable (the main ``.venv`` has no vLLM on
purpose).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import pytest

from kvproof.conformance.adapters import vllm_block_pool as adapter
from kvproof.conformance.block_pool import BLOCK_POOL_CONFIGS
from kvproof.conformance.check import CheckReport, run_check
from kvproof.conformance.reference_impl import ReferenceBlockPool
from kvproof.reference import block_pool as bp
from kvproof.reference.contract import BlockPoolUnderTest, Capability
from kvproof.reference.errors import InvalidOperation, OutOfMemory
from kvproof.reference.registry import Component

SKIP_REASON = (f"vLLM is not installed in this environment ({sys.executable}); these tests run where vLLM "
               f"{adapter.VLLM_VERSION} (CPU) is: .venv-vllm/bin/pytest tests/adapters/test_vllm_block_pool.py")
C = Capability
IDS = [c.label() for c in BLOCK_POOL_CONFIGS]
SWA_CFG = bp.BlockPoolConfig(block_size=4, num_blocks=13, sliding_window=6, max_model_len=16)
FULL_CFG = bp.BlockPoolConfig(block_size=4, num_blocks=9, max_model_len=16)


# ---------------------------------------------------------------- without vLLM (any venv)


def test_importing_the_adapter_does_not_import_vllm() -> None:
    code = ("import sys, kvproof.conformance.adapters.vllm_block_pool; "
            "assert 'vllm' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_constructing_without_vllm_names_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(adapter, "_LOADED", None)
    monkeypatch.setattr(adapter, "vllm_available", lambda: False)
    with pytest.raises(ImportError, match=r"vLLM 0\.33\.0") as err:
        adapter.VLLMBlockPool(SWA_CFG)
    assert "make vllm" in str(err.value) and "install_vllm" in str(err.value)


def test_capabilities_are_declared() -> None:
    """EXACT_PAGE_ORDER only: vLLM does not reject the suite's misuse cases (docs/vllm-findings.md)."""
    assert adapter.VLLMBlockPool.capabilities == frozenset({C.EXACT_PAGE_ORDER})
    assert adapter.VLLMBlockPool.components == frozenset({Component.BLOCK_POOL})


# ---------------------------------------------------------------- with vLLM


@pytest.fixture(scope="module")
def vllm() -> adapter.VLLMModules:
    pytest.importorskip("vllm", reason=SKIP_REASON)
    return adapter.load_vllm()


class Both:
    """The same calls on the adapter and on the reference, the snapshots compared after each."""

    def __init__(self, config: bp.BlockPoolConfig) -> None:
        self.impl, self.ref = adapter.VLLMBlockPool(config), ReferenceBlockPool(config)
        self.same()

    def same(self) -> bp.BlockPoolSnapshot:
        snap = self.impl.snapshot()
        bp.check_snapshot(snap, self.impl.config)
        assert snap == self.ref.snapshot()
        assert self.impl.get_num_free_blocks() == self.ref.get_num_free_blocks()
        return snap

    def do(self, name: str, *args: Any, **kwargs: Any) -> Any:
        theirs = getattr(self.impl, name)(*args, **kwargs)
        mine = getattr(self.ref, name)(*args, **kwargs)
        assert theirs == mine, name
        self.same()
        return theirs

    def admit(self, req: int, tokens: Sequence[int], n: int | None = None, must_fit: bool = False) -> Any:
        hit = self.do("get_computed_blocks", tokens)
        n = len(tokens) - hit.num_tokens if n is None else n
        return hit, self.do("allocate_slots", req, tokens, 0, n, hit, must_fit)

    def step(self, req: int, tokens: Sequence[int], computed: int, n: int) -> Any:
        self.do("remove_skipped_blocks", req, computed)  # as the lockstep rule: the release first
        return self.do("allocate_slots", req, tokens, computed, n)


def test_adapter_builds_the_real_manager_and_meets_the_protocol(vllm: adapter.VLLMModules) -> None:
    impl = adapter.VLLMBlockPool(SWA_CFG)
    assert isinstance(impl, BlockPoolUnderTest)
    assert type(impl.manager) is vllm.KVCacheManager
    assert type(impl.manager.coordinator).__name__ == "HybridKVCacheCoordinator"
    assert [type(m).__name__ for m in impl.manager.coordinator.single_type_managers] == [
        "FullAttentionManager", "SlidingWindowManager"]
    assert impl.block_pool.null_block is impl.block_pool.blocks[0]
    assert impl.snapshot() == bp.snapshot(bp.initial_state(SWA_CFG))
    full = adapter.VLLMBlockPool(FULL_CFG)
    assert type(full.manager.coordinator).__name__ == "UnitaryKVCacheCoordinator"


@pytest.mark.parametrize("config", BLOCK_POOL_CONFIGS, ids=IDS)
def test_the_admission_cap_is_the_references(vllm: adapter.VLLMModules, config: bp.BlockPoolConfig) -> None:
    """vLLM's per-request SWA cap (``max_in_flight_tokens=None`` -> ``max_model_len``, KVCacheManager.__init__) is
    the reference's ``cdiv(min(W - 1 + T, L), B) + 1`` with ``T = max_in_flight_tokens or L``."""
    managers = adapter.VLLMBlockPool(config).manager.coordinator.single_type_managers
    assert [m.max_admission_blocks_per_request for m in managers] == [
        bp.max_admission_blocks_per_request(config, g) for g in config.groups]


def test_hand_driven_sequence_matches_the_reference(vllm: adapter.VLLMModules) -> None:
    """Allocation, the free order, a hit with a null block, out-of-window release, eviction, a refusal, reset."""
    s = Both(SWA_CFG)  # B4, 12 usable blocks, W6: a hit needs cdiv(5, 4) = 2 cached blocks in a row
    a = list(range(1, 14))  # 13 tokens: 4 blocks per group, 3 full ones cached
    hit, new = s.admit(1, a)
    assert hit.num_tokens == 0 and new == ((1, 2, 3, 4), (5, 6, 7, 8))
    snap = s.same()
    assert snap.num_cached[1] == (3, 3) and len(snap.cached) == 6
    s.do("free", 1)  # per group, last first: the uncached tails to the front, the cached blocks to the back
    assert s.same().free == (8, 4, 9, 10, 11, 12, 3, 2, 1, 7, 6, 5)
    # a sibling: 12 of its tokens hit; the SWA hit is the last 2 blocks of the window, block 0 of it the null block
    b = [*a[:12], 99, 100]
    hit, new = s.admit(2, b)
    assert hit == bp.Hit(blocks=((1, 2, 3), (0, 6, 7)), num_tokens=12)
    assert new == ((8,), (4,))
    assert s.same().requests[2] == ((1, 2, 3, 8), (0, 6, 7, 4))
    # decode past the window: SWA block 6 leaves it and is released (null) before the step
    b.append(101)
    assert s.step(2, b, 14, 1) == ((), ())
    b.append(102)
    s.step(2, b, 15, 1)
    assert s.same().requests[2][1][:2] == (0, 0)
    # evict a cached block held by the request, and one that is free: keys go, counts and queue places stay
    s.do("evict_blocks", [1, 5])
    assert s.same().block_key[1] is None and s.same().block_key[5] is None
    # a request the free blocks cannot hold (the admission gate): OutOfMemory on both sides, nothing changed
    c = list(range(500, 516))
    with pytest.raises(OutOfMemory):
        s.impl.allocate_slots(3, c, 0, 16, s.impl.get_computed_blocks(c), full_sequence_must_fit=True)
    with pytest.raises(OutOfMemory):
        s.ref.allocate_slots(3, c, 0, 16, s.ref.get_computed_blocks(c), full_sequence_must_fit=True)
    s.same()
    assert s.do("reset_prefix_cache") is False  # request 2 still holds blocks
    s.do("free", 2)
    s.do("free", 3)  # refused, holds nothing: nothing to free
    assert s.do("reset_prefix_cache") is True
    assert not s.same().cached


def test_oom_names_vllms_own_count(vllm: adapter.VLLMModules) -> None:
    s = Both(FULL_CFG)  # 8 usable blocks of 4
    s.admit(1, list(range(1, 17)), n=16)  # 4 blocks
    s.admit(2, list(range(100, 113)), n=12)  # 3 blocks: 1 free
    c = list(range(200, 212))
    with pytest.raises(OutOfMemory, match=r"needs 3 page\(s\) for request 3, 1 free"):
        s.impl.allocate_slots(3, c, 0, 12, s.impl.get_computed_blocks(c))
    with pytest.raises(OutOfMemory, match=r"needs 4 page\(s\) for request 3, 1 free"):  # the admission gate's
        s.impl.allocate_slots(3, [*c, 212, 213, 214, 215], 0, 1, s.impl.get_computed_blocks(c), True)
    s.same()


def test_misuse_vllm_checks_and_what_it_does_not(vllm: adapter.VLLMModules) -> None:
    """vLLM rejects a step with nothing to compute (ValueError -> InvalidOperation); it asserts on a block id past
    the pool; a request's tokens that do not extend the known ones are the adapter's InvalidOperation."""
    impl = adapter.VLLMBlockPool(SWA_CFG)
    tokens = list(range(1, 9))
    impl.allocate_slots(1, tokens, 0, 4, impl.get_computed_blocks(tokens))
    before = impl.snapshot()
    with pytest.raises(InvalidOperation, match="num_new_tokens must be greater than 0"):
        impl.allocate_slots(1, tokens, 4, 0)
    with pytest.raises(AssertionError, match="Invalid block_id 13 >= 13"):
        impl.evict_blocks([13])
    with pytest.raises(InvalidOperation, match="do not extend them"):
        impl.allocate_slots(1, [7, *tokens[1:]], 4, 1)
    assert impl.snapshot() == before


def test_a_refused_step_releases_out_of_window_blocks_first(vllm: adapter.VLLMModules) -> None:
    """D1 (docs/vllm-findings.md): vLLM's ``allocate_slots`` runs ``remove_skipped_blocks`` before its capacity
    check, so its ``None`` can change the state; the suite calls the release first (as the reference documents)."""
    impl = adapter.VLLMBlockPool(bp.BlockPoolConfig(block_size=4, num_blocks=7, sliding_window=6, max_model_len=16))
    a = list(range(1, 13))
    assert impl.allocate_slots(1, a, 0, 12, impl.get_computed_blocks(a)) == ((1, 2, 3), (4, 5, 6))
    before = impl.snapshot()
    with pytest.raises(OutOfMemory, match=r"needs 2 page\(s\) for request 1, 1 free"):
        impl.allocate_slots(1, [*a, 13], 12, 1)  # no remove_skipped_blocks first
    after = impl.snapshot()
    assert before.free == () and after.free == (4,)
    assert after.requests[1] == ((1, 2, 3), (0, 5, 6))


def test_reference_allocate_slots_releases_like_vllm_without_a_separate_release(vllm: adapter.VLLMModules) -> None:
    """vLLM's scheduler calls ``allocate_slots`` for a running request with no release before it
    (scheduler.py:914): the release inside it (kv_cache_manager.py:564) must show in the block lists it leaves."""
    config = bp.BlockPoolConfig(block_size=4, num_blocks=8, sliding_window=6, max_model_len=16)
    impl, ref = adapter.VLLMBlockPool(config), ReferenceBlockPool(config)
    a = list(range(1, 13))
    for side in (impl, ref):
        assert side.allocate_slots(1, a, 0, 12, side.get_computed_blocks(a)) == ((1, 2, 3), (4, 5, 6))
    assert impl.allocate_slots(1, [*a, 13], 12, 1) == ((7,), (4,))
    assert impl.snapshot().requests[1] == ((1, 2, 3, 7), (0, 5, 6, 4))  # block 4 released, then handed out again
    ref.allocate_slots(1, [*a, 13], 12, 1)  # the reference: ((1, 2, 3, 7), (4, 5, 6, 4)), block 4 twice, count 1
    assert ref.snapshot() == impl.snapshot()


# ---------------------------------------------------------------- the lockstep suite against vLLM


_REPORTS: dict[str, CheckReport] = {}


def _report(config: bp.BlockPoolConfig) -> CheckReport:
    """One ``ci`` run per config, shared by the tests below (derandomized: the same run every time)."""
    label = config.label()
    if label not in _REPORTS:
        _REPORTS[label] = run_check("block_pool", adapter.VLLMBlockPool, config, profile="ci", failures_dir=None)
    return _REPORTS[label]


@pytest.mark.parametrize("config", BLOCK_POOL_CONFIGS, ids=IDS)
def test_lockstep_ci_passes(vllm: adapter.VLLMModules, config: bp.BlockPoolConfig) -> None:
    report = _report(config)
    assert report.passed, report.failure
    assert report.steps > 0 and report.examples > 0
    assert report.impl_version == "vllm 0.33.0"
    assert report.not_applicable == ("misuse",)  # no REJECTS_MISUSE: the misuse cases are not applicable


@pytest.mark.parametrize("config", BLOCK_POOL_CONFIGS, ids=IDS)
def test_lockstep_run_is_not_vacuous(vllm: adapter.VLLMModules, config: bp.BlockPoolConfig) -> None:
    """The run against vLLM reaches prefix hits of two blocks, refusals, a full pool, out-of-window null blocks,
    evictions of cached blocks, resets and preemptions, and calls every operation of the protocol."""
    report = _report(config)
    assert report.passed, report.failure
    assert report.outcomes.get("ok", 0) > 0 and report.outcomes.get("OutOfMemory", 0) > 0
    s = report.structure
    assert s["prefix-cache hit blocks"] >= 2
    assert s["pool exhausted"] == 1
    assert s["cached blocks evicted"] >= 1 and s["prefix cache reset"] >= 1
    assert s["preemptions per example"] >= 1 and s["requests running at once"] >= 3
    if config.sliding_window is not None:
        assert s["null blocks of one request"] >= 1
    assert {"allocate_slots", "free", "remove_skipped_blocks", "cache_blocks", "evict_blocks",
            "reset_prefix_cache"} <= {op for op, n in report.calls.items() if n > 0}


class _WindowOffByOne(adapter.VLLMBlockPool):
    """vLLM with the historical off-by-one window (``max(0, n - W)``: one token too many kept), patched on this
    instance's ``SlidingWindowManager`` only: the suite, through the adapter, must see it."""

    def __init__(self, config: bp.BlockPoolConfig) -> None:
        super().__init__(config)
        swa = self.manager.coordinator.single_type_managers[bp.SWA]
        swa.get_num_skipped_tokens = lambda n: max(0, n - swa.sliding_window)


class _FreeInOrder(adapter.VLLMBlockPool):
    """vLLM freeing a finished request's blocks first to last (not last first), on this instance only."""

    def __init__(self, config: bp.BlockPoolConfig) -> None:
        super().__init__(config)
        for m in self.manager.coordinator.single_type_managers:
            m.free = lambda rid, m=m: m.block_pool.free_blocks(m.pop_blocks_for_free(rid))


@pytest.mark.parametrize(("factory", "config", "op"), [
    (_WindowOffByOne, BLOCK_POOL_CONFIGS[2], "allocate_slots"), (_FreeInOrder, BLOCK_POOL_CONFIGS[3], "free")],
    ids=["window-off-by-one", "free-in-order"])
def test_the_suite_sees_a_changed_vllm_through_the_adapter(vllm: adapter.VLLMModules, factory: Any,
                                                           config: bp.BlockPoolConfig, op: str) -> None:
    """The adapter hides nothing: a vLLM changed in one place (its window arithmetic, its free order) fails the
    ``ci`` run at the operation that shows it (a window one token too long keeps a block the reference released)."""
    report = run_check("block_pool", factory, config, profile="ci", failures_dir=None, isolation="in-process")
    assert not report.passed
    assert report.evidence is not None and report.evidence["op"] == op, report.failure
