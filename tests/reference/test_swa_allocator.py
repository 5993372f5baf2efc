"""Fixed vectors for the reference swa_allocator: S1, S3, S4 (sglang_semantics.md §9), typed errors."""

import pytest

from kvproof.reference import swa_allocator as sa
from kvproof.reference.arith import extend_parts, num_new_pages, swa_tail_len
from kvproof.reference.config import PoolConfig
from kvproof.reference.errors import ConfigError, InvalidOperation, OutOfMemory
from kvproof.reference.invariants import check_invariants

S1 = {1: 1, 100: 100, 191: 191, 192: 128, 200: 136, 255: 191, 256: 128, 8192: 128, 8200: 136}


@pytest.mark.parametrize(("length", "tail"), sorted(S1.items()))
def test_s1_swa_tail_len(length: int, tail: int) -> None:
    assert swa_tail_len(length, 128, 64) == tail


def test_extend_parts_geometry() -> None:
    # prefix 6, seq 17 at P=4: 2 tokens finish page 1, 8 fill 2 pages, 1 opens a page
    assert extend_parts(6, 17, 4) == (2, 8, 1)
    assert num_new_pages(6, 17, 4) == 3
    assert extend_parts(5, 7, 4) == (2, 0, 0)


def small(p: int = 2, full: int = 6, swa: int = 6, w: int = 2) -> sa.SWAAllocatorState:
    return sa.initial_state(PoolConfig(size_full=full, size_swa=swa, page_size=p, sliding_window_size=w))


def test_s3_post_fix_tail_clears_stale_mapping() -> None:
    """S3 steps 1-3: the draft leaves M[2]=2, M[3]=3 on free slots; the tail allocation must clear them."""
    st = small()
    backup = sa.backup_state(st)
    st, draft = sa.alloc_extend(st, [0], [2], [-1], 2)
    assert draft == (2, 3)
    st = sa.restore_state(st, backup)
    assert st.full_to_swa_index_mapping[2:4] == (2, 3)  # R3: the mapping is not restored
    st, b = sa.alloc_extend_swa_tail(st, [0], [4], [-1], 4, 2)
    assert b == (2, 3, 4, 5)
    assert [st.full_to_swa_index_mapping[f] for f in b] == [0, 0, 2, 3]
    check_invariants(st)
    st = sa.free_swa(st, b[:2])  # decode-time window eviction of positions 0, 1
    assert st.swa.free_pages == (2, 3), "nothing of B's live tail page may be released"
    check_invariants(st)


def test_s4_mask_case() -> None:
    """S4: copy-time M = [0,0,9,10,11,12] over 6 positions, load-time M = [0,0,0,0,21,22]."""
    cfg = PoolConfig(size_full=64, size_swa=32, page_size=1, sliding_window_size=2)
    st = sa.initial_state(cfg)
    st, old = sa.alloc(st, 6)
    rows = [[float(10 * j), float(10 * j + 1)] for j in range(6)]
    st = sa.set_kv_buffer(st, 0, old, rows, rows)  # layer 0 is the SWA layer
    st = sa.free_swa(st, old[:2])
    copy = sa.get_cpu_copy(st, old)
    assert copy.swa_mask == (False, False, True, True, True, True)
    assert copy.swa is not None and len(copy.swa[0]) == 4
    st = sa.free(st, old)
    st, new = sa.alloc(st, 6)
    st = sa.free_swa(st, new[:4])
    st = sa.load_cpu_copy(st, copy, new)
    m = st.full_to_swa_index_mapping
    assert [m[f] > 0 for f in new] == [False, False, False, False, True, True]
    got = sa.kv_rows(st, 0, [m[f] for f in new[4:]])
    assert got == (tuple(rows[4] + rows[4]), tuple(rows[5] + rows[5]))


def test_alloc_decode_is_atomic() -> None:
    """R7: upstream leaks full pages when the SWA pool is short; the reference changes nothing."""
    st = small(p=2, full=8, swa=2)
    st, a = sa.alloc_extend(st, [0], [2], [-1], 2)
    with pytest.raises(OutOfMemory) as info:
        sa.alloc_decode(st, [3], [a[-1]])
    assert info.value.pool == "swa"


