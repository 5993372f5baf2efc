"""One contract for failures in the torch runtime: typed errors naming op / argument or model / field, state unchanged.

Misuse raises ``InvalidOperation`` (never ``AssertionError``), a bad configuration
``ConfigError`` (never a plain ``ValueError``), and a broken live mapping the same
``InvariantViolation`` -- class and message -- as ``kvproof.reference.swa_allocator``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvproof.gpu_runtime import PagedTokenToKVPoolAllocator, SWAKVPool, SWATokenToKVPoolAllocator
from kvproof.gpu_runtime.hisparse_host import HiSparseHostPool
from kvproof.gpu_runtime.loc_cache import GraphRunner, ModelRunner
from kvproof.reference import hisparse_host as hh
from kvproof.reference import swa_allocator as ref
from kvproof.reference.config import KVGeometry, PoolConfig
from kvproof.reference.errors import ConfigError, InvalidOperation, InvariantViolation
from kvproof.reference.loc_cache import InvalidationPoint

CFG = PoolConfig(size_full=32, size_swa=16, page_size=4, sliding_window_size=4)  # layer 0 SWA, layer 1 full


def t(values: Any, device: str | torch.device = "cpu") -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64, device=device)


def rows(n: int, device: str | torch.device = "cpu") -> torch.Tensor:
    return torch.ones(n, 1, 2, device=device)


# ---------------------------------------------------------------- bad configuration -> ConfigError


@pytest.mark.parametrize(
    ("size", "page_size", "field", "why"),
    [
        (10, 4, "size", "must be a non-negative multiple of page_size (4), got 10"),
        (-4, 4, "size", "must be a non-negative multiple of page_size (4), got -4"),
        (8, 0, "page_size", "must be >= 1, got 0"),
    ],
)
def test_paged_pool_with_a_bad_size_is_a_config_error(size: int, page_size: int, field: str, why: str) -> None:
    with pytest.raises(ConfigError) as e:
        PagedTokenToKVPoolAllocator(size, page_size, "cpu")
    assert (e.value.model, e.value.field) == ("PagedTokenToKVPoolAllocator", field)
    assert str(e.value) == f"PagedTokenToKVPoolAllocator.{field}: {why}"


def test_host_pool_with_the_pre_23606_coordinator_is_a_config_error() -> None:
    config = hh.HostPoolConfig(page_size=1, num_pages=8, max_req_slots=2, max_context_len=8, device_page_size=4,
                               coordinator=hh.Coordinator.PRE_23606)
    with pytest.raises(ConfigError, match="PAGED coordinator only, got pre_23606") as e:
        HiSparseHostPool(config, device="cpu")
    assert (e.value.model, e.value.field) == ("HostPoolConfig", "coordinator")


def test_a_bad_pool_config_never_reaches_the_runtime() -> None:
    with pytest.raises(ConfigError) as e:
        SWATokenToKVPoolAllocator(PoolConfig(size_full=8, size_swa=16, page_size=4, sliding_window_size=4))
    assert (e.value.model, e.value.field) == ("PoolConfig", "size_swa")


# ---------------------------------------------------------------- a pool without a mapping: InvalidOperation


def bare_pool(device: str) -> SWAKVPool:
    """An ``SWAKVPool`` no allocator has registered a mapping with yet."""
    return SWAKVPool(CFG, device)


def test_kv_write_before_a_mapping_is_registered(device: str) -> None:
    pool, d = bare_pool(device), device
    before = pool.swa_kv.clone()
    with pytest.raises(InvalidOperation) as e:
        pool.set_kv_buffer(0, t([4], d), rows(1, d), rows(1, d))  # layer 0 is an SWA layer
    assert (e.value.op, e.value.argument) == ("set_kv_buffer", "layer_id")
    assert "no mapping registered" in str(e.value)
    assert torch.equal(pool.swa_kv, before)


def test_translation_before_a_mapping_is_registered(device: str) -> None:
    pool = bare_pool(device)
    for call, op in ((lambda: pool.translate_loc_from_full_to_swa(t([4], device)), "translate_loc_from_full_to_swa"),
                     (lambda: pool.check_translatable("alloc_extend", t([4], device)), "alloc_extend")):
        with pytest.raises(InvalidOperation) as e:
            call()
        assert (e.value.op, e.value.argument) == (op, "full_to_swa_index_mapping")
        assert str(e.value).endswith("no mapping registered (call register_mapping)")
    assert pool._cached_loc_key is None and pool._cached_swa_loc is None  # nothing cached


def test_forward_through_an_swa_layer_before_a_mapping_is_registered(device: str) -> None:
    pool, d = bare_pool(device), device
    runner = ModelRunner(pool, lambda point: pool.invalidate_loc_cache())
    before = (pool.full_kv.clone(), pool.swa_kv.clone())
    with pytest.raises(InvalidOperation) as e:
        runner.forward(t([0], d), {0: rows(1, d), 1: rows(1, d)}, {0: rows(1, d), 1: rows(1, d)})
    assert (e.value.op, e.value.argument) == ("set_kv_buffer", "layer_id")
    assert torch.equal(pool.full_kv, before[0]) and torch.equal(pool.swa_kv, before[1])


def test_capture_before_a_mapping_is_registered_changes_nothing(device: str) -> None:
    """Full layers only, so every row check passes: the missing mapping is what the capture refuses."""
    pool, d = bare_pool(device), device
    points: list[InvalidationPoint] = []
    runner = GraphRunner(pool, points.append, emulate=True)
    before = pool.full_kv.clone()
    with pytest.raises(InvalidOperation) as e:
        runner.capture(t([0], d), {1: rows(1, d)}, {1: rows(1, d)})
    assert (e.value.op, e.value.argument) == ("capture", "full_to_swa_index_mapping")
    assert runner.graph is None and points == [] and torch.equal(pool.full_kv, before)  # no warm-up ran


def test_replay_before_capture_is_invalid_not_an_assertion(device: str) -> None:
    a = SWATokenToKVPoolAllocator(CFG, device=device)
    before = a.snapshot()
    with pytest.raises(InvalidOperation) as e:
        a.replay()
    assert (e.value.op, e.value.argument) == ("replay", "graph") and not isinstance(e.value, AssertionError)
    assert a.snapshot() == before


# ---------------------------------------------------------------- misuse of the allocator's surface


def allocator(device: str) -> SWATokenToKVPoolAllocator:
    a = SWATokenToKVPoolAllocator(CFG, device=device)
    a.alloc_extend(t([0], device), t([0]), t([6], device), t([6]), t([-1], device), 6)
    return a


MISUSE: dict[str, tuple[Callable[[SWATokenToKVPoolAllocator, str], object], str, str]] = {
    # name: (call, op, argument)
    "restore from something else": (lambda a, d: a.restore_state(a.full_attn_allocator.backup_state()),
                                    "restore_state", "state"),
    "load a copy that is not one": (lambda a, d: a.load_cpu_copy({"full": None}, t([4], d)),
                                    "load_cpu_copy", "kv_cache_cpu"),
    "load a list": (lambda a, d: a.load_cpu_copy([1, 2], t([4], d)),
                    "load_cpu_copy", "kv_cache_cpu"),
    "layer id of another type": (lambda a, d: a.get_kvcache().get_kv_buffer("0"),
                                 "get_kv_buffer", "layer_id"),
    "layer id out of range": (lambda a, d: a.get_kvcache().get_kv_buffer(7), "get_kv_buffer", "layer_id"),
    "set a mapping with a repeated slot": (lambda a, d: a.set_full_to_swa_mapping(t([5, 4, 5], d), t([0, 0, 0], d)),
                                           "set_full_to_swa_mapping", "full_indices"),
}


@pytest.mark.parametrize("name", sorted(MISUSE))
def test_misuse_is_invalid_operation_and_changes_nothing(name: str, device: str) -> None:
    call, op, argument = MISUSE[name]
    a = allocator(device)
    before = (a.snapshot(), a.full_attn_allocator.fill.clone(), a.get_kvcache().full_kv.clone())
    with pytest.raises(InvalidOperation) as e:
        call(a, device)
    assert (e.value.op, e.value.argument) == (op, argument), str(e.value)
    after = (a.snapshot(), a.full_attn_allocator.fill, a.get_kvcache().full_kv)
    assert after[0] == before[0] and torch.equal(after[1], before[1]) and torch.equal(after[2], before[2])


def test_a_repeated_slot_is_named_as_by_the_reference(device: str) -> None:
    a, s = allocator(device), ref.alloc_extend(ref.initial_state(CFG), [0], [6], [-1], 6)[0]
    with pytest.raises(InvalidOperation) as got:
        a.free(t([5, 4, 5], device))
    with pytest.raises(InvalidOperation) as want:
        ref.free(s, [5, 4, 5])
    assert str(got.value) == str(want.value) == "free: free_index: slot 5 appears twice"


# ---------------------------------------------------------------- the live mapping: one shape in both layers


def two_requests(device: str) -> tuple[SWATokenToKVPoolAllocator, ref.SWAAllocatorState]:
    """A: positions 0..5 at full and SWA slots 4..9 (pages 1, 2); B: 0..2 at 12..14 (page 3), in both layers."""
    a, s = SWATokenToKVPoolAllocator(CFG, device=device), ref.initial_state(CFG)
    for pre_seq in (6, 3):
        a.alloc_extend(t([0], device), t([0]), t([pre_seq], device), t([pre_seq]), t([-1], device), pre_seq)
        s, _ = ref.alloc_extend(s, [0], [pre_seq], [-1], pre_seq)
    assert a.snapshot() == ref.snapshot(s)
    return a, s


VIOLATIONS: dict[str, tuple[list[int], list[int], str]] = {
    # name: (full_indices, swa_indices, the reference's message)
    "M2 free page": ([4], [16], "[M2] live full slot 4 maps to SWA slot 16 in free page 4"),
    "M2 another owner": ([12], [4], "[M2] full slot 12 (page 3) maps to SWA slot 4 in page 1 of another owner"),
    "M2 shared slot": ([5], [4], "[M2] full slots 4 and 5 both map to SWA slot 4"),
    "M5 offset": ([4, 5], [5, 4], "[M5] full slot 4 (offset 0) maps to SWA slot 5 (offset 1)"),
    "M5 shared page": ([4, 5, 8, 9], [0, 0, 4, 5], "[M5] SWA page 1 is shared by full pages 1 and 2"),
    "G3 orphan": ([12, 13, 14], [0, 0, 0], "[G3] SWA pages owned but mapped from no live full slot: [3]"),
}


@pytest.mark.parametrize("name", sorted(VIOLATIONS))
def test_set_mapping_violation_is_the_references(name: str, device: str) -> None:
    full, swa, message = VIOLATIONS[name]
    a, s = two_requests(device)
    with pytest.raises(InvalidOperation) as want:
        ref.set_full_to_swa_mapping(s, full, swa)
    before = a.snapshot()
    with pytest.raises(InvalidOperation) as got:
        a.set_full_to_swa_mapping(t(full, device), t(swa, device))
    assert str(want.value) == f"set_full_to_swa_mapping: swa_indices: the mapping would break {message}"
    assert (got.value.op, got.value.argument, str(got.value)) == (want.value.op, want.value.argument, str(want.value))
    assert a.snapshot() == before


@pytest.mark.parametrize("name", sorted(VIOLATIONS))
def test_broken_live_mapping_is_the_same_invariant_violation(name: str, device: str) -> None:
    """Written behind the allocator's back, the same mapping fails both self-checks with one message."""
    full, swa, message = VIOLATIONS[name]
    a, s = two_requests(device)
    a.full_to_swa_index_mapping[t(full, device)] = t(swa, device)
    m = list(s.full_to_swa_index_mapping)
    for f, v in zip(full, swa, strict=True):
        m[f] = v
    broken = s.model_copy(update={"full_to_swa_index_mapping": tuple(m)})
    with pytest.raises(InvariantViolation) as want:
        ref.check_live_mapping(broken)
    with pytest.raises(InvariantViolation) as got:
        a.check_invariants()
    assert (got.value.invariant, str(got.value)) == (want.value.invariant, str(want.value)) == (message[1:3], message)


def test_a_live_page_zero_is_still_caught_where_the_slot_rules_pass(device: str) -> None:
    """A pool with live slots on page 0 (G1 broken) passes the per-slot rules; the reductions still raise."""
    a, _ = two_requests(device)
    a.swa_attn_allocator.fill[0] = 1  # page 0 'allocated' and reached by no full slot
    from kvproof.gpu_runtime._mapping import check_live_mapping

    with pytest.raises(InvariantViolation, match=r"^\[G3\] SWA pages allocated but mapped from no live full slot$"):
        check_live_mapping(a.full_attn_allocator, a.swa_attn_allocator, a.full_to_swa_index_mapping, a._owners)


def test_geometry_of_the_default_layers() -> None:
    """The tests above rely on layer 0 being SWA and layer 1 full."""
    assert CFG.kv == KVGeometry() and CFG.kv.is_swa_layer(0) and not CFG.kv.is_swa_layer(1)
