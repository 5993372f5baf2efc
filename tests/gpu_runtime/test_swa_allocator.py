"""Fixed-vector tests of the torch ``SWATokenToKVPoolAllocator`` (sglang_semantics.md §1.3, §1.5, §2.7, §9).

Every vector is also run on ``kvproof.reference.swa_allocator`` so that the expected
values are the reference's, not just ours.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvproof.gpu_runtime import SWATokenToKVPoolAllocator
from kvproof.reference import InvalidOperation, InvariantViolation, OutOfMemory, PoolConfig, arith
from kvproof.reference import swa_allocator as sa
from kvproof.reference.contract import Capability, SWAAllocatorUnderTest
from kvproof.reference.errors import PoolError

P4 = PoolConfig(size_full=48, size_swa=48, page_size=4, sliding_window_size=6)


def t(values: Any, device: str | torch.device = "cpu") -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64, device=device)


def extend(a: SWATokenToKVPoolAllocator, pre: list[int], seq: list[int], last: list[int]) -> list[int]:
    d = a.device
    n = sum(seq) - sum(pre)
    return a.alloc_extend(t(pre, d), t(pre), t(seq, d), t(seq), t(last, d), n).tolist()


def test_protocol_surface(device: str) -> None:
    a = SWATokenToKVPoolAllocator(P4, device=device)
    assert isinstance(a, SWAAllocatorUnderTest)
    assert a.capabilities == frozenset(Capability) - {Capability.DECODE_BUDGETS}
    assert a.get_kvcache().full_to_swa_index_mapping is a.full_to_swa_index_mapping
    assert a.full_to_swa_index_mapping.numel() == P4.size_full + 4 + 1 and int(a.full_to_swa_index_mapping[-1]) == -1
    assert (a.size, a.size_full, a.size_swa) == (48, 48, 48)


def test_default_device_follows_cuda() -> None:
    a = SWATokenToKVPoolAllocator(P4)
    assert a.device.type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_s1_extend_parts_at_p4(device: str) -> None:
    """Parts 1/2/3 of a batched extend at P=4 (§1.3), page by page from the front of the free list."""
    a, s = SWATokenToKVPoolAllocator(P4, device=device), sa.initial_state(P4)
    assert extend(a, [0], [6], [-1]) == [4, 5, 6, 7, 8, 9]  # pages 1, 2
    assert extend(a, [0], [2], [-1]) == [12, 13]  # page 3
    s, _ = sa.alloc_extend(s, [0], [6], [-1], 6)
    s, _ = sa.alloc_extend(s, [0], [2], [-1], 2)
    # A 6->13: part 1 = 10, 11; part 2 = page 4; part 3 = page 5 offset 0
    assert arith.extend_parts(6, 13, 4) == (2, 4, 1)
    # B 2->3: part 1 only; C 0->5: page 6 whole, page 7 offset 0
    pre, seq, last = [6, 2, 0], [13, 3, 5], [9, 13, -1]
    out = extend(a, pre, seq, last)
    assert out == [10, 11, 16, 17, 18, 19, 20, 14, 24, 25, 26, 27, 28]
    s, ref_out = sa.alloc_extend(s, pre, seq, last, 13)
    assert tuple(out) == ref_out
    assert a.snapshot() == sa.snapshot(s)
    assert a.snapshot().full.free_pages == tuple(range(8, 13))
    a.check_invariants()


def test_decode_opens_page_only_at_boundary(device: str) -> None:
    a = SWATokenToKVPoolAllocator(P4, device=device)
    extend(a, [0, 0], [4, 3], [-1, -1])  # A on page 1 (full), B on page 2 (3 slots)
    d = a.device
    out = a.alloc_decode(t([5, 4, 1], d), t([5, 4, 1]), t([7, 10, -1], d)).tolist()
    assert out == [12, 11, 16]  # A opens page 3, B continues page 2, a new request opens page 4
    assert a.snapshot().full.free_pages[0] == 5


def test_release_order_p1_appends_p_gt_1_prepends_sorted(device: str) -> None:
    """SGLang 0.5.23 policy (§1.2, §1.3): FIFO at P == 1, sorted LIFO at P > 1."""
    p1 = PoolConfig(size_full=8, size_swa=8, page_size=1, sliding_window_size=4)
    a = SWATokenToKVPoolAllocator(p1, device=device)
    a.alloc(4)
    a.free(t([3, 1], a.device))
    assert a.snapshot().full.free_pages == (5, 6, 7, 8, 3, 1)
    b = SWATokenToKVPoolAllocator(P4, device=device)
    extend(b, [0], [12], [-1])  # pages 1, 2, 3
    b.free(t([13, 5, 14], b.device))  # pages 3 and 1, whole
    assert b.snapshot().full.free_pages[:3] == (1, 3, 4)


def test_s3_tail_clears_stale_mapping_after_restore(device: str) -> None:
    """S3 (§9): restore_state keeps M (R3); the tail allocation must clear the non-tail slots (post-#25805)."""
    cfg = PoolConfig(size_full=6, size_swa=6, page_size=2, sliding_window_size=2)
    a, d = SWATokenToKVPoolAllocator(cfg, device=device), device
    backup = a.backup_state()
    assert extend(a, [0], [2], [-1]) == [2, 3]
    a.restore_state(backup)
    assert a.full_to_swa_index_mapping[2:4].tolist() == [2, 3]  # R3: stale, on a free page
    out = a.alloc_extend_swa_tail(t([0], d), t([0]), t([4], d), t([4]), t([-1], d), 4, 2).tolist()
    assert out == [2, 3, 4, 5]
    assert a.full_to_swa_index_mapping[2:6].tolist() == [0, 0, 2, 3]
    a.free_swa(t([2, 3], d))  # window eviction of positions 0, 1 releases nothing
    assert a.swa_available_size() == 4
    a.check_invariants()


def test_tail_len_zero_still_clears(device: str) -> None:
    """[Differs from SGLang 0.5.23 (R2)]: swa_tail_len == 0 clears the new slots' mapping too."""
    cfg = PoolConfig(size_full=8, size_swa=8, page_size=2, sliding_window_size=2)
    a, d = SWATokenToKVPoolAllocator(cfg, device=device), device
    backup = a.backup_state()
    extend(a, [0], [4], [-1])
    a.restore_state(backup)
    a.alloc_extend_swa_tail(t([0], d), t([0]), t([4], d), t([4]), t([-1], d), 4, 0)
    assert a.full_to_swa_index_mapping[2:6].tolist() == [0, 0, 0, 0]
    assert a.swa_available_size() == 8


def test_stale_entries_on_never_handed_out_slots_are_not_released(device: str) -> None:
    """free_swa releases only SWA pages of live slots; M is zeroed on the whole touched page."""
    a, s, d = SWATokenToKVPoolAllocator(P4, device=device), sa.initial_state(P4), device
    backup, b_ref = a.backup_state(), sa.backup_state(s)
    extend(a, [0], [4], [-1])
    s, _ = sa.alloc_extend(s, [0], [4], [-1], 4)
    a.restore_state(backup)
    s = sa.restore_state(s, b_ref)
    assert extend(a, [0], [1], [-1]) == [4]  # page 1 again: slots 5..7 keep stale M 5..7
    s, _ = sa.alloc_extend(s, [0], [1], [-1], 1)
    assert a.full_to_swa_index_mapping[4:8].tolist() == [4, 5, 6, 7]
    a.free_swa(t([4], d))
    s = sa.free_swa(s, [4])
    assert a.snapshot() == sa.snapshot(s)
    assert a.snapshot().swa.free_pages == tuple(range(1, 13))  # page 1 once, no duplicate
    assert a.full_to_swa_index_mapping[4:8].tolist() == [0, 0, 0, 0]


def test_restore_of_a_newer_backup_after_a_restore_is_rejected(device: str) -> None:
    """Backup B1, allocate, backup B2, restore B1: B2 is stale (restoring it would resurrect pages)."""
    a, s = SWATokenToKVPoolAllocator(P4, device=device), sa.initial_state(P4)
    b1, r1 = a.backup_state(), sa.backup_state(s)
    extend(a, [0], [4], [-1])
    s, _ = sa.alloc_extend(s, [0], [4], [-1], 4)
    b2, r2 = a.backup_state(), sa.backup_state(s)
    a.restore_state(b1)
    s = sa.restore_state(s, r1)
    before = a.snapshot()
    with pytest.raises(InvalidOperation) as e:
        a.restore_state(b2)
    with pytest.raises(InvalidOperation) as e_ref:
        sa.restore_state(s, r2)
    assert (e.value.op, e.value.argument) == (e_ref.value.op, e_ref.value.argument) == ("restore_state", "state")
    assert a.snapshot() == before == sa.snapshot(s)


def test_empty_free_does_not_invalidate_a_backup(device: str) -> None:
    """Upstream treats an empty free as a no-op; it releases nothing, so a backup stays valid."""
    a, s, d = SWATokenToKVPoolAllocator(P4, device=device), sa.initial_state(P4), device
    b, r = a.backup_state(), sa.backup_state(s)
    empty = torch.empty(0, dtype=torch.int64, device=d)
    a.free(empty), a.free_swa(empty), a.free_full(empty)
    s = sa.free_full(sa.free_swa(sa.free(s, []), []), [])
    a.restore_state(b)
    s = sa.restore_state(s, r)
    assert a.snapshot() == sa.snapshot(s)


# ---------------------------------------------------------------- misuse leaves everything unchanged


def build(device: str) -> tuple[SWATokenToKVPoolAllocator, sa.SWAAllocatorState, dict[str, Any]]:
    """A: positions 0..5 at slots 4..9 (page 2 has 2 live slots). B: 0..2 at 12..14, SWA released.

    Full pool 8 pages, SWA pool 4 pages (2 free after B's SWA release). KV written on A.
    """
    cfg = PoolConfig(size_full=32, size_swa=16, page_size=4, sliding_window_size=4)
    a, s, d = SWATokenToKVPoolAllocator(cfg, device=device), sa.initial_state(cfg), device
    extend(a, [0], [6], [-1])
    extend(a, [0], [3], [-1])
    s, _ = sa.alloc_extend(s, [0], [6], [-1], 6)
    s, _ = sa.alloc_extend(s, [0], [3], [-1], 3)
    k = torch.arange(12, dtype=torch.float32).reshape(6, 1, 2)
    for layer in (0, 1):
        a.get_kvcache().set_kv_buffer(layer, t(range(4, 10), d), k.to(d), (k + 100).to(d))
        s = sa.set_kv_buffer(s, layer, range(4, 10), k.reshape(6, 2).tolist(), (k + 100).reshape(6, 2).tolist())
    extra: dict[str, Any] = {"stale_backup": (a.backup_state(), sa.backup_state(s))}
    a.free_swa(t([12], d))
    s = sa.free_swa(s, [12])
    extra["copy"] = (a.get_cpu_copy(t(range(4, 10), d)), sa.get_cpu_copy(s, range(4, 10)))
    return a, s, extra


K1 = torch.zeros(1, 1, 2)
MISUSE: dict[str, tuple[Callable[..., Any], Callable[..., Any] | None]] = {
    # name: (runtime call, reference call); both take (impl_or_state, device, extra)
    "free_reserved_page": (lambda a, d, x: a.free(t([3], d)), lambda s, x: sa.free(s, [3])),
    "free_out_of_range": (lambda a, d, x: a.free(t([100], d)), lambda s, x: sa.free(s, [100])),
    "free_never_handed_out": (lambda a, d, x: a.free(t([10], d)), lambda s, x: sa.free(s, [10])),
    "double_free": (lambda a, d, x: a.free(t([20], d)), lambda s, x: sa.free(s, [20])),
    "free_duplicate": (lambda a, d, x: a.free(t([4, 4], d)), lambda s, x: sa.free(s, [4, 4])),
    "free_swa_negative": (lambda a, d, x: a.free_swa(t([-1], d)), lambda s, x: sa.free_swa(s, [-1])),
    "free_full_live_peer": (lambda a, d, x: a.free_full(t([4], d)), lambda s, x: sa.free_full(s, [4])),
    "alloc_unaligned": (lambda a, d, x: a.alloc(3), lambda s, x: sa.alloc(s, 3)),
    "alloc_negative": (lambda a, d, x: a.alloc(-4), lambda s, x: sa.alloc(s, -4)),
    "extend_lengths": (lambda a, d, x: a.alloc_extend(t([0], d), t([0]), t([1, 2], d), t([1, 2]), t([-1], d), 3),
                       lambda s, x: sa.alloc_extend(s, [0], [1, 2], [-1], 3)),
    "extend_shrinks": (lambda a, d, x: extend(a, [6], [5], [9]), lambda s, x: sa.alloc_extend(s, [6], [5], [9], -1)),
    "extend_u2": (lambda a, d, x: a.alloc_extend(t([0], d), t([0]), t([4], d), t([4]), t([-1], d), 3),
                  lambda s, x: sa.alloc_extend(s, [0], [4], [-1], 3)),
    "last_loc_without_prefix": (lambda a, d, x: extend(a, [0], [2], [9]),
                                lambda s, x: sa.alloc_extend(s, [0], [2], [9], 2)),
    "no_last_loc_with_prefix": (lambda a, d, x: extend(a, [6], [7], [-1]),
                                lambda s, x: sa.alloc_extend(s, [6], [7], [-1], 1)),
    "last_loc_misaligned": (lambda a, d, x: extend(a, [5], [7], [9]),
                            lambda s, x: sa.alloc_extend(s, [5], [7], [9], 2)),
    "last_loc_not_last_live": (lambda a, d, x: extend(a, [5], [7], [8]),
                               lambda s, x: sa.alloc_extend(s, [5], [7], [8], 2)),
    "last_loc_in_free_page": (lambda a, d, x: extend(a, [2], [3], [21]),
                              lambda s, x: sa.alloc_extend(s, [2], [3], [21], 1)),
    "continue_released_swa_m5": (lambda a, d, x: extend(a, [3], [4], [14]),
                                 lambda s, x: sa.alloc_extend(s, [3], [4], [14], 1)),
    "two_requests_one_page": (lambda a, d, x: extend(a, [6, 6], [7, 7], [9, 9]),
                              lambda s, x: sa.alloc_extend(s, [6, 6], [7, 7], [9, 9], 2)),
    "decode_seq_zero": (lambda a, d, x: a.alloc_decode(t([0], d), t([0]), t([-1], d)),
                        lambda s, x: sa.alloc_decode(s, [0], [-1])),
    "decode_misaligned": (lambda a, d, x: a.alloc_decode(t([8], d), t([8]), t([8], d)),
                          lambda s, x: sa.alloc_decode(s, [8], [8])),
    "tail_two_requests": (lambda a, d, x: a.alloc_extend_swa_tail(t([0, 0], d), t([0, 0]), t([4, 4], d), t([4, 4]),
                                                                  t([-1, -1], d), 8, 4),
                          lambda s, x: sa.alloc_extend_swa_tail(s, [0, 0], [4, 4], [-1, -1], 8, 4)),
    "tail_u1": (lambda a, d, x: a.alloc_extend_swa_tail(t([0], d), t([0]), t([6], d), t([6]), t([-1], d), 6, 3),
                lambda s, x: sa.alloc_extend_swa_tail(s, [0], [6], [-1], 6, 3)),
    "tail_too_long": (lambda a, d, x: a.alloc_extend_swa_tail(t([0], d), t([0]), t([4], d), t([4]), t([-1], d), 4, 8),
                      lambda s, x: sa.alloc_extend_swa_tail(s, [0], [4], [-1], 4, 8)),
    "restore_after_release": (lambda a, d, x: a.restore_state(x["stale_backup"][0]),
                              lambda s, x: sa.restore_state(s, x["stale_backup"][1])),
    "restore_garbage": (lambda a, d, x: a.restore_state("backup"), None),
    "load_length_mismatch": (lambda a, d, x: a.load_cpu_copy(x["copy"][0], t([4, 5, 6], d)),
                             lambda s, x: sa.load_cpu_copy(s, x["copy"][1], [4, 5, 6])),
    "load_into_dead_slots": (lambda a, d, x: a.load_cpu_copy(x["copy"][0], t([4, 5, 6, 7, 8, 10], d)),
                             lambda s, x: sa.load_cpu_copy(s, x["copy"][1], [4, 5, 6, 7, 8, 10])),
    "load_duplicates": (lambda a, d, x: a.load_cpu_copy(x["copy"][0], t([4, 5, 6, 7, 8, 8], d)),
                        lambda s, x: sa.load_cpu_copy(s, x["copy"][1], [4, 5, 6, 7, 8, 8])),
    "copy_freed_slot": (lambda a, d, x: a.get_cpu_copy(t([20], d)), lambda s, x: sa.get_cpu_copy(s, [20])),
    "set_kv_bad_layer": (lambda a, d, x: a.get_kvcache().set_kv_buffer(9, t([4], d), K1.to(d), K1.to(d)),
                         lambda s, x: sa.set_kv_buffer(s, 9, [4], [[0, 0]], [[0, 0]])),
    "set_kv_row_count": (lambda a, d, x: a.get_kvcache().set_kv_buffer(0, t([4, 5], d), K1.to(d), K1.to(d)),
                         lambda s, x: sa.set_kv_buffer(s, 0, [4, 5], [[0, 0]], [[0, 0]])),
    "set_kv_row_width": (lambda a, d, x: a.get_kvcache().set_kv_buffer(0, t([4], d), torch.zeros(1, 1, 3).to(d),
                                                                       torch.zeros(1, 1, 3).to(d)),
                         lambda s, x: sa.set_kv_buffer(s, 0, [4], [[0, 0, 0]], [[0, 0, 0]])),
    "set_kv_dead_slot": (lambda a, d, x: a.get_kvcache().set_kv_buffer(0, t([10], d), K1.to(d), K1.to(d)),
                         lambda s, x: sa.set_kv_buffer(s, 0, [10], [[0, 0]], [[0, 0]])),
    "set_kv_duplicate": (lambda a, d, x: a.get_kvcache().set_kv_buffer(0, t([4, 4], d), K1.repeat(2, 1, 1).to(d),
                                                                       K1.repeat(2, 1, 1).to(d)),
                         lambda s, x: sa.set_kv_buffer(s, 0, [4, 4], [[0, 0]] * 2, [[0, 0]] * 2)),
    "translate_out_of_range": (lambda a, d, x: a.translate_loc_from_full_to_swa(t([36], d)),
                               lambda s, x: sa.translate_loc_from_full_to_swa(s, [36])),
    "oom_extend_swa": (lambda a, d, x: extend(a, [0], [12], [-1]),
                       lambda s, x: sa.alloc_extend(s, [0], [12], [-1], 12)),
    "oom_extend_full": (lambda a, d, x: extend(a, [0, 0], [8, 20], [-1, -1]),
                        lambda s, x: sa.alloc_extend(s, [0, 0], [8, 20], [-1, -1], 28)),
    "oom_decode_swa_atomic": (lambda a, d, x: a.alloc_decode(t([1, 1, 1], d), t([1, 1, 1]), t([-1, -1, -1], d)),
                              lambda s, x: sa.alloc_decode(s, [1, 1, 1], [-1, -1, -1])),
    "oom_tail_swa": (lambda a, d, x: a.alloc_extend_swa_tail(t([0], d), t([0]), t([12], d), t([12]), t([-1], d), 12,
                                                             12),
                     lambda s, x: sa.alloc_extend_swa_tail(s, [0], [12], [-1], 12, 12)),
    "oom_alloc_full": (lambda a, d, x: a.alloc(40), lambda s, x: sa.alloc(s, 40)),
}


def error_key(e: PoolError) -> tuple[Any, ...]:
    if isinstance(e, OutOfMemory):
        return "OutOfMemory", e.op, e.pool, e.pages_needed, e.pages_free
    assert isinstance(e, InvalidOperation)
    return "InvalidOperation", e.op, e.argument


@pytest.mark.parametrize("name", sorted(MISUSE))
def test_failure_changes_nothing(name: str, device: str) -> None:
    a, s, extra = build(device)
    before = a.snapshot()
    kv = (a.get_kvcache().full_kv.clone(), a.get_kvcache().swa_kv.clone())
    fills = (a.full_attn_allocator.fill.clone(), a.swa_attn_allocator.fill.clone())
    call_rt, call_ref = MISUSE[name]
    with pytest.raises(PoolError) as got:
        call_rt(a, device, extra)
    assert not isinstance(got.value, InvariantViolation)
    if call_ref is not None:  # the reference raises the same class, op and argument
        with pytest.raises(PoolError) as want:
            call_ref(s, extra)
        assert error_key(got.value) == error_key(want.value)
    assert a.snapshot() == before
    assert torch.equal(a.get_kvcache().full_kv, kv[0]) and torch.equal(a.get_kvcache().swa_kv, kv[1])
    assert torch.equal(a.full_attn_allocator.fill, fills[0]) and torch.equal(a.swa_attn_allocator.fill, fills[1])
    a.check_invariants()
    assert extend(a, [0], [4], [-1]) == [16, 17, 18, 19]  # still usable, same next page


# ---------------------------------------------------------------- self-check


def test_check_invariants_catches_corruption(device: str) -> None:
    a = SWATokenToKVPoolAllocator(P4, device=device)
    extend(a, [0], [6], [-1])
    a.check_invariants()
    free = a.full_attn_allocator.free_pages
    a.full_attn_allocator.free_pages = torch.cat((free[:1], free))
    with pytest.raises(InvariantViolation, match=r"\[G1\]"):
        a.check_invariants()
    b = SWATokenToKVPoolAllocator(P4, device=device)
    extend(b, [0], [6], [-1])
    b.full_to_swa_index_mapping[5] = 4  # two live slots share SWA slot 4
    with pytest.raises(InvariantViolation, match=r"\[M2\]"):
        b.check_invariants()
    b.full_to_swa_index_mapping[-1] = 0
    with pytest.raises(InvariantViolation, match=r"\[M1\]"):
        b.check_invariants()


def test_translate_keeps_shape_and_set_mapping_validates(device: str) -> None:
    a, d = SWATokenToKVPoolAllocator(P4, device=device), device
    extend(a, [0], [4], [-1])
    got = a.translate_loc_from_full_to_swa(torch.tensor([[4, -1], [5, 6]], device=d))
    assert got.tolist() == [[4, -1], [5, 6]]
    a.set_full_to_swa_mapping(t([4], d), t([0], d))
    assert int(a.full_to_swa_index_mapping[4]) == 0
    for full, swa, argument in (([3], [8], "full_indices"), ([4], [52], "swa_indices"), ([4, 5], [8], "swa_indices")):
        with pytest.raises(InvalidOperation) as e:
            a.set_full_to_swa_mapping(t(full, d), t(swa, d))
        assert (e.value.op, e.value.argument) == ("set_full_to_swa_mapping", argument)


# ---- ring mode: 0.5.23's per-request SWA ring, vector by vector against the reference (SR1-SR3)

RING = PoolConfig(size_full=24, size_swa=12, page_size=2, sliding_window_size=3, swa_ring_size=3, num_req_slots=4)


def _sizes(a: SWATokenToKVPoolAllocator) -> tuple[int, int, int]:
    return a.available_size(), a.full_available_size(), a.swa_available_size()


def _ref_sizes(st: sa.SWAAllocatorState) -> tuple[int, int, int]:
    return sa.available_size(st), sa.full_available_size(st), sa.swa_available_size(st)


def test_ring_mode_matches_the_reference(device: str) -> None:
    a, st = SWATokenToKVPoolAllocator(RING, device=device), sa.initial_state(RING)
    assert _sizes(a) == _ref_sizes(st) == (24, 24, 16)
    got, (st, want) = a.alloc_req_slots(2), sa.alloc_req_slots(st, 2)
    assert got == list(want) == [3, 4] and _sizes(a) == _ref_sizes(st) == (24, 24, 8)
    first = extend(a, [0], [5], [-1])
    st, ref_first = sa.alloc_extend(st, [0], [5], [-1], 5)
    assert first == list(ref_first)
    cpu = torch.device("cpu")
    d = a.alloc_decode(t([6], a.device), t([6], cpu), t([first[-1]], a.device)).tolist()
    st, ref_d = sa.alloc_decode(st, [6], [first[-1]])
    tail = a.alloc_extend_swa_tail(t([0], a.device), t([0], cpu), t([4], a.device), t([4], cpu), t([-1], a.device),
                                   4, 2).tolist()
    st, ref_tail = sa.alloc_extend_swa_tail(st, [0], [4], [-1], 4, 2)
    bulk = a.alloc(4).tolist()
    st, ref_bulk = sa.alloc(st, 4)
    assert (d, tail, bulk) == (list(ref_d), list(ref_tail), list(ref_bulk))
    assert a.snapshot() == sa.snapshot(st) and _sizes(a) == _ref_sizes(st) == (10, 10, 8)
    assert not bool(a.full_to_swa_index_mapping[:-1].any())  # SR3: M never written
    a.free_swa(t(first, a.device))  # validated, releases nothing
    a.free_swa_segment(t(first[:2], a.device), start_pos=0)
    st = sa.free_swa_segment(sa.free_swa(st, first), first[:2], 0)
    assert a.snapshot() == sa.snapshot(st)
    a.free_segment(t(first[:4], a.device), start_pos=0)
    a.free(t(first[4:] + d, a.device))
    st = sa.free(sa.free_segment(st, first[:4], 0), [*first[4:], *d])
    a.free_req_slots([4])
    st = sa.free_req_slots(st, [4])
    assert a.snapshot() == sa.snapshot(st) and _sizes(a) == _ref_sizes(st) == (16, 16, 12)
    a.clear()
    st = sa.clear(st)
    assert a.snapshot() == sa.snapshot(st) and _sizes(a) == _ref_sizes(st) == (24, 24, 12)  # slots stay held
    a.check_invariants()


def test_ring_mode_rejects_what_the_reference_rejects(device: str) -> None:
    a, st = SWATokenToKVPoolAllocator(RING, device=device), sa.initial_state(RING)
    cases: list[tuple[Callable[[], Any], Callable[[], Any]]] = [
        (lambda: a.alloc_req_slots(5), lambda: sa.alloc_req_slots(st, 5)),
        (lambda: a.alloc_req_slots(-1), lambda: sa.alloc_req_slots(st, -1)),
        (lambda: a.free_req_slots([1]), lambda: sa.free_req_slots(st, [1])),
        (lambda: a.free_req_slots([9]), lambda: sa.free_req_slots(st, [9])),
        (lambda: a.free_swa(t([4], a.device)), lambda: sa.free_swa(st, [4])),
        (lambda: extend(a, [0], [26], [-1]), lambda: sa.alloc_extend(st, [0], [26], [-1], 26)),
    ]
    for mine, theirs in cases:
        with pytest.raises(PoolError) as got:
            mine()
        with pytest.raises(PoolError) as want:
            theirs()
        assert (type(got.value), getattr(got.value, "argument", None)) == (type(want.value),
                                                                           getattr(want.value, "argument", None))
    assert a.snapshot() == sa.snapshot(st) and _sizes(a) == _ref_sizes(st)
    plain = SWATokenToKVPoolAllocator(P4, device=device)
    with pytest.raises(InvalidOperation, match="no per-request SWA ring"):
        plain.alloc_req_slots(1)
