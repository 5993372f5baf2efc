"""Free groups and kv-row segment releases (SGLang 0.5.23; docs/contract.md "§1.5a"): the reference's order and
misuse rules on hand-made cases, and kvproof's runtime giving the same snapshots on the same calls. The lockstep
suites check both against SGLang itself (tests/adapters)."""

from __future__ import annotations

import pytest
import torch

from kvproof.gpu_runtime.swa_allocator import SWATokenToKVPoolAllocator
from kvproof.reference import swa_allocator as ref
from kvproof.reference.config import PoolConfig
from kvproof.reference.errors import InvalidOperation

P4 = PoolConfig(size_full=32, size_swa=32, page_size=4, sliding_window_size=4)
P1 = PoolConfig(size_full=8, size_swa=8, page_size=1, sliding_window_size=2)


def _three_requests(config: PoolConfig = P4) -> tuple[ref.SWAAllocatorState, list[tuple[int, ...]]]:
    s, reqs = ref.initial_state(config), []
    for _ in range(3):
        s, slots = ref.alloc_extend(s, [0], [4], [-1], 4)
        reqs.append(slots)
    return s, reqs  # pages 1, 2, 3


def test_a_group_holds_pages_back_and_gives_them_back_in_0_5_23_order() -> None:
    s, (a, _b, c) = _three_requests()
    ungrouped = ref.free(ref.free_segment(s, list(c), 0), list(a))
    assert ungrouped.full.free_pages[:3] == (1, 3, 4)  # each call prepends its own pages
    g = ref.free_group_begin(s)
    g = ref.free_segment(g, list(c), 0)
    g = ref.free(g, list(a))
    assert g.full.free_pages == s.full.free_pages and g.swa.free_pages == s.swa.free_pages  # held back
    assert g.full.owner[1] is None and g.full.owner[3] is None  # by nobody
    assert all(g.full_to_swa_index_mapping[x] == 0 for x in (*a, *c))  # the mapping is cleared at the call
    with pytest.raises(InvalidOperation, match="double free"):  # held by nobody now: freeing again is misuse
        ref.free(g, list(a))
    ended = ref.free_group_end(g)
    # free's sorted set first, then the segment's pages in front of it (the last pile given back is handed out first)
    assert ended.full.free_pages[:3] == (3, 1, 4) and ended.swa.free_pages[:3] == (1, 3, 4)
    assert ended.group is None and ended.full.owner[1] is None and ended.full.owner[3] is None


def test_segments_give_pages_back_in_the_segments_order() -> None:
    s, (a, _b, c) = _three_requests()
    s = ref.free(ref.free(s, list(a)), list(c))  # free list 3, 1, 4, ...
    s, row = ref.alloc_extend(s, [0], [8], [-1], 8)
    assert [x // 4 for x in row[::4]] == [3, 1]
    freed = ref.free_segment(s, list(row), 0)
    assert freed.full.free_pages[:2] == (3, 1)  # free() would sort: 1, 3
    assert ref.free(s, list(row)).full.free_pages[:2] == (1, 3)


def test_segment_misuse_is_refused() -> None:
    s, (a, b, _c) = _three_requests()
    evicted = ref.free_swa(s, list(a))
    with pytest.raises(InvalidOperation, match="no SWA peer"):
        ref.free_segment(evicted, list(a), 0)  # 0.5.23 with its checks off gives back SWA page 0 here (F2)
    assert ref.free_full_segment(evicted, list(a), 0).full.free_pages[0] == 1
    with pytest.raises(InvalidOperation, match="still maps"):
        ref.free_full_segment(s, list(b), 0)
    with pytest.raises(InvalidOperation, match="not page-aligned"):
        ref.free_segment(s, list(b[1:]), 1)
    with pytest.raises(InvalidOperation, match="not a kv-row segment"):
        ref.free_segment(s, [b[1], b[0], b[2], b[3]], 0)
    with pytest.raises(InvalidOperation, match="nested"):
        ref.free_group_begin(ref.free_group_begin(s))
    with pytest.raises(InvalidOperation, match="no free group is open"):
        ref.free_group_end(s)


def test_free_kv_row_segments_splits_at_the_eviction_cursor() -> None:
    s = ref.initial_state(P4)
    s, row = ref.alloc_extend(s, [0], [12], [-1], 12)
    s = ref.free_swa(s, list(row[:4]))  # the window left the first page
    segments = [(list(row[:8]), 0), (list(row[8:]), 8)]
    done = ref.free_kv_row_segments(s, segments, 4)
    assert done.full.free_pages[:3] == (3, 2, 1) and done.swa.free_pages[:2] == (3, 2)
    with pytest.raises(InvalidOperation, match="splits a page"):
        ref.free_kv_row_segments(s, segments, 2)
    with pytest.raises(InvalidOperation, match="shares a page"):
        ref.free_kv_row_segments(s, [(list(row[:6]), 0), (list(row[6:]), 6)], 4)
    with pytest.raises(InvalidOperation, match="no SWA peer"):  # the cursor short of the evicted page
        ref.free_kv_row_segments(s, segments, 0)


def _script(config: PoolConfig) -> list[tuple[str, tuple, dict]]:
    """Calls on both the reference and the runtime (slot values are the same: both hand out pages alike)."""
    p = config.page_size
    return [("alloc_extend" if p > 1 else "alloc", (0, 2 * p), {}), ("alloc_extend" if p > 1 else "alloc", (0, p), {}),
            ("free_group_begin", (), {}), ("free_swa", (list(range(p, 2 * p)),), {}),
            ("free_segment", (list(range(3 * p, 4 * p)),), {"start_pos": 0}),
            ("free_full_segment", (list(range(p, 2 * p)),), {"start_pos": 0}),
            ("free", (list(range(2 * p, 3 * p)),), {}), ("free_group_end", (), {})]


@pytest.mark.parametrize("config", [P4, P1], ids=["P4", "P1"])
def test_the_runtime_gives_the_reference_snapshots(config: PoolConfig) -> None:
    s, rt = ref.initial_state(config), SWATokenToKVPoolAllocator(config, device="cpu")

    def t(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64)

    for op, args, kw in _script(config):
        if op in ("alloc_extend", "alloc"):
            pre, seq = args
            if op == "alloc":
                s, _ = ref.alloc(s, seq)
                rt.alloc(seq)
            else:
                s, _ = ref.alloc_extend(s, [pre], [seq], [-1], seq)
                rt.alloc_extend(t([pre]), t([pre]), t([seq]), t([seq]), t([-1]), seq)
        elif args:
            s = getattr(ref, op)(s, args[0], *kw.values())
            getattr(rt, op)(t(args[0]), **kw)
        else:
            s = getattr(ref, op)(s)
            getattr(rt, op)()
        assert rt.snapshot() == ref.snapshot(s), op