@pytest.mark.parametrize(
    ("call", "argument"),
    [
        (lambda st, a: sa.free(st, [a[0], a[0]]), "free_index"),
        (lambda st, a: sa.free(st, [0]), "free_index"),
        (lambda st, a: sa.free(st, [99]), "free_index"),
        (lambda st, a: sa.free(sa.free(st, a), a), "free_index"),
        (lambda st, a: sa.free_full(st, a), "free_index"),
        (lambda st, a: sa.alloc(st, 3), "need_size"),
        (lambda st, a: sa.alloc_extend(st, [2], [3], [-1], 1), "last_loc"),
        (lambda st, a: sa.alloc_extend(st, [0], [3], [-1], 2), "extend_num_tokens"),
        (lambda st, a: sa.alloc_extend_swa_tail(st, [0], [5], [-1], 5, 4), "swa_tail_len"),
        (lambda st, a: sa.alloc_extend_swa_tail(st, [0, 0], [2, 2], [-1, -1], 4, 2), "seq_lens"),
        (lambda st, a: sa.alloc_decode(sa.free_swa(st, a), [4], [a[-1]]), "last_loc"),
        (lambda st, a: sa.restore_state(sa.free(st, a), sa.backup_state(st)), "state"),
        (lambda st, a: sa.set_kv_buffer(st, 7, a[:1], [[0.0, 0.0]], [[0.0, 0.0]]), "layer_id"),
        (lambda st, a: sa.load_cpu_copy(st, sa.get_cpu_copy(st, a), a[:1]), "indices"),
    ],
)
def test_misuse_is_typed_and_names_the_argument(call, argument: str) -> None:
    st = small(p=2, full=12, swa=12)
    st, a = sa.alloc_extend(st, [0], [3], [-1], 3)
    with pytest.raises(InvalidOperation) as info:
        call(st, a)
    assert info.value.argument == argument
    assert info.value.op in str(info.value)


def test_out_of_memory_names_the_pool() -> None:
    st = small(p=2, full=6, swa=2)
    with pytest.raises(OutOfMemory, match="swa pool needs 2 page"):
        sa.alloc_extend(st, [0], [3], [-1], 3)


# ---- ring mode: 0.5.23's per-request SWA ring (PoolConfig.swa_ring_size; docs/sglang-findings.md F8, SR1-SR3)

RING = PoolConfig(size_full=24, size_swa=12, page_size=2, sliding_window_size=3, swa_ring_size=3, num_req_slots=4)


def test_ring_config_validates_and_labels() -> None:
    assert (RING.ring, RING.swa_ring_cost, RING.label()) == (True, 4, "P2-W3-F24-S12-R3x4")
    plain = PoolConfig(size_full=24, size_swa=12, page_size=2, sliding_window_size=3)
    assert (plain.ring, plain.swa_ring_cost, plain.label()) == (False, 0, "P2-W3-F24-S12")  # unchanged label
    with pytest.raises(ConfigError, match=r"PoolConfig\.num_req_slots: required with swa_ring_size"):
        PoolConfig(size_full=24, size_swa=12, page_size=2, sliding_window_size=3, swa_ring_size=3)
    with pytest.raises(ConfigError, match=r"PoolConfig\.num_req_slots: only with swa_ring_size"):
        PoolConfig(size_full=24, size_swa=12, page_size=2, sliding_window_size=3, num_req_slots=2)
    with pytest.raises(ConfigError, match=r"PoolConfig\.swa_ring_size"):
        PoolConfig(size_full=24, size_swa=12, page_size=2, sliding_window_size=3, swa_ring_size=0, num_req_slots=2)


