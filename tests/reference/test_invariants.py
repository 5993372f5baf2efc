"""Test the tester: check_invariants must reject hand-broken states, one per invariant."""

import pytest

from kvproof.reference import swa_allocator as sa
from kvproof.reference.config import PoolConfig
from kvproof.reference.errors import InvariantViolation
from kvproof.reference.invariants import check_invariants


def healthy() -> sa.SWAAllocatorState:
    st = sa.initial_state(PoolConfig(size_full=16, size_swa=8, page_size=2, sliding_window_size=2))
    st, _ = sa.alloc_extend(st, [0, 0], [3, 2], [-1, -1], 5)
    return st


def with_mapping(st: sa.SWAAllocatorState, **entries: int) -> sa.SWAAllocatorState:
    m = list(st.full_to_swa_index_mapping)
    for k, v in entries.items():
        m[int(k[1:])] = v
    return st.model_copy(update={"full_to_swa_index_mapping": tuple(m)})


BROKEN = {
    "G1 page 0 free": ("G1", lambda st: st.model_copy(update={"full": st.full.model_copy(
        update={"free_pages": (0, *st.full.free_pages)})})),
    "G1 duplicate": ("G1", lambda st: st.model_copy(update={"swa": st.swa.model_copy(
        update={"free_pages": st.swa.free_pages + st.swa.free_pages[:1]})})),
    "G3 leak": ("G3", lambda st: st.model_copy(update={"full": st.full.model_copy(
        update={"free_pages": st.full.free_pages[1:]})})),
    "M1 sentinel": ("M1", lambda st: with_mapping(st, m16=0, m17=0, m18=0)),
    "M1 page 0 mapped": ("M1", lambda st: with_mapping(st, m1=3)),
    "M2 slot of another owner": ("M2", lambda st: with_mapping(st, m6=2)),
    "M2 two live slots share one": ("M2", lambda st: with_mapping(st, m4=2)),
    "M2 points into free SWA page": ("M2", lambda st: with_mapping(st, m2=6, m3=7, m4=8)),
    "M5 offset": ("M5", lambda st: with_mapping(st, m2=3, m3=2)),
    "G3 orphan SWA page": ("G3", lambda st: with_mapping(st, m6=0, m7=0)),
}


def test_healthy_state_passes() -> None:
    check_invariants(healthy())


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_state_is_caught(name: str) -> None:
    invariant, breaker = BROKEN[name]
    with pytest.raises(InvariantViolation) as info:
        check_invariants(breaker(healthy()))
    assert info.value.invariant == invariant, str(info.value)
