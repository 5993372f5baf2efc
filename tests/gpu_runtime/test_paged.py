"""The single-pool ``PagedTokenToKVPoolAllocator`` on its own (sglang_semantics.md §1.2-§1.4)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvproof.gpu_runtime import PagedTokenToKVPoolAllocator
from kvproof.reference import InvalidOperation, InvariantViolation, OutOfMemory


def t(values: Any, device: str | torch.device = "cpu") -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64, device=device)


def extend(pool: PagedTokenToKVPoolAllocator, pre: list[int], seq: list[int], last: list[int]) -> list[int]:
    d = pool.device
    return pool.alloc_extend(t(pre, d), t(pre), t(seq, d), t(seq), t(last, d), sum(seq) - sum(pre)).tolist()


def test_token_allocator_p1_is_fifo(device: str) -> None:
    pool = PagedTokenToKVPoolAllocator(6, 1, device)
    assert pool.free_pages.tolist() == [1, 2, 3, 4, 5, 6] and pool.available_size() == 6
    assert extend(pool, [0, 0], [2, 1], [-1, -1]) == [1, 2, 3]
    assert pool.alloc_decode(t([3], device), t([3]), t([2], device)).tolist() == [4]
    pool.free(t([3, 1], device))
    assert pool.free_pages.tolist() == [5, 6, 3, 1]
    pool.check_invariants()


def test_paged_p4_extend_decode_free(device: str) -> None:
    pool = PagedTokenToKVPoolAllocator(32, 4, device)
    assert pool.end_slot == 36 and pool.num_pages == 8
    assert extend(pool, [0, 0], [5, 2], [-1, -1]) == [4, 5, 6, 7, 8, 12, 13]
    assert extend(pool, [5, 2], [10, 2], [8, 13]) == [9, 10, 11, 16, 17]
    assert pool.alloc_decode(t([11, 3], device), t([11, 3]), t([17, 13], device)).tolist() == [18, 14]
    assert pool.fill.tolist()[:9] == [0, 4, 4, 3, 3, 0, 0, 0, 0]
    pool.free(t([13, 5, 4], device))  # pages 3 and 1, prepended sorted
    assert pool.free_pages.tolist() == [1, 3, 5, 6, 7, 8]
    assert pool.alloc(8).tolist() == [4, 5, 6, 7, 12, 13, 14, 15]
    pool.check_invariants()


def test_backup_restore_and_short_pool(device: str) -> None:
    pool = PagedTokenToKVPoolAllocator(8, 2, device)
    backup = pool.backup_state()
    extend(pool, [0], [3], [-1])
    pool.restore_state(backup)
    assert pool.free_pages.tolist() == [1, 2, 3, 4] and not pool.fill.any()
    with pytest.raises(OutOfMemory):
        pool.take_pages(5)
    assert pool.num_free_pages() == 4


def test_check_live_names_op_and_argument(device: str) -> None:
    pool = PagedTokenToKVPoolAllocator(16, 4, device)
    extend(pool, [0], [2], [-1])  # slots 4, 5 live; 6, 7 never handed out
    pool.check_live("op", "arg", t([4, 5, 4], device), duplicates_ok=True)
    for bad, why in (([3], "reserved"), ([6], "never handed out"), ([8], "not allocated"), ([99], "outside"),
                     ([4, 4], "twice")):
        with pytest.raises(InvalidOperation, match=why) as e:
            pool.check_live("free", "free_index", t(bad, device), duplicates_ok=False)
        assert (e.value.op, e.value.argument) == ("free", "free_index")


def test_check_invariants_detects_leak_and_duplicates(device: str) -> None:
    pool = PagedTokenToKVPoolAllocator(16, 4, device)
    pool.free_pages = pool.free_pages[1:]  # page 1 neither free nor live
    with pytest.raises(InvariantViolation, match="G3"):
        pool.check_invariants()
    pool.free_pages = t([1, 1, 2, 3, 4], device)
    with pytest.raises(InvariantViolation, match="G1"):
        pool.check_invariants()


def test_restore_after_release_is_rejected(device: str) -> None:
    """A release may rewrite the backed-up window; the generation counter refuses such a restore."""
    pool = PagedTokenToKVPoolAllocator(16, 4, device)
    out = extend(pool, [0], [8], [-1])
    backup = pool.backup_state()
    pool.free(t(out[:1], device))
    with pytest.raises(InvalidOperation) as e:
        pool.restore_state(backup)
    assert (e.value.op, e.value.argument) == ("restore_state", "state")


def test_fifo_free_list_regrows_its_buffer(device: str) -> None:
    """At P == 1 releases append; past the buffer's room the list moves to a fresh buffer, order kept."""
    pool = PagedTokenToKVPoolAllocator(4, 1, device)
    expected = [1, 2, 3, 4]
    for i in range(40):
        slots = pool.alloc(3).tolist()
        assert slots == expected[:3]
        pool.free(t(slots[::-1] if i % 2 else slots, device))
        expected = expected[3:] + (slots[::-1] if i % 2 else slots)
        assert pool.free_pages.tolist() == expected
    pool.check_invariants()