def test_ring_sizes_are_full_only_and_slot_counted() -> None:
    """SR1, SR2: available_size is the full pool's; swa_available_size is free slots x ceil(ring / P) * P."""
    st = sa.initial_state(RING)
    assert (sa.available_size(st), sa.full_available_size(st), sa.swa_available_size(st)) == (24, 24, 16)
    st, slots = sa.alloc_req_slots(st, 3)
    assert slots == (2, 3, 4) and st.req_slots == (1,)  # ReqToTokenPool.alloc_rows: the tail of the free list
    assert (sa.available_size(st), sa.swa_available_size(st)) == (24, 4)
    st = sa.free_req_slots(st, [3, 2])
    assert st.req_slots == (1, 3, 2) and sa.swa_available_size(st) == 12  # free_rows appends in the order given
    with pytest.raises(OutOfMemory, match="alloc_req_slots: req_slots pool needs 4"):
        sa.alloc_req_slots(st, 4)


def test_ring_allocations_take_full_pages_only_and_never_map() -> None:
    """SR3: every allocation takes full pages only (capacity: the full pool's) and leaves M at 0; M5 does not apply."""
    st = sa.initial_state(RING)
    swa_free, mapping = st.swa.free_pages, st.full_to_swa_index_mapping
    st, a = sa.alloc_extend(st, [0], [5], [-1], 5)
    st, d = sa.alloc_decode(st, [6], [a[-1]])  # continues a page whose SWA side was never mapped: fine on a ring
    st, tl = sa.alloc_extend_swa_tail(st, [0], [4], [-1], 4, 2)
    st, b = sa.alloc(st, 4)
    assert (a, d, tl, b) == ((2, 3, 4, 5, 6), (7,), (8, 9, 10, 11), (12, 13, 14, 15))
    assert st.swa.free_pages == swa_free and st.full_to_swa_index_mapping == mapping
    assert sa.available_size(st) == 24 - 14 and sa.swa_available_size(st) == 16  # 7 full pages taken
    check_invariants(st)
    # the paged SWA pool (6 pages) never gates: the 5 pages left fit one request
    st, _ = sa.alloc_extend(st, [0], [10], [-1], 10)
    assert sa.available_size(st) == 0
    with pytest.raises(OutOfMemory, match="full pool"):
        sa.alloc_extend(st, [0], [1], [-1], 1)


def test_ring_releases_never_credit_swa() -> None:
    """free_swa / free_swa_segment release nothing; free / free_segment only the full side; clear keeps the slots."""
    st = sa.initial_state(RING)
    st, (slot,) = sa.alloc_req_slots(st, 1)
    assert slot == 4
    st, a = sa.alloc_extend(st, [0], [6], [-1], 6)
    before = st
    assert sa.free_swa(st, list(a)) is st
    assert sa.free_swa_segment(st, list(a[:2]), 0) is st
    with pytest.raises(InvalidOperation, match="double free"):
        sa.free_swa(sa.free(st, list(a)), list(a))  # still validated
    st = sa.free_segment(st, list(a[:4]), 0)
    st = sa.free(st, list(a[4:]))
    assert st.full.free_pages != before.full.free_pages and st.swa == before.swa
    assert (sa.available_size(st), sa.swa_available_size(st)) == (24, 12)
    st = sa.clear(st)
    assert st.req_slots == (1, 2, 3) and sa.swa_available_size(st) == 12  # ReqToTokenPool is not the allocator's


def test_req_slot_misuse_is_rejected() -> None:
    st = sa.initial_state(RING)
    with pytest.raises(InvalidOperation, match="request slot 2 is not held"):
        sa.free_req_slots(st, [2])
    st, (slot,) = sa.alloc_req_slots(st, 1)
    with pytest.raises(InvalidOperation, match="not held"):
        sa.free_req_slots(st, [slot, slot])
    with pytest.raises(InvalidOperation, match=r"outside \[1, 4\]"):
        sa.free_req_slots(st, [0])
    with pytest.raises(InvalidOperation, match="need_size: must be >= 0"):
        sa.alloc_req_slots(st, -1)
    with pytest.raises(InvalidOperation, match="no per-request SWA ring"):
        sa.alloc_req_slots(small(), 1)
    with pytest.raises(InvalidOperation, match="no per-request SWA ring"):
        sa.free_req_slots(small(), [1])
